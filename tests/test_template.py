"""k3chat.template: XTML rendering (goldens A-E), encoding, strict and lenient parsing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3chat.template import (
    Grammar,
    MalformedTurn,
    ParsedTurn,
    Segment,
    StreamParser,
    TemplateError,
    encode,
    render,
    render_text,
)
from k3chat.tokenizer import Tokenizer
from k3engine.tokenizer_files import write_fixture_tokenizer

# ---------------------------------------------------------------------------------------
# Goldens, typed from spec 2.1


def BODY(e: str) -> str:
    return (
        "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
        "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={e}`."
    )


def EFF(e: str) -> str:
    return '<|open|>message role="system" type="thinking-effort"<|sep|>' + BODY(e) + "<|close|>message<|sep|><|end_of_msg|>"


def MSG(r: str, x: str) -> str:
    return '<|open|>message role="' + r + '"<|sep|>' + x + "<|close|>message<|sep|><|end_of_msg|>"


def AON(rs: str, x: str) -> str:
    return (
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>' + rs
        + "<|close|>think<|sep|><|open|>response<|sep|>" + x
        + "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )


def AOFF(x: str) -> str:
    return (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>' + x
        + "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )


GON = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GOFF = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
SH = MSG("system", "You are helpful.") + MSG("user", "Hello")
GOLDEN_TEXT = {
    "A": EFF("max") + SH + GON,
    "B": EFF("low") + SH + GON,
    "C": SH + GOFF,
    "D": EFF("max") + MSG("user", "Numbers?") + AON("I'll remember 215 and 222.", "473, 921, 235")
    + MSG("user", "What were the other two?") + GON,
    "E": MSG("user", "Numbers?") + AOFF("473, 921, 235") + MSG("user", "What were the other two?") + GOFF,
}

SH_MSGS = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"}]
NUM_MSGS = [
    {"role": "user", "content": "Numbers?"},
    {"role": "assistant", "content": "473, 921, 235", "reasoning_content": "I'll remember 215 and 222."},
    {"role": "user", "content": "What were the other two?"},
]
# name -> (messages, thinking, effort)
GOLDEN_INPUT = {
    "A": (SH_MSGS, True, "max"),
    "B": (SH_MSGS, True, "low"),
    "C": (SH_MSGS, False, "max"),  # effort is kept but not rendered with thinking off
    "D": (NUM_MSGS, True, "max"),
    "E": (NUM_MSGS, False, None),  # reasoning is dropped from the rendering only
}
# spec 2.1 table: segments, control segments, control order
GOLDEN_SHAPE = {
    "A": (50, 19, "OSCSE OSCSE OSCSE OSOS"),
    "B": (50, 19, "OSCSE OSCSE OSCSE OSOS"),
    "C": (34, 14, "OSCSE OSCSE OSOS"),
    "D": (75, 32, "OSCSE OSCSE OSOSCSOSCSCSE OSCSE OSOS"),
    "E": (52, 23, "OSCSE OSOSCSCSE OSCSE OSOS"),
}
LETTER = {"<|open|>": "O", "<|close|>": "C", "<|sep|>": "S", "<|end_of_msg|>": "E"}


def golden(name: str, **kw: object) -> list[Segment]:
    msgs, thinking, effort = GOLDEN_INPUT[name]
    return render(msgs, thinking=thinking, effort=effort, add_generation_prompt=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tpl_tok")
    write_fixture_tokenizer(d)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def gram(tok: Tokenizer) -> Grammar:
    return Grammar.from_tokenizer(tok)


# ---------------------------------------------------------------------------------------
# Rendering


@pytest.mark.parametrize("name", sorted(GOLDEN_TEXT))
def test_golden_text(name: str) -> None:
    assert render_text(golden(name)).encode("utf-8") == GOLDEN_TEXT[name].encode("utf-8")


@pytest.mark.parametrize("name", sorted(GOLDEN_SHAPE))
def test_golden_segments_and_control_order(name: str) -> None:
    segs = golden(name)
    n_seg, n_ctl, order = GOLDEN_SHAPE[name]
    controls = [s.text for s in segs if s.allow_special]
    assert (len(segs), len(controls)) == (n_seg, n_ctl)
    assert "".join(LETTER[c] for c in controls) == order.replace(" ", "")
    assert all(s.text for s in segs)  # no empty segment


def test_attributes_are_four_text_segments() -> None:
    segs = golden("A")
    assert segs[:16] == [
        ("<|open|>", True), ("message", False), (" role", False), ('="', False), ("system", False),
        ('"', False), (" type", False), ('="', False), ("thinking-effort", False), ('"', False),
        ("<|sep|>", True), (BODY("max"), False), ("<|close|>", True), ("message", False),
        ("<|sep|>", True), ("<|end_of_msg|>", True),
    ]


def test_effort_body_bytes() -> None:
    assert [len(BODY(e).encode()) for e in ("max", "low", "high")] == [223, 223, 224]
    for e in ("low", "high", "max"):
        segs = render([], thinking=True, effort=e, add_generation_prompt=False)
        assert [s.text for s in segs if s.text.startswith("`thinking")] == [BODY(e)]  # one segment


@pytest.mark.parametrize("bad", ["medium", "MAX", "", "none", " max"])
def test_effort_validation(bad: str) -> None:
    with pytest.raises(TemplateError, match="low, high or max"):
        render(SH_MSGS, thinking=True, effort=bad, add_generation_prompt=True)
    with pytest.raises(TemplateError):  # a bad setting is an error even while thinking is off
        render(SH_MSGS, thinking=False, effort=bad, add_generation_prompt=True)


def test_no_effort_message_without_effort_or_thinking() -> None:
    assert render_text(render(SH_MSGS, thinking=True, effort=None, add_generation_prompt=True)) == SH + GON
    assert render_text(render(SH_MSGS, thinking=False, effort="high", add_generation_prompt=True)) == SH + GOFF


def test_no_generation_prompt_ends_at_last_end_of_msg() -> None:
    text = render_text(render(NUM_MSGS, thinking=True, effort="max", add_generation_prompt=False))
    assert text == GOLDEN_TEXT["D"][: -len(GON)]


def test_reasoning_rules() -> None:
    def assistant_text(reasoning: object, thinking: bool) -> str:
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": reasoning}]
        return render_text(render(msgs, thinking=thinking, effort=None, add_generation_prompt=False))[len(MSG("user", "q")):]

    assert assistant_text("  \n\t", True) == AON("", "a")  # official strip rule
    assert assistant_text(None, True) == AON("", "a")  # a thinking-off turn, replayed with thinking on
    assert assistant_text(" why \n", True) == AON(" why \n", "a")  # never trimmed
    assert assistant_text("why", False) == AOFF("a")


def test_content_exact_and_empty() -> None:
    msgs = [{"role": "user", "content": "  hi <b>&\"\n"}, {"role": "assistant", "content": ""}]
    segs = render(msgs, thinking=False, effort=None, add_generation_prompt=False)
    assert ("  hi <b>&\"\n", False) in segs
    assert render_text(segs) == MSG("user", '  hi <b>&"\n') + AOFF("")
    assert len(segs) == 12 + 17  # the empty response has no text segment


def test_interrupted_records() -> None:
    user = {"role": "user", "content": "q"}
    empty = {"role": "assistant", "content": "", "reasoning_content": "", "interrupted": True}
    part = {"role": "assistant", "content": "", "reasoning_content": "hmm", "interrupted": True}
    text = render_text(render([user, empty, user], thinking=True, effort=None, add_generation_prompt=False))
    assert text == MSG("user", "q") * 2
    text = render_text(render([user, part], thinking=True, effort=None, add_generation_prompt=False))
    assert text == MSG("user", "q") + AON("hmm", "")  # rendered closed; the flag is never rendered


def test_unknown_role_refused() -> None:
    with pytest.raises(TemplateError, match="role"):
        render([{"role": "narrator", "content": "x"}], thinking=False, effort=None, add_generation_prompt=False)


def test_tool_declare_and_block() -> None:
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"b": 1, "a": "é"}}}]
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "function": {"name": "get", "arguments": '{"city": "Paris", "n": 2, "ok": true, "x": null}'}},
            {"id": "c2", "function": {"name": "a&\"b", "arguments": "{oops"}},
            {"id": "c3", "function": {"name": "none", "arguments": ""}},
        ]},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
    ]
    text = render_text(render(msgs, thinking=False, effort=None, add_generation_prompt=False, tools=tools))
    declare = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, '
        'described in JSONSchema.\n\n```json\n[{"function":{"name":"get","parameters":{"a":"é","b":1}},'
        '"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
    )
    calls = (
        '<|open|>tools<|sep|>'
        '<|open|>call tool="get" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>2<|close|>argument<|sep|>'
        '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|>'
        '<|open|>argument key="x" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|close|>call<|sep|>'
        '<|open|>call tool="a&amp;&quot;b" index="2"<|sep|>'
        '<|open|>json type="object"<|sep|>{oops<|close|>json<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="none" index="3"<|sep|><|close|>call<|sep|>'
        '<|close|>tools<|sep|>'
    )
    assistant = GOFF + "<|close|>response<|sep|>" + calls + "<|close|>message<|sep|><|end_of_msg|>"
    results = (  # re-sorted into call order by tool_call_id
        '<|open|>message role="tool" tool="get" index="1"<|sep|>r1<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="a&amp;&quot;b" index="2"<|sep|>r2<|close|>message<|sep|><|end_of_msg|>'
    )
    assert text == declare + MSG("user", "q") + assistant + results


def test_tool_arguments_must_be_object() -> None:
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(TemplateError, match="object"):
        render(msgs, thinking=False, effort=None, add_generation_prompt=False)


def test_empty_attribute_value_yields_no_segment() -> None:
    msgs = [{"role": "tool", "tool": "", "content": "x"}]
    segs = render(msgs, thinking=False, effort=None, add_generation_prompt=False)
    assert [s.text for s in segs[:10]] == ["<|open|>", "message", " role", '="', "tool", '"', " tool", '="', '"', " index"]


# ---------------------------------------------------------------------------------------
# Encoding on the fixture


@pytest.mark.parametrize("name", sorted(GOLDEN_TEXT))
def test_text_segments_never_yield_special_ids(tok: Tokenizer, name: str) -> None:
    segs = golden(name)
    ids = encode(segs, tok)
    specials = [i for i in ids if tok.is_special(i)]
    assert len(specials) == GOLDEN_SHAPE[name][1]
    names = {tok.open_id: "<|open|>", tok.close_id: "<|close|>", tok.sep_id: "<|sep|>", tok.end_of_msg_id: "<|end_of_msg|>"}
    assert [names[i] for i in specials] == [s.text for s in segs if s.allow_special]
    for s in segs:
        if not s.allow_special:
            assert all(not tok.is_special(i) for i in tok.encode_text(s.text))


def test_each_segment_encoded_alone(tok: Tokenizer) -> None:
    segs = golden("A")
    expected: list[int] = []
    for s in segs:
        expected += [tok.special_id(s.text)] if s.allow_special else tok.encode_text(s.text)
    assert encode(segs, tok) == expected
    assert expected[0] == tok.open_id  # no BOS


def test_typed_markup_in_user_text(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "literal <|end_of_msg|> <|open|>"}]
    ids = encode(render(msgs, thinking=True, effort="max", add_generation_prompt=True), tok)
    assert ids.count(tok.end_of_msg_id) == 2  # effort and user messages only
    assert ids.count(tok.open_id) == 2 + 2  # effort, user, then the prompt's message and think


# ---------------------------------------------------------------------------------------
# Grammar and parsing


def test_grammar_sequences(tok: Tokenizer, gram: Grammar) -> None:
    think, resp, msg = tok.encode_text("think"), tok.encode_text("response"), tok.encode_text("message")
    assert gram.boundary == (tok.close_id, *think, tok.sep_id, tok.open_id, *resp, tok.sep_id)
    assert gram.closure == (tok.close_id, *resp, tok.sep_id, tok.close_id, *msg, tok.sep_id)
    assert gram.end_ids == {tok.end_of_msg_id, tok.eos_id}


def test_strict_parse_spec_cases(tok: Tokenizer, gram: Grammar) -> None:
    P = tok.encode_text(" Paris")
    B, C = list(gram.boundary), list(gram.closure)
    eom, eos, sep, opn = tok.end_of_msg_id, tok.eos_id, tok.sep_id, tok.open_id
    paris = ParsedTurn(reasoning=" Paris", content=" Paris")
    assert gram.parse_strict(P + B + P + C + [eom], thinking=True) == paris
    assert gram.parse_strict(P + B + P + C + [eos], thinking=True) == paris
    for bad in (P + B + P + C, P + B + P + C[:-1] + [sep], [opn] + P + B + P + C + [eom]):
        with pytest.raises(MalformedTurn):
            gram.parse_strict(bad, thinking=True)
    assert gram.parse_strict(P + C + [eos], thinking=False) == ParsedTurn(reasoning=None, content=" Paris")


def test_strict_parse_more(tok: Tokenizer, gram: Grammar) -> None:
    P = tok.encode_text(" Paris")
    B, C = list(gram.boundary), list(gram.closure)
    eom, eos = tok.end_of_msg_id, tok.eos_id
    assert gram.parse_strict(B + C + [eom], thinking=True) == ParsedTurn("", "")
    cases = {
        "no boundary": (P + C + [eom], True),
        "two end ids": (P + B + P + C + [eom, eos], True),
        "ids after the closure": (P + B + P + C + P + [eom], True),
        "not closed": (P + B + P + [eom], True),
        "special in content": (P + B + P + [tok.special_id("[EOT]")] + C + [eom], True),
        "boundary with thinking off": (P + B + P + C + [eom], False),
        "tools block": (P + C[:4] + [tok.open_id] + tok.encode_text("tools") + [tok.sep_id], False),
        "empty": ([], False),
    }
    for name, (ids, thinking) in cases.items():
        with pytest.raises(MalformedTurn) as err:
            gram.parse_strict(ids, thinking=thinking)
        assert err.value.reason, name


def test_strict_parse_decodes_parts_separately(tok: Tokenizer, gram: Grammar) -> None:
    b = [tok.encoding.encode_single_token(bytes([x])) for x in "中".encode()]
    B, C = list(gram.boundary), list(gram.closure)
    # A character split by the boundary is two replacement runs, not one character.
    got = gram.parse_strict(b[:2] + B + b[2:] + C + [tok.eos_id], thinking=True)
    assert got == ParsedTurn("\ufffd", "\ufffd")


def test_lenient_parse(tok: Tokenizer, gram: Grammar) -> None:
    P = tok.encode_text(" Paris")
    B, C = list(gram.boundary), list(gram.closure)
    eom, eos, opn = tok.end_of_msg_id, tok.eos_id, tok.open_id
    on = lambda ids: gram.parse_lenient(ids, thinking=True)  # noqa: E731
    off = lambda ids: gram.parse_lenient(ids, thinking=False)  # noqa: E731
    assert on([]) == ParsedTurn("", "")
    assert on(P) == ParsedTurn(" Paris", "")
    assert on(P + B[:3]) == ParsedTurn(" Paris", "")  # a dangling partial boundary is dropped
    assert on(P + B + P) == ParsedTurn(" Paris", " Paris")
    assert on(P + B + P + C[:2]) == ParsedTurn(" Paris", " Paris")
    assert on(P + B + P + C + [eom]) == ParsedTurn(" Paris", " Paris")
    assert on(P + [opn] + P + B + P) == ParsedTurn(" Paris", "")  # cut at a stray special
    assert on(P + B + P + [eos] + P) == ParsedTurn(" Paris", " Paris")
    assert on(P + B + P + B + P) == ParsedTurn(" Paris", " Paris")  # a second boundary cuts
    assert off(P + [eos]) == ParsedTurn(None, " Paris")
    assert off(P + B + P) == ParsedTurn(None, " Paris")
    assert off(P + C + P) == ParsedTurn(None, " Paris")


def test_stream_parser(tok: Tokenizer, gram: Grammar) -> None:
    reasoning = tok.encode_text("我想 think") + [tok.encoding.encode_single_token(bytes([x])) for x in "中".encode()]
    P = tok.encode_text(" Paris")
    ids = reasoning + list(gram.boundary) + P + list(gram.closure) + [tok.end_of_msg_id]
    sp = StreamParser(gram, thinking=True)
    events: list[tuple[str, str]] = []
    for i in ids:
        events += sp.push(i)
    events += sp.finish()
    joined: dict[str, str] = {}
    for ch, text in events:
        joined[ch] = joined.get(ch, "") + text
    assert joined == {"reasoning": "我想 think中", "content": " Paris"}
    assert sp.channel == "done"
    sp = StreamParser(gram, thinking=False)
    out = [e for i in P + list(gram.closure)[:3] for e in sp.push(i)] + sp.finish()
    assert "".join(t for _, t in out) == " Paris"


# ---------------------------------------------------------------------------------------
# Real ids (need K3_TOK_FILES)

A_IDS = [int(x) for x in """163587,2778,6244,878,14062,1,1798,878,130400,59991,470,1,163589,63,130400,123074,470,63,28560,418,1632,2455,308,2704,306,651,9545,8491,347,2976,3411,276,4503,8491,904,9141,4661,3867,1268,1332,5713,1268,50004,5713,1268,19421,5713,316,1268,5354,16518,10048,276,2403,387,42070,472,1268,130400,123074,470,105281,11369,163588,2778,163589,163586,163587,2778,6244,878,14062,1,163589,3900,554,13205,13,163588,2778,163589,163586,163587,2778,6244,878,2482,1,163589,19180,163588,2778,163589,163586,163587,2778,6244,878,69702,1,163589,163587,39964,163589""".split(",")]
C_IDS = [int(x) for x in """163587,2778,6244,878,14062,1,163589,3900,554,13205,13,163588,2778,163589,163586,163587,2778,6244,878,2482,1,163589,19180,163588,2778,163589,163586,163587,2778,6244,878,69702,1,163589,163587,12092,163589""".split(",")]
E_IDS = [int(x) for x in """163587,2778,6244,878,2482,1,163589,38587,30,163588,2778,163589,163586,163587,2778,6244,878,69702,1,163589,163587,12092,163589,42780,11,220,49114,11,220,23782,163588,12092,163589,163588,2778,163589,163586,163587,2778,6244,878,2482,1,163589,5376,1646,276,1356,2069,30,163588,2778,163589,163586,163587,2778,6244,878,69702,1,163589,163587,12092,163589""".split(",")]


@pytest.fixture(scope="module")
def real_tok() -> Tokenizer:
    d = os.environ.get("K3_TOK_FILES")
    if not d:
        pytest.skip("K3_TOK_FILES is not set: golden id vectors need the real tiktoken.model (spec 2.2)")
    return Tokenizer.from_dir(Path(d))


def test_golden_ids(real_tok: Tokenizer) -> None:
    assert len(A_IDS) == 104 and len(C_IDS) == 37 and len(E_IDS) == 64
    b_ids = A_IDS[:61] + [28, 1332] + A_IDS[62:]
    assert encode(golden("A"), real_tok) == A_IDS
    assert encode(golden("B"), real_tok) == b_ids and len(b_ids) == 105
    assert encode(golden("C"), real_tok) == C_IDS
    assert encode(golden("E"), real_tok) == E_IDS
    r = real_tok.encode_text("I'll remember 215 and 222.")
    d_ids = A_IDS[:67] + E_IDS[:20] + [163587, 39964, 163589] + r + [163588, 39964, 163589] + E_IDS[20:61] + [163587, 39964, 163589]
    assert encode(golden("D"), real_tok) == d_ids and len(d_ids) == 137 + len(r)


def test_real_typed_markup_and_paris(real_tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "literal <|end_of_msg|> <|open|>"}]
    ids = encode(render(msgs, thinking=True, effort="max", add_generation_prompt=True), real_tok)
    assert ids.count(163586) == 2
    g = Grammar(real_tok)
    assert g.boundary == (163588, 39964, 163589, 163587, 12092, 163589)
    assert g.closure == (163588, 12092, 163589, 163588, 2778, 163589)
    ok = [17374, *g.boundary, 17374, *g.closure]
    assert g.parse_strict(ok + [163586], thinking=True) == ParsedTurn(" Paris", " Paris")
    assert g.parse_strict(ok + [163585], thinking=True) == ParsedTurn(" Paris", " Paris")


def test_chat_core_does_not_import_textual() -> None:
    import subprocess
    import sys

    code = (
        "import sys, k3chat.tokenizer, k3chat.template, k3chat.sampler; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'textual']; print(bad); sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

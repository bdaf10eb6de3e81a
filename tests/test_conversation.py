"""The conversation loop on the tiny fixture: what is fed, what is stored, what is reused.

Session.feed is spied on, so every test counts the tokens the engine really received. With
random weights the model never closes its turn, so tests that need a well-formed answer script
the sampled ids (canonical text plus BOUNDARY / CLOSURE / END) and let the engine run as usual.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from k3chat import statefile
from k3chat.conversation import ContextOverflow, Conversation, ConversationError, state_path
from k3chat.events import AnswerToken, Notice, PhaseChanged, Prefill, ReasoningToken, TurnDone
from k3chat.history import HistoryStore
from k3chat.sampler import Sampler, SamplerSettings
from k3chat.template import Grammar, encode, render
from k3chat.tokenizer import Tokenizer
from k3engine.model import Model, Session


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Model:
    return Model(tiny_dir, threads=2)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def store(home: Path) -> HistoryStore:
    return HistoryStore()


class FeedSpy:
    """Every Session.feed call: the ids passed, in order."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def mark(self) -> int:
        return len(self.calls)

    def since(self, mark: int) -> list[int]:
        return [i for call in self.calls[mark:] for i in call]


@pytest.fixture
def fed(monkeypatch: pytest.MonkeyPatch) -> FeedSpy:
    spy = FeedSpy()
    real = Session.feed

    def feed(self: Session, ids: Any, **kw: Any) -> Any:
        spy.calls.append([int(i) for i in ids])
        return real(self, ids, **kw)

    monkeypatch.setattr(Session, "feed", feed)
    return spy


class Script:
    """A sampler factory that emits scripted ids (one script per turn) and records turns."""

    def __init__(self, *scripts: list[int], after: Callable[[int], None] | None = None) -> None:
        self.scripts = list(scripts)
        self.turns: list[int] = []
        self.samples = 0
        self.after = after

    def __call__(self, settings: SamplerSettings, turn: int) -> Any:
        self.turns.append(turn)
        ids = iter(self.scripts.pop(0))
        outer = self

        class _S:
            def sample(self, logits: Any) -> int:
                assert np.asarray(logits).shape == (1280,)
                outer.samples += 1
                value = next(ids)
                if outer.after is not None:
                    outer.after(outer.samples)
                return value

        return _S()


def answer(tok: Tokenizer, reasoning: str | None, content: str, end: str = "eom") -> list[int]:
    g = Grammar(tok)
    ids: list[int] = []
    if reasoning is not None:
        ids += tok.encode_text(reasoning) + list(g.boundary)
    ids += tok.encode_text(content) + list(g.closure)
    return ids + [tok.end_of_msg_id if end == "eom" else tok.eos_id]


def prompt_of(conv: Conversation, records: list[dict[str, Any]]) -> list[int]:
    return encode(render(records, thinking=conv.thinking, effort=conv.effort if conv.thinking else None,
                         add_generation_prompt=True), conv.tokenizer)


def make(model: Model, tok: Tokenizer, store: HistoryStore, sid: str | None = None, **kw: Any) -> Conversation:
    if sid is None:
        sid = store.create("test").id
    return Conversation(model, tok, store, sid, **kw)


def plain(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("role", "content", "reasoning_content", "interrupted")
    return [{k: r[k] for k in keep if k in r} for r in records]


# --------------------------------------------------------------------------- reuse


def test_turn_two_feeds_only_its_new_tokens(model: Model, tok: Tokenizer, store: HistoryStore, fed: FeedSpy) -> None:
    a1 = answer(tok, " Let me see.", " It is Paris.")
    a2 = answer(tok, " Hmm.", " Lyon too.")
    script = Script(a1, a2)
    conv = make(model, tok, store, sampler_factory=script)
    events: list[Any] = []

    m = fed.mark()
    r1 = conv.send("Where is the Louvre?", system="Be brief.", on_event=events.append)
    p1 = prompt_of(conv, conv.records[:2])
    assert r1 is not None and (r1.stop, r1.interrupted) == ("end", False)
    assert (r1.reasoning, r1.answer) == (" Let me see.", " It is Paris.")
    assert (r1.prompt_tokens, r1.reused_tokens, r1.prefilled_tokens) == (len(p1), 0, len(p1))
    # Every prompt id once, then each sampled id except the end id, in order.
    assert fed.since(m) == p1 + a1[:-1]
    assert conv._session.ids == p1 + a1[:-1]
    assert r1.sync_tokens == 0 and r1.state_saved

    m = fed.mark()
    r2 = conv.send("And the Musée des Confluences?", on_event=events.append)
    p2 = prompt_of(conv, conv.records[:4])
    f1 = p1 + a1[:-1]
    assert p2[: len(f1)] == f1
    assert r2 is not None and r2.reuse_source == "live"
    assert (r2.prompt_tokens, r2.reused_tokens, r2.prefilled_tokens) == (len(p2), len(f1), len(p2) - len(f1))
    assert fed.since(m) == p2[len(f1):] + a2[:-1]  # only the new tokens, then the answer
    assert script.turns == [1, 2]

    stored = plain(conv.records)
    assert stored == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is the Louvre?"},
        {"role": "assistant", "content": " It is Paris.", "reasoning_content": " Let me see."},
        {"role": "user", "content": "And the Musée des Confluences?"},
        {"role": "assistant", "content": " Lyon too.", "reasoning_content": " Hmm."},
    ]
    assert plain(store.load(conv.session_id).records) == stored
    # Events: prefill, then reasoning text, then the answer, then done, per turn.
    kinds = [type(e).__name__ + (f":{e.phase}" if isinstance(e, PhaseChanged) else "") for e in events]
    first = kinds[: kinds.index("TurnDone") + 1]
    assert first.index("PhaseChanged:reasoning") < first.index("ReasoningToken") < first.index("PhaseChanged:answer")
    assert first.index("PhaseChanged:answer") < first.index("AnswerToken") < first.index("PhaseChanged:done")
    text = "".join(e.text for e in events[: kinds.index("TurnDone")] if isinstance(e, AnswerToken))
    assert text == " It is Paris."
    assert "".join(e.text for e in events[: kinds.index("TurnDone")] if isinstance(e, ReasoningToken)) == " Let me see."
    assert isinstance(events[kinds.index("TurnDone")], TurnDone)


@pytest.mark.parametrize("end", ["eom", "eos"])
def test_either_end_id_stops_and_is_never_fed(model: Model, tok: Tokenizer, store: HistoryStore,
                                              fed: FeedSpy, end: str) -> None:
    ids = answer(tok, None, " Yes.", end=end)
    junk = tok.encode_text(" never sampled")
    script = Script(ids + junk)
    conv = make(model, tok, store, thinking=False, sampler_factory=script, state_files=False)
    m = fed.mark()
    r = conv.send("Sure?")
    p = prompt_of(conv, conv.records[:1])
    assert r is not None and r.stop == "end" and not r.interrupted and r.answer == " Yes."
    assert r.generated_ids == ids and script.samples == len(ids)  # nothing sampled after the end id
    assert fed.since(m) == p + ids[:-1]
    assert conv._session.ids == p + ids[:-1]  # the end id never reached the engine
    assert "reasoning_content" not in conv.records[-1]


def test_regenerate_and_edit_last_feed_only_the_tail(model: Model, tok: Tokenizer, store: HistoryStore,
                                                      fed: FeedSpy) -> None:
    a1 = answer(tok, " a", " One.")
    a2 = answer(tok, " b", " Two.")
    a2b = answer(tok, " c", " Two again.")
    a2c = answer(tok, " d", " Edited.")
    script = Script(a1, a2, a2b, a2c)
    conv = make(model, tok, store, sampler_factory=script)
    conv.send("First question")
    conv.send("Second question")
    p1 = prompt_of(conv, conv.records[:1])
    f1 = p1 + a1[:-1]  # the state when turn 2 began: its turn-boundary snapshot
    p2 = prompt_of(conv, conv.records[:3])

    m = fed.mark()
    r = conv.regenerate()
    assert r.reuse_source == "snapshot" and r.reused_tokens == len(f1)
    assert fed.since(m) == p2[len(f1):] + a2b[:-1]
    assert r.answer == " Two again." and script.turns[-1] == 2  # same turn number as the answer replaced
    assert [x["content"] for x in conv.records] == ["First question", " One.", "Second question", " Two again."]

    m = fed.mark()
    r = conv.edit_last("Second question, rephrased")
    p2e = prompt_of(conv, conv.records[:3])
    assert r is not None and r.reuse_source == "snapshot" and r.reused_tokens == len(f1)
    assert fed.since(m) == p2e[len(f1):] + a2c[:-1]
    assert script.turns[-1] == 2
    loaded = store.load(conv.session_id)
    assert [x["content"] for x in loaded.records] == ["First question", " One.", "Second question, rephrased",
                                                      " Edited."]
    assert not loaded.problems
    assert HistoryStore().info(conv.session_id).n_messages == 4  # the index follows, in another instance too
    # Superseded records are not deleted: the file still holds every answer ever given.
    raw = (store.root / f"{conv.session_id}.jsonl").read_text()
    assert " Two." in raw and " Two again." in raw


def test_regenerate_first_answer_keeps_the_effort_prefix(model: Model, tok: Tokenizer, store: HistoryStore,
                                                          fed: FeedSpy) -> None:
    script = Script(answer(tok, " x", " A."), answer(tok, " y", " B."))
    conv = make(model, tok, store, sampler_factory=script)
    conv.send("Question")
    p1 = prompt_of(conv, conv.records[:1])
    boundary = len(encode(render([], thinking=True, effort="max", add_generation_prompt=False), tok))
    assert boundary > 0
    m = fed.mark()
    r = conv.regenerate()
    assert (r.reuse_source, r.reused_tokens) == ("snapshot", boundary)
    assert fed.since(m)[: len(p1) - boundary] == p1[boundary:]


# --------------------------------------------------------------------------- refusals and stops


def test_overflow_is_refused_before_the_history_changes(model: Model, tok: Tokenizer, store: HistoryStore,
                                                        fed: FeedSpy) -> None:
    conv = make(model, tok, store, thinking=False, max_tokens=8, context=100,
                sampler_factory=Script(answer(tok, None, " ok")))
    assert conv.send("hi") is not None
    path = store.root / f"{conv.session_id}.jsonl"
    before = path.read_bytes()
    m = fed.mark()
    with pytest.raises(ContextOverflow) as info:
        conv.send("word " * 80)
    assert info.value.context == 100 and "history was not changed" in str(info.value)
    assert path.read_bytes() == before and fed.since(m) == []
    assert len(conv.records) == 2
    # A setting change that overflows is refused the same way.
    conv.thinking = True
    with pytest.raises(ContextOverflow):
        conv.regenerate()
    assert path.read_bytes() == before


def test_token_limit_ends_cleanly_and_keeps_the_text(model: Model, tok: Tokenizer, store: HistoryStore,
                                                     fed: FeedSpy) -> None:
    conv = make(model, tok, store, thinking=False, max_tokens=20, state_files=False)
    events: list[Any] = []
    m = fed.mark()
    r = conv.send("Tell me everything", on_event=events.append)
    p = prompt_of(conv, conv.records[:1])
    assert r is not None and (r.stop, r.interrupted, r.generated_tokens) == ("limit", True, 20)
    assert r.message and "20-token limit" in r.message
    assert any(isinstance(e, Notice) and e.kind == "limit" for e in events)
    assert fed.since(m) == p + r.generated_ids[:-1]  # the last sampled id is not fed
    expected = Grammar(tok).parse_lenient(r.generated_ids, False)
    assert r.answer == expected.content
    assert plain(store.load(conv.session_id).records)[-1] == {"role": "assistant", "content": expected.content,
                                                              "interrupted": True}


def test_cancel_keeps_partial_text_and_a_reusable_state(model: Model, tok: Tokenizer, store: HistoryStore,
                                                        fed: FeedSpy) -> None:
    words = [" one", " two", " three", " four", " five", " six", " seven"]
    ids = [i for w in words for i in tok.encode_text(w)]
    cut = len(tok.encode_text(" one")) + len(tok.encode_text(" two")) + len(tok.encode_text(" three"))
    holder: dict[str, Conversation] = {}
    script = Script(ids, answer(tok, None, " ok"),
                    after=lambda n: holder["c"].cancel() if n == cut else None)
    conv = holder["c"] = make(model, tok, store, thinking=False, sampler_factory=script)
    m = fed.mark()
    r = conv.send("Count")
    p = prompt_of(conv, conv.records[:1])
    assert r is not None and (r.stop, r.interrupted) == ("cancelled", True)
    assert r.generated_ids == ids[:cut] and r.answer == " one two three"
    assert fed.since(m) == p + ids[: cut - 1]  # the step in flight completed; the last id is not fed
    assert not conv._session.tainted and conv._session.ids == p + ids[: cut - 1]
    rec = store.load(conv.session_id).records[-1]
    assert (rec["content"], rec["interrupted"]) == (" one two three", True)
    # The state stays reusable: the next turn feeds only what is new.
    m = fed.mark()
    r2 = conv.send("Go on")
    assert r2 is not None and r2.reuse_source == "live" and r2.reused_tokens == len(p) + cut - 1
    assert r2.stop == "end" and not r2.interrupted


def test_cancel_before_the_prefill_keeps_the_message_unanswered(model: Model, tok: Tokenizer,
                                                                 store: HistoryStore) -> None:
    """A first Ctrl-C during a prefill stops at a piece boundary (here before the first):
    no answer is stored, the message waits for respond(), and the state stays usable."""
    holder: dict[str, Conversation] = {}

    def on_event(e: Any) -> None:
        if isinstance(e, Prefill):
            holder["c"].cancel()

    conv = holder["c"] = make(model, tok, store, sampler_factory=Script(answer(tok, " r", " fine")))
    r = conv.send("Hello", on_event=on_event)
    assert r is not None and (r.stop, r.interrupted, r.pending, r.generated_ids) == ("cancelled", True, True, [])
    assert r.prefilled_tokens == 0 and not conv._session.tainted
    assert plain(conv.records) == [{"role": "user", "content": "Hello"}] and conv.pending_user
    assert r.message is not None and "not yet answered" in r.message
    r2 = conv.respond()  # answers the kept message
    assert r2.stop == "end" and r2.answer == " fine" and r2.turn == 1


def test_malformed_completion_is_stored_leniently(model: Model, tok: Tokenizer, store: HistoryStore) -> None:
    g = Grammar(tok)
    no_boundary = tok.encode_text(" thinking only") + [tok.eos_id]
    no_closure = tok.encode_text(" why") + list(g.boundary) + tok.encode_text(" because") + [tok.end_of_msg_id]
    conv = make(model, tok, store, sampler_factory=Script(no_boundary, no_closure))
    events: list[Any] = []
    r1 = conv.send("Q1", on_event=events.append)
    assert r1 is not None and (r1.stop, r1.interrupted) == ("malformed", True)
    assert (r1.reasoning, r1.answer) == (" thinking only", "")
    assert any(isinstance(e, Notice) and e.kind == "malformed" for e in events)
    r2 = conv.send("Q2")
    assert r2 is not None and (r2.stop, r2.reasoning, r2.answer) == ("malformed", " why", " because")
    stored = plain(store.load(conv.session_id).records)
    assert stored[1] == {"role": "assistant", "content": "", "reasoning_content": " thinking only", "interrupted": True}
    assert stored[3] == {"role": "assistant", "content": " because", "reasoning_content": " why", "interrupted": True}


def test_history_shape_errors_and_empty_messages(model: Model, tok: Tokenizer, store: HistoryStore) -> None:
    conv = make(model, tok, store)
    assert conv.send("") is None and conv.records == []
    with pytest.raises(ConversationError):
        conv.regenerate()
    with pytest.raises(ConversationError):
        conv.respond()


def test_pending_user_message_is_answered_by_respond(model: Model, tok: Tokenizer, store: HistoryStore) -> None:
    sid = store.create("crashed").id
    store.append(sid, {"role": "user", "content": "Still there?"})
    conv = make(model, tok, store, sid, thinking=False, sampler_factory=Script(answer(tok, None, " Yes.")))
    assert conv.pending_user
    with pytest.raises(ConversationError):
        conv.send("another")
    r = conv.respond()
    assert r.answer == " Yes." and plain(conv.records)[-1] == {"role": "assistant", "content": " Yes."}


def test_abort_stops_the_step_in_flight_and_still_saves(model: Model, tok: Tokenizer, store: HistoryStore,
                                                         fed: FeedSpy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C: the engine step in flight is aborted (Cancelled, tainted state), the
    text generated so far is parsed leniently and saved, no state file is written."""
    words = [" one", " two", " three", " four", " five"]
    ids = [i for w in words for i in tok.encode_text(w)]
    cut = len(tok.encode_text(" one")) + len(tok.encode_text(" two"))
    holder: dict[str, Conversation] = {}
    spied = Session.feed
    steps = [0]

    def feed(self: Session, step_ids: Any, **kw: Any) -> Any:
        if len(step_ids) == 1:
            steps[0] += 1
            if steps[0] == cut:  # both signals arrive while this step is in flight
                holder["c"].cancel()
                holder["c"].abort()
        return spied(self, step_ids, **kw)

    monkeypatch.setattr(Session, "feed", feed)
    conv = holder["c"] = make(model, tok, store, thinking=False, sampler_factory=Script(ids))
    m = fed.mark()
    r = conv.send("Count")
    p = prompt_of(conv, conv.records[:1])
    assert r is not None and (r.stop, r.interrupted, r.saved, r.state_saved) == ("cancelled", True, True, False)
    assert r.generated_ids == ids[:cut] and r.answer == " one two"
    # The aborted step was handed to the engine and refused: the state is tainted.
    assert fed.since(m) == p + ids[:cut] and conv._session.tainted
    rec = store.load(conv.session_id).records[-1]
    assert (rec["content"], rec["interrupted"]) == (" one two", True)
    assert not state_path(conv.session_id).exists()
    # A cancel() alone during decoding lets the step finish: the engine flag stays clear.
    conv2 = holder["c"] = make(model, tok, store, thinking=False, sampler_factory=Script(ids))
    conv2.abort = lambda: None  # type: ignore[method-assign]
    steps[0] = 0
    r2 = conv2.send("Count again")
    assert r2 is not None and r2.stop == "cancelled" and not conv2._session.tainted and r2.state_saved


def _non_canonical(tok: Tokenizer, n: int) -> list[int]:
    """n sampled ids that decode to text whose canonical encoding is different (and shorter),
    so the state must be re-fed from a snapshot before it matches the stored history."""
    ids: list[int] = []
    while len(ids) < n:
        for ch in " hello world":
            ids += tok.encode_text(ch)
    ids = ids[:n]
    assert tok.encode_text(tok.decode(ids)) != ids
    return ids


def test_a_turn_cut_at_the_limit_in_a_full_context_still_saves_its_state(model: Model, tok: Tokenizer,
                                                                         store: HistoryStore, fed: FeedSpy) -> None:
    """The tightest turn the conversation accepts (largest G for N_ctx) still leaves room to
    close the cut answer, and the sync restarts from the prompt (a snapshot after the
    prefill), not from position 0."""
    context = 160
    conv = make(model, tok, store, thinking=False, context=context, max_tokens=1)
    p = len(conv.prompt_ids("Tell me"))
    limit = context - p - 1
    while True:  # the largest generation limit this context accepts for this prompt
        conv.max_tokens = limit
        try:
            conv.prompt_ids("Tell me")
            break
        except ContextOverflow:
            limit -= 1
    ids = _non_canonical(tok, limit)
    conv._sampler_factory = Script(ids)
    r = conv.send("Tell me")
    assert r is not None and r.stop == "limit" and r.generated_tokens == limit
    rendered = encode(render(conv.records, thinking=False, effort=None, add_generation_prompt=False), tok)
    assert r.sync_tokens == len(rendered) - p  # from the prompt's snapshot, not from 0
    assert r.state_saved
    assert conv._session.ids == rendered


# --------------------------------------------------------------------------- state files


def _two_turn_setup(model: Model, tok: Tokenizer, store: HistoryStore) -> tuple[str, list[int]]:
    conv = make(model, tok, store, sampler_factory=Script(answer(tok, " r1", " first")))
    r = conv.send("Remember this")
    assert r is not None and r.state_saved
    f1 = list(conv._fed or [])
    conv.close()
    return conv.session_id, f1


def test_state_file_resume_skips_the_prefill(model: Model, tok: Tokenizer, store: HistoryStore, home: Path,
                                             fed: FeedSpy) -> None:
    sid, f1 = _two_turn_setup(model, tok, store)
    path = state_path(sid)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / "state").st_mode) == 0o700
    conv = make(model, tok, store, sid, sampler_factory=Script(answer(tok, " r2", " second")))
    events: list[Any] = []
    m = fed.mark()
    r = conv.send("And now?", on_event=events.append)
    p2 = prompt_of(conv, conv.records[:3])
    assert r is not None and (r.reuse_source, r.reused_tokens, r.reuse_note) == ("state_file", len(f1), None)
    assert fed.since(m)[: len(p2) - len(f1)] == p2[len(f1):]
    assert not [e for e in events if isinstance(e, Notice)]


def _corrupt_checksum(path: Path, sid: str) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def _other_model(path: Path, sid: str) -> None:
    payload = statefile.load_state(path, fingerprint=_fp(path)).payload
    statefile.save_state(path, payload, fingerprint="sha256:another-model", n_tokens=_n(path))


def _truncate(path: Path, sid: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage_engine_state(path: Path, sid: str) -> None:
    statefile.save_state(path, b"\x00" * 64, fingerprint=_fp(path), n_tokens=_n(path))


def _history_changed(path: Path, sid: str) -> None:
    pass  # the test edits the history instead (below)


def _fp(path: Path) -> str:
    data = path.read_bytes()
    fp_len = int.from_bytes(data[12:14], "little")
    return data[14 : 14 + fp_len].decode()


def _n(path: Path) -> int:
    data = path.read_bytes()
    fp_len = int.from_bytes(data[12:14], "little")
    return int.from_bytes(data[14 + fp_len : 22 + fp_len], "little")


@pytest.mark.parametrize("damage,reason", [
    (_corrupt_checksum, "checksum_mismatch"),
    (_other_model, "fingerprint_mismatch"),
    (_truncate, "length_mismatch"),
    (_garbage_engine_state, "unreadable engine state"),
    (_history_changed, "does not match the history"),
])
def test_damaged_state_falls_back_to_a_full_prefill(model: Model, tok: Tokenizer, store: HistoryStore,
                                                    fed: FeedSpy, damage: Callable[[Path, str], None],
                                                    reason: str) -> None:
    sid, f1 = _two_turn_setup(model, tok, store)
    damage(state_path(sid), sid)
    script = [answer(tok, " z", " again")]
    if damage is _history_changed:
        store.truncate(sid, 0)  # the conversation was edited elsewhere: the state no longer matches
        script = [answer(tok, " z", " fresh")]
    conv = make(model, tok, store, sid, sampler_factory=Script(*script))
    events: list[Any] = []
    m = fed.mark()
    r = conv.send("Next", on_event=events.append)
    p = prompt_of(conv, conv.records[:-1])
    assert r is not None and r.reuse_source is None and r.reused_tokens == 0
    assert r.prefilled_tokens == len(p) and fed.since(m)[: len(p)] == p
    assert r.reuse_note and reason in r.reuse_note and "prefilling the history" in r.reuse_note
    assert any(isinstance(e, Notice) and e.kind == "state" and reason in e.text for e in events)
    assert r.state_saved  # rebuilt and saved again


def test_engine_refusing_the_state_falls_back(model: Model, tok: Tokenizer, store: HistoryStore,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from k3engine.model import EngineError

    sid, _ = _two_turn_setup(model, tok, store)

    def refuse(self: Session, data: bytes) -> None:
        raise EngineError(3, "state has magic 00000000")

    monkeypatch.setattr(Session, "import_state", refuse)
    conv = make(model, tok, store, sid, sampler_factory=Script(answer(tok, " z", " ok")))
    r = conv.send("Next")
    assert r is not None and r.reuse_source is None and r.reused_tokens == 0 and r.stop == "end"
    assert r.reuse_note and "import failed" in r.reuse_note


def test_resumed_prefill_is_bit_identical_to_a_full_prefill(model: Model, tok: Tokenizer, store: HistoryStore,
                                                            fed: FeedSpy) -> None:
    firsts: list[np.ndarray] = []

    class Recording(Sampler):
        def sample(self, logits: Any) -> int:
            if len(firsts) < self._want:
                firsts.append(np.array(logits, copy=True))
            return super().sample(logits)

    def factory(settings: SamplerSettings, turn: int) -> Sampler:
        s = Recording(settings, turn)
        s._want = len(firsts) + 1
        return s

    sid, _ = _two_turn_setup(model, tok, store)
    resumed = make(model, tok, store, sid, sampler_factory=factory, max_tokens=3)
    r1 = resumed.send("Compare me")
    assert r1 is not None and r1.reuse_source == "state_file"
    store.truncate(sid, 2)
    os.unlink(state_path(sid))
    full = make(model, tok, store, sid, sampler_factory=factory, max_tokens=3, state_files=False)
    r2 = full.send("Compare me")
    assert r2 is not None and r2.reuse_source is None
    assert r1.prompt_tokens == r2.prompt_tokens
    assert np.array_equal(firsts[0], firsts[1]) and r1.generated_ids == r2.generated_ids


def test_state_file_is_not_written_when_disabled(model: Model, tok: Tokenizer, store: HistoryStore) -> None:
    conv = make(model, tok, store, state_files=False, sampler_factory=Script(answer(tok, " q", " w")))
    conv.send("x")
    assert not state_path(conv.session_id).exists()


def test_session_is_the_planned_context_and_never_grows(model: Model, tok: Tokenizer, store: HistoryStore,
                                                       fed: FeedSpy, monkeypatch: pytest.MonkeyPatch) -> None:
    """N_ctx is the context the memory plan was made for: allocated once, never grown (growing
    held two sessions and an exported copy at once), and without ``context=`` it is the
    planner's default, not the model's max_position_embeddings (1,048,576 for the fixture)."""
    from k3engine.planner import DEFAULT_CONTEXT

    sizes: list[int] = []
    real = Model.session

    def session(self: Model, n: int) -> Session:
        sizes.append(n)
        return real(self, n)

    monkeypatch.setattr(Model, "session", session)
    conv = make(model, tok, store, sampler_factory=Script(answer(tok, " a", " one"), answer(tok, " b", " two"),
                                                          answer(tok, " c", " three")))
    assert conv.context == DEFAULT_CONTEXT
    conv.send("first")
    conv.max_tokens = 2000
    conv.send("second")
    r3 = conv.regenerate()
    assert r3.reuse_source == "snapshot" and r3.answer == " three"
    assert sizes == [DEFAULT_CONTEXT] and conv._session.capacity == DEFAULT_CONTEXT
    small = make(model, tok, store, context=300)
    assert small.context == 300
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make(model, tok, store, context=2_000_000)


def test_at_most_one_snapshot_is_ever_held(model: Model, tok: Tokenizer, store: HistoryStore,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner budgets one turn snapshot: never two alive, not even for a moment."""
    from k3engine.planner import DEFAULT_SNAPSHOTS

    live: set[tuple[int, int]] = set()
    peak = [0]
    real_snap, real_drop = Session.snapshot, Session.drop_snapshot

    def snapshot(self: Session) -> int:
        sid = real_snap(self)
        live.add((id(self), sid))
        peak[0] = max(peak[0], len(live))
        return sid

    def drop(self: Session, sid: int) -> None:
        live.discard((id(self), sid))
        real_drop(self, sid)

    monkeypatch.setattr(Session, "snapshot", snapshot)
    monkeypatch.setattr(Session, "drop_snapshot", drop)
    script = Script(*(answer(tok, f" r{i}", f" a{i}") for i in range(5)))
    conv = make(model, tok, store, sampler_factory=script)
    assert conv.max_snapshots == DEFAULT_SNAPSHOTS == 1
    conv.send("one")
    conv.send("two")
    conv.send("three")
    conv.regenerate()
    conv.edit_last("three, edited")
    assert peak[0] == 1 and len(conv._snaps) == 1


# --------------------------------------------------------------------------- no UI in the core


def test_chat_core_does_not_import_textual() -> None:
    code = ("import sys, k3chat.conversation, k3chat.events, k3chat.chat_cli, k3chat.cli, k3chat.history, "
            "k3chat.template, k3chat.sampler, k3chat.tokenizer, k3chat.statefile, k3chat.settings; "
            "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

"""k3chat.tokenizer: strict loader, specials by name, K3 pattern, chunk caps, decode."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from k3chat.tokenizer import Tokenizer, TokenizerError, chunk_text
from k3engine.tokenizer_files import write_fixture_tokenizer

# Offsets of the named slots from N (spec 3.2, real ids minus 163584).
OFF = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5, "[EOT]": 9}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fixture_tok")
    write_fixture_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(fixture_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(fixture_dir)


def model_lines(fixture_dir: Path) -> list[bytes]:
    return (fixture_dir / "tiktoken.model").read_bytes().split(b"\n")[:-1]


def copy_with(tmp: Path, fixture_dir: Path, *, model: bytes | None = None, config: object = None) -> Path:
    """A tokenizer dir with the fixture's files, optionally replacing one of them."""
    data = model if model is not None else (fixture_dir / "tiktoken.model").read_bytes()
    (tmp / "tiktoken.model").write_bytes(data)
    cfg = config if config is not None else json.loads((fixture_dir / "tokenizer_config.json").read_text())
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp


def fixture_config(fixture_dir: Path) -> dict:
    return json.loads((fixture_dir / "tokenizer_config.json").read_text())


# ---------------------------------------------------------------------------------------
# Layout and specials


def test_sizes_and_control_ids(tok: Tokenizer, fixture_dir: Path) -> None:
    n = len(model_lines(fixture_dir))
    assert tok.n_ranks == n and tok.vocab_size == n + 256
    assert tok.open_id == n + OFF["<|open|>"]
    assert tok.close_id == n + OFF["<|close|>"]
    assert tok.sep_id == n + OFF["<|sep|>"]
    assert tok.end_of_msg_id == n + OFF["<|end_of_msg|>"]
    assert tok.eos_id == n + OFF["[EOS]"]
    assert tok.end_ids == {n + 1, n + 2}
    assert tok.special_id("[EOT]") == n + 9 and tok.eos_id not in {tok.special_id("[EOT]")}
    assert tok.is_special(n) and tok.is_special(n + 255) and not tok.is_special(n - 1)


def test_unnamed_slots_are_reserved_names(tok: Tokenizer) -> None:
    n = tok.n_ranks
    assert tok.special_name(n + 8) == f"<|reserved_token_{n + 8}|>"
    assert tok.special_id(f"<|reserved_token_{n + 200}|>") == n + 200


def test_specials_are_discovered_by_name(tmp_path: Path, fixture_dir: Path) -> None:
    cfg = fixture_config(fixture_dir)
    dec = cfg["added_tokens_decoder"]
    n = len(model_lines(fixture_dir))
    # Move <|open|> and <|sep|> to other slots; mark one not special (the flag is ignored).
    dec[str(n + 100)] = dict(dec.pop(str(n + 3)), special=False)
    dec[str(n + 3)] = dict(dec.pop(str(n + 5)))
    t = Tokenizer.from_dir(copy_with(tmp_path, fixture_dir, config=cfg))
    assert t.open_id == n + 100 and t.sep_id == n + 3
    assert t.special_name(n + 5) == f"<|reserved_token_{n + 5}|>"


def test_engine_vocab_check(tok: Tokenizer) -> None:
    tok.engine_vocab_check(tok.n_ranks + 256)
    for bad in (tok.n_ranks, tok.n_ranks + 255, tok.n_ranks + 257):
        with pytest.raises(TokenizerError, match="vocab"):
            tok.engine_vocab_check(bad)


# ---------------------------------------------------------------------------------------
# Strict parse refusals (spec 3.1)


def _refused(tmp_path: Path, fixture_dir: Path, lines: list[bytes], match: str, *, trailing: bool = True) -> None:
    data = b"\n".join(lines) + (b"\n" if trailing else b"")
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_dir(copy_with(tmp_path, fixture_dir, model=data))


def test_accepts_file_without_final_newline(tmp_path: Path, fixture_dir: Path) -> None:
    data = b"\n".join(model_lines(fixture_dir))
    assert Tokenizer.from_dir(copy_with(tmp_path, fixture_dir, model=data)).n_ranks == len(model_lines(fixture_dir))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (b"QQ==", "one space"),  # no rank
        (b"QQ==  65", "one space"),  # two spaces
        (b"QQ==\t65", "one space"),
        (b"QQ== 65 x", "one space"),
        (b"Q!== 65", "base64"),
        (b"QR== 65", "non-canonical"),  # decodes to 'A' with stray bits
        (b"QQ== -65", "decimal"),
        (b"QQ== 065", "decimal"),
        (b"QQ== 6.5", "decimal"),
        (b"QQ== 65\r", "decimal"),  # CRLF files are refused
        (b" 65", "empty token"),
    ],
)
def test_refuses_bad_line(tmp_path: Path, fixture_dir: Path, line: bytes, match: str) -> None:
    lines = model_lines(fixture_dir)
    lines[65] = line  # the line of byte 'A' (rank 65)
    _refused(tmp_path, fixture_dir, lines, match)


def test_refuses_empty_line_before_end(tmp_path: Path, fixture_dir: Path) -> None:
    lines = model_lines(fixture_dir)
    _refused(tmp_path, fixture_dir, lines[:10] + [b""] + lines[10:], "empty line")
    _refused(tmp_path, fixture_dir, lines + [b""], "empty line")  # two LFs at the end


def test_refuses_empty_file(tmp_path: Path, fixture_dir: Path) -> None:
    _refused(tmp_path, fixture_dir, [], "empty", trailing=False)


def test_refuses_duplicate_token(tmp_path: Path, fixture_dir: Path) -> None:
    lines = model_lines(fixture_dir)
    lines.append(base64.b64encode(b"A") + b" " + str(len(lines)).encode())
    _refused(tmp_path, fixture_dir, lines, "duplicate token")


def test_refuses_duplicate_rank(tmp_path: Path, fixture_dir: Path) -> None:
    lines = model_lines(fixture_dir)
    lines.append(base64.b64encode(b"\x00zz-new") + b" 300")
    _refused(tmp_path, fixture_dir, lines, "duplicate rank")


def test_refuses_non_dense_ranks(tmp_path: Path, fixture_dir: Path) -> None:
    lines = model_lines(fixture_dir)
    gap = lines[:-1] + [lines[-1].split(b" ")[0] + b" " + str(len(lines)).encode()]
    _refused(tmp_path, fixture_dir, gap, "not exactly")
    shifted = [ln.split(b" ")[0] + b" " + str(i + 1).encode() for i, ln in enumerate(lines)]
    _refused(tmp_path, fixture_dir, shifted, "not exactly")


def test_refuses_missing_one_byte_token(tmp_path: Path, fixture_dir: Path) -> None:
    lines = model_lines(fixture_dir)
    kept = [ln for ln in lines if base64.b64decode(ln.split(b" ")[0]) != b"\xc3"]
    renumbered = [ln.split(b" ")[0] + b" " + str(i).encode() for i, ln in enumerate(kept)]
    _refused(tmp_path, fixture_dir, renumbered, "0xc3")


@pytest.mark.parametrize("name", ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"])
def test_refuses_missing_control_name(tmp_path: Path, fixture_dir: Path, name: str) -> None:
    cfg = fixture_config(fixture_dir)
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if v["content"] != name}
    with pytest.raises(TokenizerError, match="missing"):
        Tokenizer.from_dir(copy_with(tmp_path, fixture_dir, config=cfg))


@pytest.mark.parametrize("delta", [-1, 256, 10_000])
def test_refuses_special_id_outside_block(tmp_path: Path, fixture_dir: Path, delta: int) -> None:
    cfg = fixture_config(fixture_dir)
    n = len(model_lines(fixture_dir))
    cfg["added_tokens_decoder"][str(n + delta)] = {"content": "<|stray|>", "special": True}
    with pytest.raises(TokenizerError, match="outside the block"):
        Tokenizer.from_dir(copy_with(tmp_path, fixture_dir, config=cfg))


def test_refuses_duplicate_special_name(tmp_path: Path, fixture_dir: Path) -> None:
    cfg = fixture_config(fixture_dir)
    n = len(model_lines(fixture_dir))
    cfg["added_tokens_decoder"][str(n + 30)] = {"content": "<|open|>", "special": True}
    with pytest.raises(TokenizerError, match="used by ids"):
        Tokenizer.from_dir(copy_with(tmp_path, fixture_dir, config=cfg))


def test_refuses_missing_files_and_bad_json(tmp_path: Path, fixture_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="missing tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    copy_with(tmp_path, fixture_dir)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="JSON"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------
# Pre-tokenization pattern (spec 3.3)

# Hand-derived splits of K3's pattern.
SPLITS: list[tuple[str, list[str]]] = [
    ("中文English混合", ["中文", "English", "混合"]),
    ("Hello world", ["Hello", " world"]),
    ("A中B", ["A", "中", "B"]),
    ("!\n/x", ["!\n", "/x"]),
    ("你好，世界。", ["你好", "，", "世界", "。"]),
    ("第3章", ["第", "3", "章"]),
    ("Kimi中文", ["Kimi", "中文"]),
    ("I'll don't WE'RE they've", ["I'll", " don't", " WE'RE", " they've"]),
    ("1234567", ["123", "456", "7"]),
    ("x2024", ["x", "202", "4"]),
    ("473, 921", ["473", ",", " ", "921"]),
    ("a   b", ["a", "  ", " b"]),
    ("x  \n\n  y", ["x", "  \n\n", " ", " y"]),
    ("end  ", ["end", "  "]),
    ("path/to/file.txt", ["path", "/to", "/file", ".txt"]),
]


def _piece_tokenizer(tmp: Path, fixture_dir: Path, pieces: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    """The fixture plus each expected piece as a whole token.

    A piece that is a token is emitted as one id, so encoding gives exactly these ids only
    if the pattern cuts exactly there (a wrong cut leaves a non-token that BPE spells out).
    """
    lines = model_lines(fixture_dir)
    tokens = {base64.b64decode(ln.split(b" ")[0]): i for i, ln in enumerate(lines)}
    for p in pieces:
        b = p.encode("utf-8")
        if b not in tokens:
            tokens[b] = len(tokens)
            lines.append(base64.b64encode(b) + b" " + str(tokens[b]).encode())
    n = len(lines)
    cfg = {"added_tokens_decoder": {str(n + o): {"content": name, "special": True} for name, o in OFF.items()}}
    t = Tokenizer.from_dir(copy_with(tmp, fixture_dir, model=b"\n".join(lines) + b"\n", config=cfg))
    return t, {p: tokens[p.encode("utf-8")] for p in pieces}


def test_pattern_splits_through_tiktoken(tmp_path: Path, fixture_dir: Path) -> None:
    all_pieces = sorted({p for _, ps in SPLITS for p in ps})
    t, ids = _piece_tokenizer(tmp_path, fixture_dir, all_pieces)
    for text, pieces in SPLITS:
        assert t.encode_text(text) == [ids[p] for p in pieces], text


def test_pattern_splits_with_regex_v1() -> None:
    regex = pytest.importorskip("regex", reason="the regex module is not installed: independent V1 split check skipped")
    from k3chat.tokenizer import PAT_STR

    for text, pieces in SPLITS:
        assert regex.findall(PAT_STR, text, flags=regex.V1) == pieces, text


def test_pattern_without_v1_missplits() -> None:
    # Why V1 matters (spec 3.1): without it `&&` is not an intersection.
    regex = pytest.importorskip("regex", reason="the regex module is not installed")
    from k3chat.tokenizer import PAT_STR

    assert regex.findall(PAT_STR, "A中B", flags=regex.V0) != ["A", "中", "B"]


def test_fixture_encodes_round_trip(tok: Tokenizer) -> None:
    for text, _ in SPLITS:
        assert tok.decode(tok.encode_text(text)) == text


# ---------------------------------------------------------------------------------------
# Chunking caps (spec 3.4)


@pytest.mark.parametrize(
    ("length", "pieces"),
    [(24_999, [24_999]), (25_000, [25_000]), (25_001, [25_000, 1]), (50_001, [25_000, 25_000, 1])],
)
def test_run_cap_lengths(length: int, pieces: list[int]) -> None:
    assert [len(p) for p in chunk_text("a" * length)] == pieces
    assert [len(p) for p in chunk_text(" " * length)] == pieces


def test_run_cap_details() -> None:
    # A class change resets the run but does not cut.
    mixed = "a" * 20_000 + " " * 20_000 + "b" * 20_000
    assert chunk_text(mixed) == [mixed]
    # The cut comes before the character that overflows; earlier runs stay in the piece.
    assert chunk_text(" " + "a" * 25_001) == [" " + "a" * 25_000, "a"]
    # U+001C is a space for str.isspace, so it breaks the non-space run.
    s = "a" * 24_999 + "\x1c" + "aa"
    assert chunk_text(s) == [s]
    assert chunk_text("") == []


def test_run_cap_changes_ids(tok: Tokenizer) -> None:
    s = "e" + "he" * 12_500  # 25,001 non-space chars; the cut splits the last "he"
    enc = tok.encoding
    expected = enc.encode_ordinary(s[:25_000]) + enc.encode_ordinary(s[25_000:])
    assert tok.encode_text(s) == expected
    assert expected != enc.encode_ordinary(s)
    s2 = "e" + "he" * 12_499 + "h"  # 24,999 + ... exactly 25,000: no cut
    assert tok.encode_text(s2) == enc.encode_ordinary(s2)


def test_slice_cap_over_400000(tok: Tokenizer) -> None:
    s = "x" + " the" * 100_001  # 400,005 chars; position 400,000 falls inside the last " the"
    assert [len(p) for p in chunk_text(s)] == [400_000, 5]
    enc = tok.encoding
    expected = enc.encode_ordinary(s[:400_000]) + enc.encode_ordinary(s[400_000:])
    assert tok.encode_text(s) == expected
    assert expected != enc.encode_ordinary(s)


# ---------------------------------------------------------------------------------------
# Decode and specials


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    return [tok.encoding.encode_single_token(bytes([b])) for b in data]


def test_decode_replacement(tok: Tokenizer) -> None:
    assert tok.decode(_byte_ids(tok, b"\xe4\xb8\xad")) == "中"
    assert tok.decode(_byte_ids(tok, b"\xe4\xb8a")) == "\ufffda"  # one maximal ill-formed subpart
    assert tok.decode(_byte_ids(tok, b"\xff\xfe")) == "\ufffd\ufffd"
    assert tok.decode(_byte_ids(tok, b"a\xe4")) == "a\ufffd"


def test_decode_specials(tok: Tokenizer) -> None:
    ids = tok.encode_text("hi") + [tok.open_id]
    with pytest.raises(TokenizerError, match="special"):
        tok.decode(ids)
    assert tok.decode(ids, show_special=True) == "hi<|open|>"
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([tok.vocab_size])


def test_typed_control_strings_are_ordinary_text(tok: Tokenizer) -> None:
    n = tok.n_ranks
    names = [tok.special_name(i) for i in range(n, n + 256)]
    for text in names + ["literal <|end_of_msg|> <|open|>", "[EOS][BOS]<|sep|>"]:
        ids = tok.encode_text(text)
        assert ids and all(i < n for i in ids), text
        assert tok.decode(ids) == text


def test_incremental_decoder_utf8_and_holdback(tok: Tokenizer) -> None:
    d = tok.stream_decoder()
    assert [d.push(i) for i in _byte_ids(tok, b"\xe4\xb8\xad")] == ["", "", "中"]
    assert d.push(tok.open_id) == ""  # control ids never show
    held = [tok.close_id, *tok.encode_text("think")]
    d = tok.stream_decoder([held + [tok.sep_id]])
    x = tok.encode_text("x")
    out = [d.push(i) for i in x + held]
    assert "".join(out) == "x" and d.held == tuple(held)
    assert d.push(x[0]) == "thinkx"  # the prefix broke: released, the control id dropped
    d.push(tok.close_id)
    assert d.flush(drop_held=True) == ""
    d2 = tok.stream_decoder()
    d2.push(_byte_ids(tok, b"\xe4")[0])
    assert d2.flush() == "\ufffd"


# ---------------------------------------------------------------------------------------
# Real tokenizer (needs K3_TOK_FILES)


@pytest.fixture(scope="module")
def real_tok() -> Tokenizer:
    d = os.environ.get("K3_TOK_FILES")
    if not d:
        pytest.skip("K3_TOK_FILES is not set: the real tiktoken.model is needed for official ids (spec 2.2)")
    return Tokenizer.from_dir(d)


def test_real_ids(real_tok: Tokenizer) -> None:
    assert real_tok.n_ranks == 163_584 and real_tok.vocab_size == 163_840
    assert (real_tok.open_id, real_tok.close_id, real_tok.sep_id) == (163587, 163588, 163589)
    assert (real_tok.end_of_msg_id, real_tok.eos_id) == (163586, 163585)
    assert real_tok.encode_text("中文English混合") == [16717, 44372, 13935]
    assert real_tok.encode_text("Hello world") == [19180, 2695]
    singles = {"message": 2778, " role": 6244, '="': 878, "system": 14062, '"': 1, " type": 1798,
               "user": 2482, "assistant": 69702, "think": 39964, "response": 12092, "Hello": 19180,
               " Paris": 17374}
    for text, i in singles.items():
        assert real_tok.encode_text(text) == [i], text

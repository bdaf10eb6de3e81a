"""The fixture tokenizer writer: real file format, dense reachable ranks, K3 special layout."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3engine.tokenizer_files import K3_PAT_STR, write_fixture_tokenizer

# Spec 3.3, typed from the spec (not imported from the code under test).
SPEC_PATTERN_LINES = [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
]

# Spec 3.2: the real named slots; the fixture keeps their offsets from N = 163584.
REAL_NAMED = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>",
    163588: "<|close|>", 163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]",
    163593: "[EOT]", 163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
    163605: "<|media_pad|>", 163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]",
}

LINE = re.compile(rb"^([A-Za-z0-9+/]+={0,2}) (0|[1-9][0-9]*)$")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    d = tmp_path_factory.mktemp("tok")
    return d, write_fixture_tokenizer(d)


def read_ranks(d: Path) -> list[bytes]:
    """Tokens in rank order, checking each line's shape independently of the loader."""
    data = (d / "tiktoken.model").read_bytes()
    assert data.endswith(b"\n") and not data.endswith(b"\n\n")
    tokens: list[bytes] = []
    for i, line in enumerate(data[:-1].split(b"\n")):
        m = LINE.match(line)
        assert m, line
        assert int(m.group(2)) == i  # dense, in order
        tokens.append(base64.b64decode(m.group(1), validate=True))
    return tokens


def bpe(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Reference lowest-rank-first merge, written for this test."""
    parts = [bytes([b]) for b in piece]
    while True:
        cands = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not cands:
            return parts
        _, i = min(cands)
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2 :]


def test_returns_total_vocab_and_writes_both_files(written: tuple[Path, int]) -> None:
    d, total = written
    tokens = read_ranks(d)
    assert total == len(tokens) + 256
    assert 900 <= len(tokens) <= 1100  # "around 1000": small enough for the tiny model
    assert (d / "tokenizer_config.json").is_file()


def test_one_byte_tokens_then_unique_merges(written: tuple[Path, int]) -> None:
    tokens = read_ranks(written[0])
    assert tokens[:256] == [bytes([b]) for b in range(256)]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t) >= 2 for t in tokens[256:])


def test_every_merge_is_reachable_from_lower_ranks(written: tuple[Path, int]) -> None:
    tokens = read_ranks(written[0])
    ranks: dict[bytes, int] = {}
    for rank, tok in enumerate(tokens):
        if rank >= 256:
            parts = bpe(tok, ranks)
            assert len(parts) == 2 and parts[0] + parts[1] == tok, (rank, tok, parts)
        ranks[tok] = rank


def test_merges_learned_on_k3_pieces(written: tuple[Path, int]) -> None:
    regex = pytest.importorskip("regex", reason="regex module not installed: cannot check pieces")
    tokens = read_ranks(written[0])
    texts = [t.decode("utf-8") for t in tokens[256:] if _utf8(t)]
    # Han text was in the corpus, so whole Han characters were learned.
    assert any(re.fullmatch(r"[\u4e00-\u9fff]+", t) for t in texts)
    assert " the" in texts
    # No merge crosses a place where K3's pattern always cuts: letter|space, Han|other
    # letter, letter|digit, or a fourth digit. Raw-text training would produce " e"-style
    # merges like "e " immediately.
    crossings = regex.compile(
        r"[\p{L}\p{N}]\s|[\p{Han}][\p{L}&&[^\p{Han}]]|[\p{L}&&[^\p{Han}]][\p{Han}]|\p{L}\p{N}|\p{N}\p{L}|\p{N}{4}",
        flags=regex.V1,
    )
    for t in texts:
        assert not crossings.search(t), t
        assert regex.findall(K3_PAT_STR, t, flags=regex.V1)  # sanity: the pattern compiles and matches


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_pattern_is_k3_verbatim() -> None:
    assert K3_PAT_STR == "|".join(SPEC_PATTERN_LINES)


def test_config_has_named_slots_at_real_offsets(written: tuple[Path, int]) -> None:
    d, total = written
    n = total - 256
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    got = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    assert got == {n + real - 163584: name for real, name in REAL_NAMED.items()}
    assert all(v["special"] is True for v in cfg["added_tokens_decoder"].values())
    assert cfg["bos_token"] == "[BOS]" and cfg["eos_token"] == "[EOS]"
    assert "chat_template" not in cfg


def test_n_ranks_option(tmp_path: Path) -> None:
    total = write_fixture_tokenizer(tmp_path, n_ranks=300)
    assert total == 556
    assert len(read_ranks(tmp_path)) == 300
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "303" in cfg["added_tokens_decoder"]  # <|open|> at N+3
    with pytest.raises(ValueError):
        write_fixture_tokenizer(tmp_path / "x", n_ranks=255)


def test_deterministic_across_processes(written: tuple[Path, int], tmp_path: Path) -> None:
    # A fresh interpreter with another hash seed must write the same bytes.
    code = "import sys; from k3engine.tokenizer_files import write_fixture_tokenizer as w; w(sys.argv[1])"
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (written[0] / name).read_bytes()


def test_engine_module_does_not_import_chat_or_ui() -> None:
    code = (
        "import sys, k3engine.tokenizer_files; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('k3chat', 'textual')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""Nothing stored, generated or typed reaches the terminal raw (display.for_terminal)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from k3chat.cli import main
from k3chat.display import for_terminal, is_terminal_safe, json_safe
from k3chat.history import HistoryStore

# Every character class the sanitizer must neutralise, with what the user sees instead.
ATTACKS = {
    "\x1b": "\\x1b",  # ESC: CSI / OSC sequences (clipboard OSC 52, hyperlinks OSC 8, titles)
    "\x07": "\\x07",  # BEL, also an OSC terminator
    "\r": "\\x0d",  # carriage return: overwrite what was printed
    "\x08": "\\x08",  # backspace
    "\x00": "\\x00",
    "\x7f": "\\x7f",  # DEL
    "\x9b": "\\x9b",  # C1 CSI: an escape sequence without ESC
    "\x9d": "\\x9d",  # C1 OSC
    "\x85": "\\x85",  # C1 NEL
    "\u202a": "\\u202a", "\u202b": "\\u202b", "\u202c": "\\u202c", "\u202d": "\\u202d", "\u202e": "\\u202e",
    "\u2066": "\\u2066", "\u2067": "\\u2067", "\u2068": "\\u2068", "\u2069": "\\u2069",
    "\udcff": "\\udcff",  # a lone surrogate (undecodable argv byte): cannot even be encoded
}
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
EVIL = "ok \x1b]52;c;cHduZWQ=\x07 \x1b[2J\x9b31m \u202eevil\u202c \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ end"


def clean(text: str) -> bool:
    return RAW.search(text) is None


def test_each_control_is_shown_and_everything_else_kept() -> None:
    for ch, shown in ATTACKS.items():
        assert for_terminal(f"a{ch}b") == f"a{shown}b", repr(ch)
    kept = "plain text\nnext line\tTab é ü 中文 👍 עברית \u200f ‏ \\x1b literal"
    assert for_terminal(kept) == kept and is_terminal_safe(kept)
    assert for_terminal("\x1b[2J") == "\\x1b[2J"  # eight visible characters
    assert clean(for_terminal(EVIL)) and not is_terminal_safe(EVIL)


def test_sanitizing_is_per_character_so_stream_chunks_are_safe() -> None:
    text = EVIL * 3
    for size in (1, 2, 3, 7):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        assert "".join(for_terminal(c) for c in chunks) == for_terminal(text)
    assert for_terminal(for_terminal(EVIL)) == for_terminal(EVIL)  # idempotent


def test_json_safe_is_valid_json_with_the_same_values() -> None:
    doc = {"content": EVIL, "name": "x\u2066y\x85", "n": 1}
    raw = json.dumps(doc, ensure_ascii=False)
    safe = json_safe(raw)
    assert clean(safe) and json.loads(safe) == doc
    assert "\\u009b" in safe and "\\u202e" in safe


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _evil_session(home: Path) -> str:
    store = HistoryStore()
    sid = store.create("Case").id
    store.append(sid, {"role": "user", "content": "question " + EVIL})
    store.append(sid, {"role": "assistant", "content": "answer " + EVIL, "reasoning_content": "why " + EVIL})
    # A name that _check_name refuses, planted by hand (a sync tool, an old version, an editor).
    path = store.root / f"{sid}.jsonl"
    path.write_text(path.read_text() + json.dumps({"k3chat": "rename", "name": "Pwn\x1b]0;owned\x07\u202e"}) + "\n")
    return sid


def test_sessions_output_never_carries_raw_controls(home: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    sid = _evil_session(home)
    outputs: list[str] = []
    for argv in (["sessions", "list"], ["sessions", "list", "--json"], ["sessions", "show", sid],
                 ["sessions", "export", sid], ["sessions", "export", sid, "--format", "json"],
                 ["sessions", "export", sid, "--format", "jsonl"],
                 ["sessions", "show", "nope\x1b[2J\x9b\u202e"], ["sessions", "rename", sid, "x\x9by"]):
        main(argv)
        out, err = capsys.readouterr()
        assert clean(out) and clean(err), (argv, out, err)
        outputs.append(out + err)
    listing, as_json, shown = outputs[0], outputs[1], outputs[2]
    assert "Pwn\\x1b]0;owned\\x07\\u202e" in listing
    assert json.loads(as_json)[0]["name"] == "Pwn\\x1b]0;owned\\x07\\u202e"  # shown escaped, never obeyed
    assert "answer ok \\x1b]52;c;cHduZWQ=\\x07" in shown
    peer = [json.loads(line) for line in outputs[5].splitlines() if line.startswith("{")]
    assert peer[1]["content"] == "answer " + EVIL  # JSON escapes: the exact text, inert on a terminal
    assert "C1 and bidi" in outputs[7]  # the rename was refused
    # Stored text is never changed.
    assert HistoryStore().load(sid).records[1]["content"] == "answer " + EVIL


def test_streamed_answer_is_sanitized_and_stored_unchanged(tiny_dir: Path, home: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat import sampler
    from k3chat.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(tiny_dir).encode_text(EVIL)
    state = {"i": 0}

    def sample(self: Any, logits: Any) -> int:
        i = state["i"]
        state["i"] += 1
        return ids[i % len(ids)]

    monkeypatch.setattr(sampler.Sampler, "sample", sample)
    out = tmp_path / "r.json"
    assert main(["run", str(tiny_dir), "--prompt", "say \x1b[2J", "--no-think", "--max-tokens", str(len(ids)),
                 "--json", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert clean(stdout) and clean(stderr)
    assert for_terminal(EVIL) in stdout
    res = json.loads(out.read_text())
    assert res["answer"] == EVIL
    rec = HistoryStore().load(res["session"]).records
    assert rec[0]["content"] == "say \x1b[2J" and rec[1]["content"] == EVIL

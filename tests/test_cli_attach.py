"""`k3chat run --file / --prompt-file / --prompt -` and the refusal of a message that does not fit
(k3chat/context_fit.py), on the tiny fixture (K3CHAT_HOME in a tmp dir)."""
from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from k3chat.cli import main
from k3chat.conversation import CLOSE_SLACK
from k3chat.history import HistoryStore
from k3chat.template import Grammar, encode, render
from k3chat.tokenizer import Tokenizer


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("K3CHAT_HOME", str(h))
    return h


def k3chat(home: Path, *args: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "k3chat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def prompt_ids(tok: Tokenizer, records: list[dict[str, Any]], generation: bool = True) -> list[int]:
    return encode(render(records, thinking=False, effort=None, add_generation_prompt=generation), tok)


def test_files_are_attached_recorded_and_re_rendered_to_the_same_ids(tiny_dir: Path, home: Path,
                                                                      tmp_path: Path) -> None:
    (tmp_path / "q3.csv").write_bytes(b"region,total\nnorth,1204\n")
    (tmp_path / "note.txt").write_bytes(b"North is ours.")
    out1, out2 = tmp_path / "t1.json", tmp_path / "t2.json"
    assert main(["run", str(tiny_dir), "--file", str(tmp_path / "q3.csv"), "--file", str(tmp_path / "note.txt"),
                 "--prompt", "North total?", "--no-think", "--max-tokens", "6", "--json", str(out1)]) == 0
    t1 = json.loads(out1.read_text())
    # What the model read, written out here by hand (the documented form).
    seen = ('==== attachment 1 of 2: "q3.csv" (CSV, 24 bytes) ====\nregion,total\nnorth,1204\n\n'
            '==== end of attachment 1 of 2: "q3.csv" ====\n\n'
            '==== attachment 2 of 2: "note.txt" (plain text, 14 bytes) ====\nNorth is ours.\n'
            '==== end of attachment 2 of 2: "note.txt" ====\n\nNorth total?')
    tok = Tokenizer.from_dir(tiny_dir)
    assert t1["prompt_tokens"] == len(prompt_ids(tok, [{"role": "user", "content": seen}]))
    hist = HistoryStore().load(t1["session"]).records
    user = hist[0]
    assert user["content"] == "North total?"
    assert [a["name"] for a in user["attachments"]] == ["q3.csv", "note.txt"]
    assert user["attachments"][0] == {"name": "q3.csv", "size": 24, "sha256": hashlib.sha256(
        b"region,total\nnorth,1204\n").hexdigest(), "kind": "csv", "notes": [], "text": "region,total\nnorth,1204\n"}
    # The next run re-renders the stored session and reuses every id the first one fed.
    assert main(["run", str(tiny_dir), "--session", t1["session"], "--prompt", "And south?", "--no-think",
                 "--max-tokens", "6", "--json", str(out2)]) == 0
    t2 = json.loads(out2.read_text())
    before = prompt_ids(tok, [{"role": "user", "content": seen}, hist[1]], generation=False)
    assert t2["reuse_source"] == "state_file" and t2["reused_tokens"] == len(before)


def test_a_file_that_cannot_be_attached_leaves_no_session(tiny_dir: Path, home: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF")
    assert main(["run", str(tiny_dir), "--file", str(tmp_path / "photo.jpg"), "--prompt", "What is it?"]) == 2
    err = capsys.readouterr().err
    assert "photo.jpg: it is not UTF-8 text (byte 0xff at offset 0" in err or "NUL byte at offset 4" in err
    assert HistoryStore().list() == []
    assert main(["run", str(tiny_dir), "--session", "x", "--resume", "--file", str(tmp_path / "photo.jpg")]) == 2
    assert "--file attaches files to a new message" in capsys.readouterr().err


def test_prompt_from_stdin(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    question = "From a pipe: is \u00e9 kept?\n"
    r = k3chat(home, "run", str(tiny_dir), "--prompt", "-", "--no-think", "--max-tokens", "4", "--json", str(out),
               input=question)
    assert r.returncode == 0, r.stderr
    sid = json.loads(out.read_text())["session"]
    records = HistoryStore().load(sid).records
    assert records[0]["content"] == question
    empty = k3chat(home, "run", str(tiny_dir), "--prompt", "-", input="")
    assert empty.returncode == 2 and "standard input was empty" in empty.stderr


def test_prompt_from_a_terminal_stdin_is_refused_with_a_hint(tiny_dir: Path, home: Path) -> None:
    leader, follower = pty.openpty()
    try:
        r = k3chat(home, "run", str(tiny_dir), "--prompt", "-", stdin=follower)
    finally:
        os.close(leader)
        os.close(follower)
    assert r.returncode == 2
    assert "standard input, which is a terminal here; pipe it in" in r.stderr and "--prompt-file" in r.stderr


def test_prompt_file_over_128_kib_is_read_whole_and_refused_with_the_numbers(
        tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    from k3engine.config import load_config
    from k3engine.planner import minimum_budget, tensor_sizes_from_dir
    from k3engine.sizes import format_bytes

    text = "".join(f"line {i}: the pump log reads {i * 7 % 1000} bar\n" for i in range(4000))
    assert len(text.encode()) > 128 * 1024  # more than one command-line argument may hold
    (tmp_path / "long.txt").write_text(text)
    out = tmp_path / "r.json"
    # In a subprocess: the plan's process reserve is that of a fresh `k3chat run`.
    r = k3chat(home, "run", str(tiny_dir), "--prompt-file", str(tmp_path / "long.txt"), "--no-think",
               "--max-tokens", "64", "--json", str(out), timeout=300)
    assert r.returncode == 2, r.stderr
    payload = json.loads(out.read_text())
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = len(prompt_ids(tok, [{"role": "user", "content": text}]))
    grammar = Grammar(tok)
    needed = prompt + 64 + 1 + len(grammar.boundary) + len(grammar.closure) + 1 + CLOSE_SLACK
    fit = payload["fit"]
    assert (fit["prompt_tokens"], fit["needed"], fit["context"]) == (prompt, needed, 8192)
    suggested = -(-needed // 1024) * 1024
    assert fit["suggested"] == suggested > 8192
    # The memory, planned here as the run planned its own session (its lookahead, its process reserve).
    cfg = load_config(tiny_dir)
    memory = minimum_budget(cfg, tensor_sizes_from_dir(tiny_dir, cfg), suggested, lookahead=fit["lookahead"],
                            process_bytes=fit["process_bytes"])
    assert fit["process_bytes"] > 0 and fit["memory"] == memory
    err = r.stderr
    assert f"needs {needed:,} positions ({prompt:,} prompt tokens + 64 for the answer" in err
    assert f"the session holds 8,192; nothing was sent or saved" in err
    assert f"A context of {suggested:,} positions holds it, which needs at least {format_bytes(memory)}" in err
    assert f"run again with --context {suggested} " in err and f"k3chat plan {tiny_dir} --context {suggested}" in err
    assert HistoryStore().list() == []


def test_advice_beyond_the_model_limit_and_memory_values_one_can_type(tiny_dir: Path) -> None:
    from k3chat.context_fit import advise, memory_text, suggested_context
    from k3chat.conversation import ContextOverflow

    assert suggested_context(1025, 1 << 20) == 2048 and suggested_context(1024, None) == 1024
    assert suggested_context(1000, 1000) == 1000  # capped at the model's limit, never above it
    limit = json.loads((tiny_dir / "config.json").read_text())["text_config"]["max_position_embeddings"]
    advice = advise(ContextOverflow(limit, 64, 8192, reserve=10), tiny_dir)
    assert advice.suggested is None and advice.memory is None and advice.needed == limit + 64 + 1 + 10
    message = advice.message(tiny_dir)
    assert f"max_position_embeddings {limit:,}" in message and "attach less" in message
    assert "nothing was sent or saved" in message
    assert (memory_text(300 * 2**20 + 1), memory_text(2**30), memory_text(int(1.21 * 2**30))) == ("301M", "1G", "1.3G")

"""`k3chat run --prompt` and `k3chat sessions`, as a user runs them (K3CHAT_HOME in a tmp dir)."""
from __future__ import annotations

import json
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from k3chat.cli import main
from k3chat.conversation import state_path
from k3chat.history import HistoryStore
from k3chat.template import encode, render
from k3chat.tokenizer import Tokenizer


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("K3CHAT_HOME", str(h))
    return h


def k3chat(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "k3chat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def records(home: Path, sid: str) -> list[dict[str, Any]]:
    assert os.environ["K3CHAT_HOME"] == str(home)
    return HistoryStore().load(sid).records


# --------------------------------------------------------------------------- run --prompt


def test_two_turn_session_reuses_the_saved_state(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    out1, out2 = tmp_path / "t1.json", tmp_path / "t2.json"
    r1 = k3chat(home, "run", str(tiny_dir), "--prompt", "Hello there", "--system", "Be brief.",
                "--session", "demo", "--max-tokens", "24", "--json", str(out1))
    # Random weights never close the turn: the limit ends it cleanly (exit 0), the text is
    # kept, marked interrupted, and the limit is said.
    assert r1.returncode == 0, r1.stderr
    assert "24-token limit" in r1.stderr and "--- reasoning ---" in r1.stdout
    t1 = json.loads(out1.read_text())
    assert (t1["reused_tokens"], t1["prefilled_tokens"]) == (0, t1["prompt_tokens"])
    assert t1["interrupted"] is True and t1["stop"] == "limit" and t1["state_saved"] is True
    assert stat.S_IMODE(os.stat(out1).st_mode) == 0o600
    sid = t1["session"]
    assert stat.S_IMODE(os.stat(state_path(sid)).st_mode) == 0o600

    r2 = k3chat(home, "run", str(tiny_dir), "--prompt", "And again?", "--session", "demo",
                "--max-tokens", "24", "--json", str(out2))
    assert r2.returncode == 0, r2.stderr
    t2 = json.loads(out2.read_text())
    assert t2["session"] == sid and t2["reuse_source"] == "state_file"
    # What turn 1 left in the history, rendered: turn 2 reuses all of it and feeds only the rest.
    tok = Tokenizer.from_dir(tiny_dir)
    hist = records(home, sid)
    assert [r["role"] for r in hist] == ["system", "user", "assistant", "user", "assistant"]
    assert hist[2]["interrupted"] is True and hist[2]["reasoning_content"] == t1["reasoning"]
    before = encode(render(hist[:3], thinking=True, effort="max", add_generation_prompt=False), tok)
    prompt2 = encode(render(hist[:4], thinking=True, effort="max", add_generation_prompt=True), tok)
    assert t2["prompt_tokens"] == len(prompt2)
    assert t2["reused_tokens"] == len(before) > 0
    assert t2["prefilled_tokens"] == len(prompt2) - len(before)
    assert set(t2) >= {"prompt_tokens", "reused_tokens", "prefilled_tokens", "reasoning", "answer", "interrupted"}


def test_sigint_saves_the_partial_answer_and_exits_5(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "k3chat.cli", "run", str(tiny_dir), "--prompt",
                             "Hello there, how are you?", "--no-think", "--max-tokens", "100000",
                             "--threads", "2", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 60
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if "generating" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 5
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["stop"] == "cancelled"
    assert 1 < res["generated_tokens"] < 100000
    assert res["answer"] and res["answer"] in stdout
    last = records(home, res["session"])[-1]
    assert (last["role"], last["content"], last["interrupted"]) == ("assistant", res["answer"], True)
    assert "reasoning_content" not in last


def test_second_sigint_exits_at_once(tiny_dir: Path, home: Path) -> None:
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "k3chat.cli", "run", str(tiny_dir), "--prompt", "Hi",
                             "--max-tokens", "100000", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:  # type: ignore[union-attr]
        if "generating" in line:
            break
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 5


def test_settings_and_model_default(tiny_dir: Path, home: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--prompt", "hi"]) == 2
    assert "MODEL_DIR is required" in capsys.readouterr().err
    (home / "config").mkdir(parents=True)
    (home / "config" / "config.toml").write_text(
        f'model = "{tiny_dir}"\nmax_tokens = 5\n[thinking]\nenabled = false\n')
    out = tmp_path / "r.json"
    assert main(["run", "--prompt", "hi", "--json", str(out)]) == 0  # the limit (5), from the config
    res = json.loads(out.read_text())
    assert res["generated_tokens"] == 5 and res["reasoning"] is None
    # The command line overrides the file.
    assert main(["run", "--prompt", "hi", "--max-tokens", "3", "--thinking-effort", "low", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["generated_tokens"] == 3 and res["reasoning"] is not None
    rec = records(home, res["session"])[-1]
    assert (rec["effort"], rec["thinking"]) == ("low", True)
    capsys.readouterr()
    (home / "config" / "config.toml").write_text('[sampler]\ntop_p = 3\n')
    assert main(["run", str(tiny_dir), "--prompt", "hi"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_overflow_is_refused_and_leaves_no_session(tiny_dir: Path, home: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["run", str(tiny_dir), "--prompt", "word " * 100, "--context", "64", "--max-tokens", "8",
                 "--json", str(out)])
    assert code == 1
    assert "overflow" in capsys.readouterr().err
    assert "overflow" in json.loads(out.read_text())["error"]
    assert HistoryStore().list() == []


def test_sampling_seed_is_stored_and_reused(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--no-think", "--seed", "7", "--top-k", "5",
                 "--max-tokens", "4", "--session", "s", "--json", str(out)]) == 0
    first = json.loads(out.read_text())
    assert (first["greedy"], first["seed"]) == (False, 7)
    assert main(["run", str(tiny_dir), "--prompt", "more", "--no-think", "--temperature", "0.7",
                 "--max-tokens", "4", "--session", "s", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["seed"] == 7  # one seed per conversation


@pytest.mark.parametrize("args,needle", [
    (["--ids", "1,2", "--prompt", "hi"], "not allowed with"),
    ([], "one of the arguments --ids --prompt --resume is required"),
    (["--prompt", "hi", "--temperature", "0"], "--temperature: must be > 0"),
    (["--prompt", "hi", "--temperature", "warm"], "--temperature: expected a number"),
    (["--prompt", "hi", "--top-p", "1.5"], "--top-p: must be > 0 and <= 1"),
    (["--prompt", "hi", "--top-k", "-1"], "--top-k: must be >= 0"),
    (["--prompt", "hi", "--seed", "-3"], "--seed: must be between 0 and 2^64-1"),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["--prompt", "hi", "--thinking-effort", "medium"], "invalid choice: 'medium'"),
    (["--prompt", "hi", "--no-think", "--thinking-effort", "low"], "not allowed with"),
    (["--prompt", "hi", "--gen", "3"], "--gen is for --ids"),
    (["--prompt", ""], "--prompt is empty"),
    (["--ids", "1,2", "--temperature", "0.5"], "--temperature need --prompt"),
    (["--resume"], "--resume needs --session"),
    (["--resume", "--session", "nope"], "no session 'nope' to resume"),
])
def test_usage_errors_exit_2(tiny_dir: Path, home: Path, capsys: pytest.CaptureFixture[str],
                             args: list[str], needle: str) -> None:
    assert main(["run", str(tiny_dir), *args]) == 2
    assert needle in capsys.readouterr().err
    assert not (home / "data" / "sessions").exists() or HistoryStore().list() == []


def test_session_rules_for_system_and_unanswered_messages(tiny_dir: Path, home: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    store = HistoryStore()
    sid = store.create("case").id
    store.append(sid, {"role": "system", "content": "Be formal."})
    store.append(sid, {"role": "user", "content": "Unanswered"})
    assert main(["run", str(tiny_dir), "--prompt", "new", "--session", "case"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["run", str(tiny_dir), "--resume", "--session", sid, "--system", "Other"]) == 2
    capsys.readouterr()
    assert main(["run", str(tiny_dir), "--resume", "--session", "case", "--max-tokens", "3", "--no-think"]) == 0
    recs = HistoryStore().load(sid).records
    assert [r["role"] for r in recs] == ["system", "user", "assistant"]
    assert main(["run", str(tiny_dir), "--prompt", "x", "--session", "case", "--system", "Different"]) == 2
    assert "--system can only start a session" in capsys.readouterr().err


def test_ids_path_still_works(tiny_dir: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_dir), "--ids", "3,7,11", "--gen", "2"]) == 0
    assert "generated:" in capsys.readouterr().out


# --------------------------------------------------------------------------- sessions


def test_sessions_list_show_export_rename_rm(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = HistoryStore()
    a = store.create("Smith v. Jones").id
    store.append(a, {"role": "user", "content": "Summarise the filing."})
    store.append(a, {"role": "assistant", "content": "It argues X.", "reasoning_content": "Read it.",
                     "interrupted": True})
    b = store.create("Patient 12").id
    sp = state_path(a)
    sp.parent.mkdir(parents=True, exist_ok=True)
    sp.write_bytes(b"state")

    assert main(["sessions", "list"]) == 0
    out = capsys.readouterr().out
    assert a in out and b in out and "Smith v. Jones" in out
    assert main(["sessions", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {x["id"]: x["messages"] for x in listed} == {a: 2, b: 0}

    assert main(["sessions", "show", "Smith v. Jones"]) == 0
    out = capsys.readouterr().out
    assert "Summarise the filing." in out and "It argues X." in out and "[interrupted]" in out and "Read it." in out

    dest = tmp_path / "export.json"
    assert main(["sessions", "export", a, "--format", "json", "-o", str(dest)]) == 0
    doc = json.loads(dest.read_text())
    assert [r["content"] for r in doc["records"]] == ["Summarise the filing.", "It argues X."]
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o600
    assert main(["sessions", "export", a, "--format", "jsonl"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[1] == {"role": "assistant", "content": "It argues X.", "reasoning_content": "Read it."}

    assert main(["sessions", "rename", a, "Smith v. Jones (appeal)"]) == 0
    assert HistoryStore().info(a).name == "Smith v. Jones (appeal)"
    capsys.readouterr()
    assert main(["sessions", "rename", a, "bad\nname"]) == 2
    assert "control characters" in capsys.readouterr().err

    assert main(["sessions", "show", "nope"]) == 2
    assert "no session 'nope'" in capsys.readouterr().err
    assert main(["sessions", "rm", a]) == 2  # not a terminal and no --yes: refused
    assert "without --yes" in capsys.readouterr().err
    assert main(["sessions", "rm", a, "--yes"]) == 0
    assert [i.id for i in HistoryStore().list()] == [b]
    assert not sp.exists()  # the saved engine state holds the conversation too


def test_sessions_names_must_be_unambiguous(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = HistoryStore()
    store.create("same")
    store.create("same")
    assert main(["sessions", "show", "same"]) == 2
    assert "several sessions are named 'same'" in capsys.readouterr().err

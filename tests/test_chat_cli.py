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
                             "Hello there, how are you?", "--no-think", "--max-tokens", "99000", "--context", "100000",
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
    assert 1 < res["generated_tokens"] < 99000
    assert res["answer"] and res["answer"] in stdout
    last = records(home, res["session"])[-1]
    assert (last["role"], last["content"], last["interrupted"]) == ("assistant", res["answer"], True)
    assert "reasoning_content" not in last


# Runs the CLI with every decode step slowed down (before the engine is called), so that a
# signal reliably lands while a step is in flight.
SLOW_DRIVER = """
import sys, time
from k3engine.model import Session
real = Session.feed
SECONDS = float(sys.argv[1])
def feed(self, ids, **kw):
    if len(ids) == 1:
        print("driver: decode step", file=sys.stderr, flush=True)
        time.sleep(SECONDS)
    return real(self, ids, **kw)
Session.feed = feed
from k3chat.launch import main  # the console script's entry point, as a user runs it
sys.argv = [sys.argv[0], *sys.argv[2:]]
sys.exit(main())
"""


def _slow_run(home: Path, tmp_path: Path, seconds: float, *args: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    driver = tmp_path / "slow_driver.py"
    driver.write_text(SLOW_DRIVER)
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, str(driver), str(seconds), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 60
    while "generating" not in lines.get(timeout=max(0.1, deadline - time.monotonic())):
        pass
    return proc, lines


def test_second_sigint_aborts_the_step_and_still_saves(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    """First Ctrl-C: stop after the step in flight. Second: abort that step (the engine's
    cancel flag) and still save the partial answer, marked interrupted, then exit 5 promptly."""
    out = tmp_path / "r.json"
    proc, lines = _slow_run(home, tmp_path, 0.4, "run", str(tiny_dir), "--prompt", "Hello there, how are you?",
                            "--no-think", "--max-tokens", "500", "--threads", "1", "--json", str(out))
    # Three tokens are out and the third decode step is in flight (counted, not slept for: a slow
    # machine may still be prefilling after any fixed time).
    deadline = time.monotonic() + 60
    steps = 0
    while steps < 3:
        steps += "driver: decode step" in lines.get(timeout=max(0.1, deadline - time.monotonic()))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)  # the step in flight is still running (0.4 s)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 5
    assert time.monotonic() - t < 10
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["stop"] == "cancelled" and res["saved"] is True
    assert res["state_saved"] is False  # tainted by the aborted step; the next run prefills
    assert 2 <= res["generated_tokens"] < 500 and res["answer"]
    assert res["answer"] in stdout
    last = records(home, res["session"])[-1]
    assert (last["role"], last["content"], last["interrupted"]) == ("assistant", res["answer"], True)


def test_third_sigint_exits_at_once(tiny_dir: Path, home: Path, tmp_path: Path) -> None:
    proc, _ = _slow_run(home, tmp_path, 60, "run", str(tiny_dir), "--prompt", "Hi", "--max-tokens", "50",
                        "--threads", "1")
    t = time.monotonic()
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
    assert proc.wait(timeout=30) == 5
    assert time.monotonic() - t < 20  # the step in flight (60 s) was not waited for


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
    assert code == 2  # a usage problem: the fix is a larger --context (k3chat.context_fit)
    err = capsys.readouterr().err
    assert "does not fit the context" in err and "run again with --context 1024" in err
    assert "does not fit the context" in json.loads(out.read_text())["error"]
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
    ([], "one of the arguments --ids --prompt --prompt-file --resume is required"),
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
    (["--prompt", "hi", "--json", "/"], "--json / is a directory"),
    (["--prompt", "hi", "--lookahead", "-2"], "--lookahead must be >= 0"),
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


# --------------------------------------------------------------------------- context, errors, traces


def test_conversation_uses_exactly_the_planned_context(tiny_dir: Path, home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import k3chat.conversation as conversation
    import k3engine.budgeted as budgeted
    from k3engine.planner import DEFAULT_CONTEXT

    planned: list[int] = []
    used: list[int] = []
    real_open = budgeted.open_budgeted

    def open_budgeted(*a: Any, **kw: Any) -> Any:
        planned.append(kw["context"])
        return real_open(*a, **kw)

    class Spy(conversation.Conversation):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            used.append(self.context)

    monkeypatch.setattr(budgeted, "open_budgeted", open_budgeted)
    monkeypatch.setattr(conversation, "Conversation", Spy)
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--max-tokens", "2", "--context", "3000"]) == 0
    assert planned == used == [DEFAULT_CONTEXT, 3000]


def test_context_above_the_model_limit_is_a_usage_error(tiny_dir: Path, home: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--context", "2000000"]) == 2
    assert "max_position_embeddings (1,048,576)" in capsys.readouterr().err
    assert HistoryStore().list() == []


def test_negative_lookahead_is_a_usage_error_not_a_traceback(tiny_dir: Path, home: Path) -> None:
    r = k3chat(home, "run", str(tiny_dir), "--prompt", "hi", "--lookahead", "-1")
    assert r.returncode == 2 and "--lookahead must be >= 0" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("error,code,needle", [
    ("history", 1, "cannot load session"),
    ("tokenizer", 2, "tokenizer: "),
    ("value", 2, "bad value"),
])
def test_conversation_setup_failures_are_messages_and_leave_no_session(
        tiny_dir: Path, home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        error: str, code: int, needle: str) -> None:
    import k3chat.conversation as conversation
    from k3chat.history import HistoryError
    from k3chat.tokenizer import TokenizerError

    exc = {"history": HistoryError("damaged"), "tokenizer": TokenizerError("vocab mismatch"),
           "value": ValueError("bad value")}[error]

    def boom(self: Any, *a: Any, **kw: Any) -> None:
        raise exc

    monkeypatch.setattr(conversation.Conversation, "__init__", boom)
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--session", "new one"]) == code
    assert needle in capsys.readouterr().err
    assert HistoryStore().list() == []  # the session this run created had nothing in it: removed


def test_undecodable_prompt_bytes_are_refused_before_a_session_exists(tiny_dir: Path, home: Path) -> None:
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "k3chat.cli", "run", str(tiny_dir), "--prompt", b"caf\xe9 au lait"],
                       capture_output=True, env=env, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and "--prompt is not valid text" in err and "Traceback" not in err
    assert not (home / "data" / "sessions").exists() or HistoryStore().list() == []


def test_invalid_new_session_name_is_a_usage_error(tiny_dir: Path, home: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--session", "bad\u202ename"]) == 2
    assert "control characters" in capsys.readouterr().err
    assert HistoryStore().list() == []


def test_ids_json_is_private_and_never_follows_a_planted_symlink(tiny_dir: Path, home: Path,
                                                                  tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "ids.json"
    (tmp_path / "ids.json.tmp").symlink_to(victim)
    assert main(["run", str(tiny_dir), "--ids", "3,7,11", "--gen", "2", "--json", str(out)]) == 0
    assert victim.read_text() == "precious"
    assert json.loads(out.read_text())["generated_ids"]
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600


def test_peer_export_with_damaged_lines_warns_and_fails(home: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    store = HistoryStore()
    sid = store.create("p").id
    store.append(sid, {"role": "user", "content": "q"})
    store.append(sid, {"role": "assistant", "content": "", "reasoning_content": "", "interrupted": True})
    assert main(["sessions", "export", sid, "--format", "jsonl"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(x) for x in out.splitlines()] == [{"role": "user", "content": "q"}]
    assert "left out" in err
    with open(store.root / f"{sid}.jsonl", "ab") as f:
        f.write(b"{lost line\n")
    dest = tmp_path / "peer.jsonl"
    assert main(["sessions", "export", sid, "--format", "jsonl", "-o", str(dest)]) == 1
    err = capsys.readouterr().err
    assert "damaged line not exported" in err and "incomplete" in err
    assert dest.read_text() == out  # still written, with what could be read


# --------------------------------------------------------------------------- issue 12: sessions


def _history_session(name: str, *, pending: bool = False) -> str:
    store = HistoryStore()
    sid = store.create(name).id
    store.append(sid, {"role": "user", "content": "q"})
    if not pending:
        store.append(sid, {"role": "assistant", "content": "a", "reasoning_content": "r"})
    return sid


def test_a_session_being_answered_elsewhere_is_named_not_resumed(tiny_dir: Path, home: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    pending = _history_session("busy", pending=True)
    answered = _history_session("idle")
    other = HistoryStore()  # the other k3chat: its own open of the answering lock
    with other.answering(pending):
        # Started while the other one answers its message: told who, not "--resume".
        assert main(["run", str(tiny_dir), "--prompt", "mine", "--session", "busy"]) == 1
        err = capsys.readouterr().err
        assert f"is being answered by another k3chat (pid {os.getpid()})" in err and "--resume" not in err
        assert main(["run", str(tiny_dir), "--session", "busy", "--resume"]) == 1
        assert "being answered" in capsys.readouterr().err
    with other.answering(answered):
        # Started before the other one saved its message: refused before anything is saved.
        before = records(home, answered)
        assert main(["run", str(tiny_dir), "--prompt", "mine", "--session", "idle", "--max-tokens", "2"]) == 1
        assert "being answered by another k3chat" in capsys.readouterr().err
        assert records(home, answered) == before


def test_two_runs_creating_one_session_name_make_one_session(tiny_dir: Path, home: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    real_create = HistoryStore.create
    rival: list[str] = []

    def other_run_wins(self: HistoryStore, name: str, **kw: Any) -> Any:
        # The other `run --session S` created S while this one was opening the model.
        if not rival:
            rival.append(real_create(HistoryStore(self.root), name).id)
        return real_create(self, name, **kw)

    monkeypatch.setattr(HistoryStore, "create", other_run_wins)
    assert main(["run", str(tiny_dir), "--prompt", "hi", "--session", "S", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert f"another k3chat created session 'S' ({rival[0]})" in err and f"--session {rival[0]}" in err
    assert [(i.id, i.name) for i in HistoryStore().list()] == [(rival[0], "S")]


def test_export_to_a_directory_is_refused_before_any_file_is_made(home: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    sid = _history_session("x")
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    before = sorted(tmp_path.iterdir())
    assert main(["sessions", "export", sid, "-o", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert f"-o {out_dir} is a directory; give a file name" in err
    assert sorted(tmp_path.iterdir()) == before and list(out_dir.iterdir()) == []
    assert main(["sessions", "export", sid, "-o", str(tmp_path / "missing" / "x.md")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sessions_wipe_zeroes_history_and_state_then_deletes(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sid = _history_session("Patient 12")
    keep = _history_session("other")
    session = HistoryStore().root / f"{sid}.jsonl"
    sp = state_path(sid)
    sp.parent.mkdir(parents=True, exist_ok=True)
    sp.write_bytes(b"state: the conversation as ids")
    state_temp = sp.parent / f".{sp.name}.{os.getpid()}.0123456789ab.tmp"
    state_temp.write_bytes(b"state copy")
    assert main(["sessions", "wipe", sid]) == 2  # not a terminal and no --yes: refused
    assert "refusing to wipe session 'Patient 12' without --yes" in capsys.readouterr().err
    fds = [os.open(p, os.O_RDONLY) for p in (session, sp, state_temp)]
    sizes = [os.fstat(fd).st_size for fd in fds]
    try:
        assert main(["sessions", "wipe", "Patient 12", "-y"]) == 0
        for fd, size in zip(fds, sizes):
            assert os.pread(fd, size, 0) == bytes(size)  # overwritten before the unlink
    finally:
        for fd in fds:
            os.close(fd)
    err = capsys.readouterr().err
    assert "3 file(s) overwritten with zeros" in err and "note:" in err and "encryption" in err
    assert not session.exists() and not sp.exists() and not state_temp.exists()
    assert [i.id for i in HistoryStore().list()] == [keep]


# --------------------------------------------------------------------------- issue 8: sessions


def test_export_refuses_an_existing_file_unless_force(home: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    sid = _history_session("x")
    dest = tmp_path / "notes.md"
    dest.write_text("my own notes\n")
    dest.chmod(0o644)
    assert main(["sessions", "export", sid, "-o", str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"-o {dest} already exists; nothing was written" in err and "--force" in err
    assert dest.read_text() == "my own notes\n" and stat.S_IMODE(os.stat(dest).st_mode) == 0o644
    assert main(["sessions", "export", sid, "-o", str(dest), "--force"]) == 0
    assert dest.read_text().startswith("# x\n") and stat.S_IMODE(os.stat(dest).st_mode) == 0o600
    fresh = tmp_path / "fresh.json"
    assert main(["sessions", "export", sid, "--format", "json", "-o", str(fresh)]) == 0
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600


def test_export_never_replaces_a_file_that_appears_meanwhile(home: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat import chat_cli
    sid = _history_session("x")
    dest = tmp_path / "late.md"
    real = chat_cli._output_problem

    def then_someone_writes(output: str | None, force: bool = False) -> str | None:
        problem = real(output, force)
        dest.write_text("written by someone else\n")
        return problem

    monkeypatch.setattr(chat_cli, "_output_problem", then_someone_writes)
    assert main(["sessions", "export", sid, "-o", str(dest)]) == 2
    assert "appeared while exporting; nothing was written" in capsys.readouterr().err
    assert dest.read_text() == "written by someone else\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_rename_to_a_taken_name_is_refused_so_names_resolve(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _history_session("alpha")
    b = _history_session("beta")
    assert main(["sessions", "rename", b, "alpha"]) == 2
    err = capsys.readouterr().err
    assert f"another session is already named 'alpha' ({a}); nothing was renamed" in err
    assert HistoryStore().info(b).name == "beta"
    assert main(["sessions", "show", "alpha"]) == 0  # still names exactly one session
    assert main(["sessions", "rename", b, "gamma"]) == 0


def test_show_prints_readable_text(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = HistoryStore()
    sid = store.create("Smith v. Jones").id
    store.append(sid, {"role": "user", "content": "What is *due process*?"})
    store.append(sid, {"role": "assistant", "content": "It is [a right].", "reasoning_content": "Recall.\x1b[2J"})
    assert main(["sessions", "show", sid]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "Smith v. Jones"  # not "# Smith v\. Jones"
    assert "What is *due process*?\n" in out and "It is [a right].\n" in out
    assert "\u2502 Recall.\\x1b[2J" in out and "\x1b" not in out  # controls shown, never obeyed
    assert "```" not in out


def test_sessions_search_finds_content_and_reasoning_with_snippets(home: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = HistoryStore()
    a = store.create("contract case").id
    store.append(a, {"role": "user", "content": "Read the lease."})
    store.append(a, {"role": "assistant", "content": "It is void.",
                     "reasoning_content": "x" * 60 + " the Indemnity clause\x1b]52;c;bad\x07 is broad " + "y" * 60})
    b = store.create("other").id
    store.append(b, {"role": "user", "content": "indemnity?\nplease"})
    assert main(["sessions", "search", "indemnity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    by_session = {line.split()[0]: line for line in lines}
    assert "(your message 1): indemnity? please" in by_session[b]
    hit = by_session[a]
    assert "(reasoning, message 2): \u2026" in hit and "the Indemnity clause\\x1b]52;c;bad\\x07 is" in hit
    assert hit.endswith("\u2026") and "\x1b" not in hit and "x" * 60 not in hit
    assert main(["sessions", "search", "INDEMNITY", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(d["session"], d["record"], d["field"]) for d in doc} == {(a, 2, "reasoning_content"), (b, 1, "content")}
    first = next(d for d in doc if d["session"] == a)
    assert first["snippet"][first["match_start"]:first["match_end"]] == "Indemnity"
    assert main(["sessions", "search", "nowhere"]) == 0
    assert "no session mentions 'nowhere'" in capsys.readouterr().err
    assert main(["sessions", "search", " "]) == 2
    assert "give some text to search for" in capsys.readouterr().err


def test_sessions_search_and_export_an_encrypted_history(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat import paths, vault
    from k3chat.history import open_store

    secret = tmp_path / "passphrase"
    secret.write_text("correct horse battery staple\n")
    monkeypatch.setenv(vault.PASSPHRASE_ENV, str(secret))
    monkeypatch.setattr(vault, "_UNLOCKED", {})
    paths.ensure_private_dir(paths.data_dir())
    vault.create_key_file(paths.data_dir() / vault.KEY_FILE_NAME, "correct horse battery staple", n=2**10,
                          state=vault.STATE_ON)
    store = open_store()
    sid = store.create("sealed").id
    store.append(sid, {"role": "user", "content": "the settlement figure?"})
    store.append(sid, {"role": "assistant", "content": "Confidential.", "reasoning_content": "figure is 4,750,000"})
    assert b"4,750,000" not in (store.root / f"{sid}.jsonl").read_bytes()  # really encrypted
    assert main(["sessions", "search", "4,750,000"]) == 0
    assert "(reasoning, message 2): figure is 4,750,000" in capsys.readouterr().out
    dest = tmp_path / "sealed.md"
    assert main(["sessions", "export", "sealed", "-o", str(dest)]) == 0
    assert "Confidential." in dest.read_text() and "this export is not" in capsys.readouterr().err

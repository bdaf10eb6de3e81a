"""The shared runtime: one stop policy, one opening path and one error type for every
front-end; and the signal defects the audit found in `run` (issue 12, items 5 and 11)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from k3chat.runtime import (ABORT_STEP, AFTER_STEP, NOW, Failure, SignalStops, StopPolicy, memory_option,
                            one_at_a_time, open_model, say)
from k3engine.exit_codes import EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE

# ----------------------------------------------------------------------------- policy


def test_stop_policy_escalates_through_its_three_levels() -> None:
    calls: list[str] = []
    policy = StopPolicy(exit_now=lambda: calls.append("now"))
    policy.bind(after_step=lambda: calls.append("after"), abort_step=lambda: calls.append("abort"))
    assert not policy.requested.is_set()
    assert [policy.request() for _ in range(4)] == [AFTER_STEP, ABORT_STEP, NOW, NOW]
    assert calls == ["after", "abort", "now", "now"]
    assert policy.requested.is_set()


def test_a_request_before_the_work_is_bound_applies_when_it_is() -> None:
    calls: list[str] = []
    policy = StopPolicy(exit_now=lambda: calls.append("now"))
    assert policy.request() == AFTER_STEP  # nothing bound: only recorded
    assert calls == []
    policy.bind(after_step=lambda: calls.append("after"), abort_step=lambda: calls.append("abort"))
    assert calls == ["after"]


def test_after_finish_a_request_changes_nothing_but_a_third_still_exits() -> None:
    calls: list[str] = []
    policy = StopPolicy(exit_now=lambda: calls.append("now"))
    policy.bind(after_step=lambda: calls.append("after"), abort_step=lambda: calls.append("abort"))
    policy.finish()
    assert policy.request() == 0 and calls == []
    assert policy.request() == NOW and calls == ["now"]


class _SignalWhileHeld:
    """Stands in for the policy's lock and sends this process SIGINT once it is held, so that
    the handler runs inside the critical section, as a Ctrl-C landing there does. Waiting for
    the real lock is bounded: a handler that waits for a lock its own thread holds fails the
    test in 5 s instead of hanging it (the run --ids case in CI decoded on for 120 s)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = True

    def __enter__(self) -> _SignalWhileHeld:
        if not self.inner.acquire(timeout=5):
            raise AssertionError("deadlock: a signal handler waited for the lock its own thread holds")
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before this call returns
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.release()


def _signal_stops(calls: list[str]) -> SignalStops:
    return SignalStops(StopPolicy(exit_now=lambda: calls.append("now")))  # never os._exit in pytest


def test_ctrl_c_while_the_work_is_being_bound_is_applied_not_deadlocked(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []
    with _signal_stops(calls) as signals:
        signals.policy._lock = _SignalWhileHeld(signals.policy._lock)  # type: ignore[assignment]
        signals.policy.bind(after_step=lambda: calls.append("after"), abort_step=lambda: calls.append("abort"))
    assert signals.requested.is_set() and signals.policy.level == AFTER_STEP
    assert calls.count("after") >= 1 and "abort" not in calls and "now" not in calls
    assert "stopping after the current step" in capsys.readouterr().err


def test_a_second_ctrl_c_landing_inside_the_first_is_handled_after_it(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []
    with _signal_stops(calls) as signals:
        signals.policy.bind(after_step=lambda: calls.append("after"), abort_step=lambda: calls.append("abort"))
        signals.policy._lock = _SignalWhileHeld(signals.policy._lock)  # type: ignore[assignment]
        os.kill(os.getpid(), signal.SIGINT)  # the first; the lock sends the second while it is handled
    assert signals.policy.level == ABORT_STEP and calls == ["after", "abort"]
    err = capsys.readouterr().err
    first, second = err.find("stopping after the current step"), err.find("aborting the current step")
    assert 0 <= first < second, err


def test_one_at_a_time_never_nests_a_handler_and_keeps_the_order() -> None:
    seen: list[tuple[int, int]] = []
    depth = [0]

    def handler(signum: int, frame: object) -> None:
        depth[0] += 1
        seen.append((signum, depth[0]))
        if len(seen) == 1:  # two more land while the first is handled
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
        depth[0] -= 1

    wrapped = one_at_a_time(handler)
    old = {sig: signal.signal(sig, wrapped) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    assert seen == [(signal.SIGUSR2, 1), (signal.SIGUSR1, 1), (signal.SIGUSR2, 1)]


def test_a_handler_interrupting_a_write_to_stderr_still_says_what_it_does(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    class InsideAWrite:  # what sys.stderr does when a handler runs inside its own write
        def write(self, text: str) -> int:
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

        def flush(self) -> None:
            raise RuntimeError("reentrant call")

    calls: list[str] = []
    signals = _signal_stops(calls)
    signals.policy.bind(abort_step=lambda: calls.append("abort"))
    monkeypatch.setattr(sys, "stderr", InsideAWrite())
    signals._handler(signal.SIGINT, None)
    say("a status line")
    monkeypatch.undo()
    assert signals.policy.level == AFTER_STEP
    err = capfd.readouterr().err
    assert "stopping after the current step" in err and "k3chat: a status line" in err


def test_exit_codes_are_defined_once() -> None:
    import k3chat.app.app as app
    import k3chat.chat_cli as chat_cli
    import k3chat.cli as cli
    import k3chat.run_ids as run_ids
    import k3chat.runtime as runtime
    import k3engine.exit_codes as codes

    assert (EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_EXPERT_IO, EXIT_INTERRUPTED) == (0, 1, 2, 4, 5)
    for module in (app, chat_cli, cli, run_ids, runtime):
        for name in ("EXIT_OK", "EXIT_RUNTIME", "EXIT_INTERRUPTED"):
            if hasattr(module, name):
                assert getattr(module, name) is getattr(codes, name), (module.__name__, name)
    sources = [Path(m.__file__).read_text() for m in (app, chat_cli, cli, run_ids)]  # type: ignore[arg-type]
    assert not any("EXIT_OK = 0" in s for s in sources)


# ----------------------------------------------------------------------------- opening


def test_open_model_maps_failures_to_exit_codes(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(Failure) as e:
        open_model(tmp_path / "nowhere", memory="all", context=64)
    assert e.value.code == EXIT_USAGE and "nowhere" in e.value.message
    with pytest.raises(Failure) as e:
        open_model(tiny_dir, memory="1M", context=64)  # the plan cannot fit: its numbers
    assert e.value.code == EXIT_USAGE and "budget" in e.value.message.lower()
    opened = open_model(tiny_dir, memory="all", context=64, tokenizer=False)
    try:
        assert opened.tokenizer is None and opened.plan is None and opened.threads >= 1
    finally:
        opened.close()


def test_empty_memory_is_a_mistake_not_auto() -> None:
    assert memory_option(None, "auto") == "auto"
    assert memory_option("12G", "auto") == "12G"
    with pytest.raises(Failure) as e:
        memory_option("", "auto")
    assert e.value.code == EXIT_USAGE and "--memory is empty" in e.value.message


def _k3chat(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "k3chat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("mode", ["--ids", "--prompt", "chat"])
def test_empty_memory_is_refused_by_every_front_end(tiny_dir: Path, tmp_path: Path, mode: str) -> None:
    if mode == "chat":
        r = _k3chat("chat", str(tiny_dir), "--memory", "", home=tmp_path)
    else:
        r = _k3chat("run", str(tiny_dir), mode, "1,2" if mode == "--ids" else "hi", "--memory", "", home=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "--memory" in r.stderr and "empty" in r.stderr  # the app's settings check words it its own way


@pytest.mark.parametrize("mode", ["--ids", "--prompt"])
def test_lookahead_beyond_the_experts_is_refused(tiny_dir: Path, tmp_path: Path, mode: str) -> None:
    from k3engine.config import load_config
    n = load_config(tiny_dir).n_experts
    r = _k3chat("run", str(tiny_dir), mode, "1,2" if mode == "--ids" else "hi", "--lookahead", "1000000",
                home=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"more than the {n} routed experts" in r.stderr
    ok = _k3chat("run", str(tiny_dir), "--ids", "1,2", "--gen", "1", "--lookahead", str(n), home=tmp_path)
    assert ok.returncode == 0, ok.stderr


# ----------------------------------------------------------------------------- signals in run --ids

# Slows every decode step down (before the engine is called) so that a signal reliably lands
# while generation runs, and optionally sends the process a signal at a chosen moment.
DRIVER = """
import os, signal, sys, time
from k3engine.model import Session
real = Session.feed
delay = float(sys.argv[1])
def feed(self, ids, **kw):
    if len(ids) == 1:
        print("driver: decode step", file=sys.stderr, flush=True)
        time.sleep(delay)
    return real(self, ids, **kw)
Session.feed = feed
late = sys.argv[2]
if late != "-":
    import k3chat.run_ids as run_ids, k3chat.chat_cli as chat_cli
    module = run_ids if late == "ids" else chat_cli
    name = "_write_json"
    original = getattr(module, name)
    def after_the_work(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # the work is saved: this must not change the outcome
        time.sleep(0.3)
        return original(*a, **kw)
    setattr(module, name, after_the_work)
from k3chat.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _driven(tmp_path: Path, home: Path, delay: float, late: str, *args: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, str(driver), str(delay), late, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)  # type: ignore[union-attr]
    reader.start()
    _readers[proc.pid] = reader
    return proc, lines


_readers: dict[int, threading.Thread] = {}


def _finish(proc: subprocess.Popen[str], lines: queue.Queue[str], timeout: float = 120) -> str:
    """Wait for the process and return everything it wrote on stderr (the reader thread owns
    the pipe: communicate() would race it)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text = _drain(lines)
        raise AssertionError(f"still running after {timeout} s; stderr ends: {text[-2000:]!r}") from None
    _readers.pop(proc.pid).join(10)
    return _drain(lines)


def _wait_for(lines: queue.Queue[str], needle: str, seconds: float = 60) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        seen.append(line)
        if needle in line:
            return seen


def _drain(lines: queue.Queue[str]) -> str:
    out = []
    while not lines.empty():
        out.append(lines.get())
    return "".join(out)


def test_sighup_acts_as_the_first_ctrl_c_in_run_ids(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc, lines = _driven(tmp_path, tmp_path / "home", 0.2, "-", "run", str(tiny_dir), "--ids", "1,2,3",
                          "--gen", "500", "--threads", "1", "--json", str(out))
    _wait_for(lines, "driver: decode step")   # not "step": run's own start line says "current step"
    proc.send_signal(signal.SIGHUP)
    err = _finish(proc, lines)
    assert proc.returncode == EXIT_INTERRUPTED, err
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and 1 <= len(res["generated_ids"]) < 500


def test_second_ctrl_c_in_run_ids_aborts_the_step_and_still_writes_the_result(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc, lines = _driven(tmp_path, tmp_path / "home", 0.0, "-", "run", str(tiny_dir), "--ids", "1,2,3",
                          "--gen", "200000", "--threads", "1", "--json", str(out))
    _wait_for(lines, "driver: decode step")   # not "step": run's own start line says "current step"
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    err = _finish(proc, lines)
    assert proc.returncode == EXIT_INTERRUPTED, err
    res = json.loads(out.read_text())  # before: the second Ctrl-C exited with nothing written
    assert res["interrupted"] is True and res["error"] is None and len(res["generated_ids"]) >= 1


@pytest.mark.parametrize("mode", ["ids", "prompt"])
def test_a_signal_after_the_work_is_saved_does_not_change_the_exit_code(tiny_dir: Path, tmp_path: Path,
                                                                         mode: str) -> None:
    out = tmp_path / "r.json"
    what = ["--ids", "1,2", "--gen", "3"] if mode == "ids" else ["--prompt", "hi", "--no-think", "--max-tokens", "3"]
    proc, lines = _driven(tmp_path, tmp_path / "home", 0.0, mode, "run", str(tiny_dir), *what,
                          "--threads", "1", "--json", str(out))
    err = _finish(proc, lines)
    assert proc.returncode in (EXIT_OK, EXIT_RUNTIME), err  # a random model's answer may be malformed (1)
    assert "already saved" in err and "Traceback" not in err
    res = json.loads(out.read_text())
    if mode == "ids":
        assert res["interrupted"] is False
    else:  # the turn ended at its token limit, not because of the signal
        assert res["stop"] != "cancelled" and res["exit_code"] == proc.returncode


# A stand-in for a slow interpreter start: importing k3chat.cli takes a second, so a Ctrl-C
# lands while Python imports our modules, as one in the first ~30 ms does on a real start.
SLOW_IMPORT = """
import importlib.abc, sys, time
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "k3chat.cli":
            sys.stderr.write("importing\\n"); sys.stderr.flush()
            time.sleep(1.5)
        return None
sys.meta_path.insert(0, Slow())
entry = sys.argv[1]
module, fn = entry.split(":")
main = getattr(__import__(module, fromlist=[fn]), fn) if module == "k3chat.launch" else None
if main is None:
    from k3chat.cli import main
sys.argv = ["k3chat", "sessions", "list"]
sys.exit(main())
"""


def test_ctrl_c_while_python_imports_k3chat_exits_5_without_a_traceback(tmp_path: Path) -> None:
    """The console script's entry point (pyproject) installs a quiet handler first."""
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("k3chat") == "k3chat.launch:main"  # the installed script uses the launcher
    driver = tmp_path / "slow_import.py"
    driver.write_text(SLOW_IMPORT)
    env = {**os.environ, "K3CHAT_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, str(driver), "k3chat.launch:main"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    assert proc.stderr.readline() == "importing\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "interrupted" in err


# The last moments of a command: its exit code is known and its handlers are put back, then a
# signal arrives before the interpreter has exited (a user's second Ctrl-C landing late).
LATE_SIGNAL = """
import os, signal, sys
import k3chat.cli, k3chat.launch
k3chat.cli.main = lambda: 3  # a command that ended with exit code 3
code = k3chat.launch.main()
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    os.kill(os.getpid(), sig)
sys.stderr.write("still here\\n")
sys.exit(code)
"""


def test_a_signal_after_the_command_returned_keeps_its_exit_code(tmp_path: Path) -> None:
    driver = tmp_path / "late_signal.py"
    driver.write_text(LATE_SIGNAL)
    done = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "K3CHAT_HOME": str(tmp_path / "home")}, cwd=tmp_path)
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "still here" in done.stderr and "Traceback" not in done.stderr


def test_a_small_model_defaults_to_one_thread_and_threads_still_wins() -> None:
    """Waking a second thread for each of the demo's small matrices made decoding ~5x slower;
    the default is one thread below SMALL_MODEL_HIDDEN, an explicit --threads is kept."""
    from k3chat.demo import model_dir
    from k3chat.runtime import SMALL_MODEL_HIDDEN, open_model

    opened = open_model(model_dir(), memory="auto", context=256, tokenizer=False)
    try:
        assert opened.model.config.hidden < SMALL_MODEL_HIDDEN and opened.threads == 1
    finally:
        opened.model.close()
    opened = open_model(model_dir(), memory="auto", context=256, tokenizer=False, threads=2)
    try:
        assert opened.threads == 2
    finally:
        opened.model.close()

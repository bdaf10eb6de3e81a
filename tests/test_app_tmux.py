"""`k3chat chat` in a real terminal (tmux), on the built-in demo model, as a person uses it:
type a question and, before its answer is out, the next message (with alt+enter in it, as
tmux sends it: ESC CR); wait for the answers; press ctrl+c twice; then check the session
file and its permissions, that nothing typed was lost, what was printed after quitting, and
that the next start reuses the saved engine state instead of re-reading the conversation.

Skipped, loudly, where tmux is not installed (.ci/run installs it where apt-get can).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")

QUESTION = "What is 36 + 47?"
FOLLOW_UP = ("And add 7", "to that.")  # typed with alt+enter between the two lines


def _tmux_or_skip() -> str:
    tmux = shutil.which("tmux")
    if tmux is None:
        message = ("tmux is not installed: the tmux-driven test of `k3chat chat` did NOT run "
                   "(apt-get install tmux, or run .ci/run, which installs it)")
        warnings.warn(message)
        pytest.skip(message)
    return tmux


class Terminal:
    """One tmux server of our own (its socket in the test's directory), one window."""

    def __init__(self, tmux: str, socket: Path) -> None:
        self.tmux, self.socket = tmux, socket

    def run(self, *args: str) -> str:
        # No COLUMNS/LINES from the test's environment: the app must size itself from the tty.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
        out = subprocess.run([self.tmux, "-f", os.devnull, "-S", str(self.socket), *args], capture_output=True,
                             text=True, timeout=30, check=True, env=env)
        return out.stdout

    def start(self, command: str, env: dict[str, str]) -> None:
        settings = [a for name, value in env.items() for a in ("-e", f"{name}={value}")]
        self.run("new-session", "-d", "-x", "150", "-y", "45", *settings, command)

    def keys(self, *keys: str) -> None:
        self.run("send-keys", *keys)

    def screen(self) -> str:
        return self.run("capture-pane", "-p")

    def close(self) -> None:
        subprocess.run([self.tmux, "-S", str(self.socket), "kill-server"], capture_output=True, timeout=30)


def wait(condition: Callable[[], Any], what: str, term: Terminal, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; the screen:\n{term.screen()}")


def k3chat_command() -> str:
    script = Path(sys.executable).with_name("k3chat")  # the console script a user runs
    return str(script) if script.exists() else f"{sys.executable} -m k3chat"


def session_files(home: Path) -> list[Path]:
    return sorted((home / "data" / "sessions").glob("*.jsonl"))


def records(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "k3chat" not in r]


def answers(home: Path) -> int:
    files = session_files(home)
    return sum(1 for r in records(files[0]) if r["role"] == "assistant") if files else 0


def test_chat_in_tmux_keeps_every_key_saves_and_resumes(tmp_path: Path) -> None:
    tmux = _tmux_or_skip()
    term = first = Terminal(tmux, tmp_path / "tmux.sock")
    home = tmp_path / "home"
    env = {"K3CHAT_HOME": str(home), "TERM": "tmux-256color"}
    chat = f"{k3chat_command()} chat --threads 2"
    try:
        term.start(f"sh -c '{chat}; echo EXIT=$?; sleep 120'", env)
        wait(lambda: "│ ready" in term.screen(), "the demo model to open", term)
        # One burst: the question, enter, and the next message, typed while K3 answers.
        # (one send-keys: the strings are not key names, so tmux types them as they are)
        term.keys(QUESTION, "Enter", FOLLOW_UP[0], "M-Enter", FOLLOW_UP[1])  # M-Enter: ESC CR
        wait(lambda: answers(home) == 1, "the first answer", term)
        wait(lambda: "│ ready" in term.screen(), "the app to be ready again", term)
        assert answers(home) == 1  # the follow-up waited in the box, it was not sent by alt+enter
        term.keys("Enter")
        wait(lambda: answers(home) == 2, "the second answer", term)
        wait(lambda: "│ ready" in term.screen(), "the app to be ready again", term)
        term.keys("C-c")
        wait(lambda: "again" in term.screen(), "the ctrl+c notice", term, 10)
        term.keys("C-c")
        screen = wait(lambda: (text if "EXIT=" in (text := term.screen()) else None), "k3chat to quit", term, 60)
        assert "EXIT=0" in screen, screen

        (path,) = session_files(home)
        sid = path.stem
        stored = records(path)
        assert [r["role"] for r in stored] == ["user", "assistant", "user", "assistant"]
        assert stored[0]["content"] == QUESTION
        assert stored[2]["content"] == "\n".join(FOLLOW_UP)  # nothing typed was lost
        assert all(r.get("interrupted") is not True for r in stored[1::2])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        state = home / "state" / "sessions" / f"{sid}.k3state"
        assert stat.S_IMODE(state.stat().st_mode) == 0o600
        assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700
        assert f"--session {sid}" in screen.replace("\n", "")  # how to resume, printed after quitting

        # The next start: the saved engine state is reused, only the new message is read.
        first.close()
        term = Terminal(tmux, tmp_path / "tmux2.sock")  # a new server: a dying one refuses new sessions
        term.start(f"sh -c '{chat} --session {sid}; echo EXIT=$?; sleep 120'", env)
        wait(lambda: "│ ready" in term.screen() and QUESTION in term.screen(), "the session to open", term)
        term.keys("What is 2 + 3?", "Enter")
        wait(lambda: answers(home) == 3, "the third answer", term)
        last = records(path)[-1]
        assert last["tokens"]["reused"] > 0, last["tokens"]
        assert last["tokens"]["prefilled"] < last["tokens"]["reused"]
        wait(lambda: "│ ready" in term.screen(), "the app to be ready again", term)
        term.keys("C-q")
        wait(lambda: "EXIT=0" in term.screen(), "k3chat to quit", term, 60)
    finally:
        first.close()
        term.close()

"""Starting `k3chat chat` again with a larger context (k3chat/restart.py, cli._restart): the
argv rewritten, the unsent message handed over in a private file and deleted once read."""
from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from k3chat import cli
from k3chat.restart import Draft, RestartRequest, draft_path, hand_over, restart_argv, take_draft


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_given_session_context_and_memory_are_replaced_and_the_rest_kept() -> None:
    argv = ["chat", "/models/k3", "--session", "old", "--context=2048", "--memory", "4G", "--threads", "2",
            "--no-think", "--temperature", "0.7"]
    request = RestartRequest("0193-abc", 3072, "1.5G")
    assert restart_argv(argv, request) == ["chat", "/models/k3", "--threads", "2", "--no-think", "--temperature",
                                           "0.7", "--context", "3072", "--memory", "1.5G", "--session", "0193-abc"]


def test_without_a_planned_memory_the_given_one_is_kept_and_no_session_is_added() -> None:
    argv = ["chat", "--demo", "--memory=all", "--context", "512"]
    assert restart_argv(argv, RestartRequest(None, 1024, None)) == ["chat", "--demo", "--memory=all",
                                                                    "--context", "1024"]


def test_the_message_is_handed_over_privately_and_deleted_once_read(home: Path) -> None:
    entry = {"name": "lease.txt", "size": 5, "sha256": "0" * 64, "kind": "text", "text": "hello"}
    draft = Draft("When does the lease end?", (entry,), (7,))
    path = hand_over(draft, None)
    assert path == draft_path() and path.parent == home / "state"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert take_draft(None) == draft
    assert not path.exists()
    assert take_draft(None) is None


class _Xor:
    """A stand-in for the history's vault: seals by xor, opens only with the same binding."""

    def seal(self, plaintext: bytes, associated: bytes) -> bytes:
        return bytes(b ^ 0x5A for b in associated + plaintext)

    def open(self, blob: bytes, associated: bytes) -> bytes:
        data = bytes(b ^ 0x5A for b in blob)
        assert data.startswith(associated)
        return data[len(associated):]


def test_an_encrypted_history_gets_a_sealed_draft(home: Path) -> None:
    path = hand_over(Draft("the patient's letter"), _Xor())
    assert b"patient" not in path.read_bytes()
    with pytest.raises(ValueError, match="encrypted and the history is not unlocked"):
        take_draft(None)
    assert path.exists()  # not lost
    assert take_draft(_Xor()) == Draft("the patient's letter")


def test_chat_starts_itself_again_with_the_restart_request(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    request = RestartRequest("0193-abc", 3072, "1.5G", Draft("Summarise"))

    class FakeApp:
        load_error = None
        restart = request
        return_code = 0

        class store:
            vault = None

        def run(self) -> int:
            return 0

        def goodbye(self) -> list[str]:
            return []

    execs: list[list[str]] = []
    monkeypatch.setattr("k3chat.app.build_app", lambda *a, **k: FakeApp())
    monkeypatch.setattr(cli, "terminal_problem", lambda: None)
    monkeypatch.setattr(cli, "_reexec", lambda argv: execs.append(list(argv)))
    cli.main(["chat", "--demo", "--session", "first", "--context", "512", "--threads", "1"])
    assert execs == [["chat", "--demo", "--threads", "1", "--context", "3072", "--memory", "1.5G",
                      "--session", "0193-abc"]]
    assert take_draft(None) == Draft("Summarise")  # written before the new process starts


def test_a_failed_exec_exits_1_and_keeps_the_message(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(argv: Any) -> None:
        raise OSError("exec format error")

    monkeypatch.setattr(cli, "_reexec", refuse)
    code = cli._restart(["chat"], RestartRequest(None, 2048, None, Draft("kept")), None)
    assert code == 1
    assert "could not start again (exec format error)" in capsys.readouterr().err
    assert take_draft(None) == Draft("kept")

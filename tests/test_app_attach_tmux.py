"""`k3chat chat` in a real terminal (tmux) on the demo model: attach a file through the picker
(ctrl+l, its path box), see its chip, ask about it, and find the file's text in the recorded
user message once the turn has ended. Skipped, loudly, where tmux is not installed."""
from __future__ import annotations

import hashlib
import shlex
import stat
from pathlib import Path

import pytest

pytest.importorskip("textual")

from test_app_tmux import Terminal, _tmux_or_skip, answers, k3chat_command, records, session_files, wait  # noqa: E402

DOCUMENT = "Stock count for aisle 4: the first shelf holds 36 boxes and the second shelf holds 47 boxes.\n"
QUESTION = "What is 36 + 47?"


def test_attach_a_file_in_tmux_and_ask_about_it(tmp_path: Path) -> None:
    tmux = _tmux_or_skip()
    term = Terminal(tmux, tmp_path / "tmux.sock")
    home = tmp_path / "home"
    work = tmp_path / "work"
    work.mkdir()
    (work / "stock.txt").write_text(DOCUMENT)
    env = {"K3CHAT_HOME": str(home), "TERM": "tmux-256color"}
    chat = f"cd {shlex.quote(str(work))} && {k3chat_command()} chat --threads 2"
    try:
        term.start(f"sh -c '{chat}; echo EXIT=$?; sleep 120'", env)
        wait(lambda: "│ ready" in term.screen(), "the demo model to open", term)
        term.keys("C-l")
        wait(lambda: "Attach a file" in term.screen(), "the picker", term, 30)
        term.keys("stock.txt")  # into the path box, which has the focus
        wait(lambda: "stock.txt" in term.screen(), "the typed path", term, 30)
        term.keys("Enter")
        wait(lambda: "stock.txt \u00b7 93 B \u00b7" in term.screen(), "the chip", term, 30)
        term.keys(QUESTION, "Enter")
        wait(lambda: answers(home) == 1, "the answer", term)
        wait(lambda: "│ ready" in term.screen(), "the app to be ready again", term)
        screen = term.screen()
        assert "stock.txt \u00b7 plain text \u00b7 93 B" in screen  # the transcript names the file
        assert "shelf holds 36 boxes" not in screen  # and does not print the document
        term.keys("C-q")
        wait(lambda: "EXIT=0" in term.screen(), "k3chat to quit", term, 60)
        (path,) = session_files(home)
        user = records(path)[0]
        assert user["content"] == QUESTION
        assert user["attachments"] == [{"name": "stock.txt", "size": len(DOCUMENT), "kind": "text", "notes": [],
                                        "sha256": hashlib.sha256(DOCUMENT.encode()).hexdigest(), "text": DOCUMENT}]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        term.close()

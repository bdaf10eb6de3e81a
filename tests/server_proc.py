"""`k3chat serve` as a child process for the server tests: loopback, an ephemeral port, and
bounded waits everywhere (a test never hangs on a server that did not start or stop)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

READY = re.compile(r"serving (\S+) on http://127\.0\.0\.1:(\d+)/v1")


class ServerProc:
    def __init__(self, args: Sequence[str], home: Path, *, start_timeout: float = 90.0) -> None:
        env = {**os.environ, "K3CHAT_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        env.pop("K3CHAT_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "k3chat", "serve", "--port", "0", *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.port = 0
        self.model = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
        if not self._ready.wait(start_timeout):
            self.kill()
            raise AssertionError("the server did not start:\n" + self.stderr)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.model, self.port = m.group(1), int(m.group(2))
                self._ready.set()
        self._ready.set()  # exited: let the waiter see it

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout} s:\n{self.stderr}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait()

    def __enter__(self) -> "ServerProc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def wait_until(predicate, timeout: float, step: float = 0.05) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())

"""The engine after fork() (issue 12 item 13).

fork() copies only the calling thread. A model's expert reader threads and the process-wide
compute pool's workers stay in the parent, so a child must neither join them (closing an
inherited model waited forever in pthread_join) nor hand work to them (the pool believed its
workers were there and waited for them). Each test forks the pytest process, which already
runs engine threads: exactly the situation in which the history test's child crashed.
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3engine.model import EngineError, Model, StreamOptions

STREAMING = StreamOptions(reader_threads=2, prefetch=True)  # reader threads started at open


def in_child(work: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Run `work` in a forked child; return what it returned (raise if it died or hung)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        status = 0
        try:
            os.close(read_fd)
            os.write(write_fd, pickle.dumps(("ok", work())))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            os.write(write_fd, pickle.dumps(("error", repr(exc))))
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_fd)
        pytest.fail(f"the forked child hung for {timeout} s")
    with os.fdopen(read_fd, "rb") as fh:
        report = fh.read()
    assert os.WIFEXITED(status), f"the child died of signal {os.WTERMSIG(status)}"
    kind, value = pickle.loads(report)
    assert kind == "ok", value
    return value


def test_child_collecting_an_inherited_model_exits(tiny_dir: Path) -> None:
    # Garbage in a reference cycle is only freed by the cyclic collector, which may run in
    # the child first: its k3_model_close must not wait for the parent's reader threads.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        model = Model(tiny_dir, threads=2, streaming=STREAMING)
        model.session(16).feed([1, 2, 3])
        model.cycle = model  # type: ignore[attr-defined]
        del model
        assert in_child(lambda: gc.collect() > 0, timeout=30) is True
    finally:
        gc.collect()  # the parent frees its own copy, threads and all
        if was_enabled:
            gc.enable()


def test_child_using_an_inherited_model_gets_an_error_not_a_hang(tiny_dir: Path) -> None:
    with Model(tiny_dir, threads=2, streaming=STREAMING) as model:
        session = model.session(16)
        session.feed([1, 2])

        def feed_inherited() -> str:
            try:
                session.feed([3])
            except EngineError as exc:
                return str(exc)
            return "no error"

        message = in_child(feed_inherited, timeout=30)
        assert "inherited through fork()" in message and f"process {os.getpid()}" in message
        assert "open the model again in this process" in message
        session.feed([3])  # the parent's session is untouched


def test_child_runs_its_own_model_on_the_compute_pool(tiny_dir: Path) -> None:
    with Model(tiny_dir, threads=2) as model:  # starts the pool's workers in this process
        want = model.forward([1, 2, 3, 4])

    def forward_in_child() -> list[float]:
        with Model(tiny_dir, threads=2) as own:
            return own.forward([1, 2, 3, 4]).ravel().tolist()

    got = in_child(forward_in_child, timeout=60)
    assert np.array_equal(np.asarray(got, dtype=np.float32), want.ravel())

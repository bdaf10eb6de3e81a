"""`k3chat serve` under stops: SIGTERM mid-answer and mid-prefill, a full queue, a client that
disconnects. Each test starts its own demo server (one compute thread, so that an answer
takes long enough to be interrupted) and bounds every wait."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, wait_until

from k3chat.demo import model_dir


def _longest_row() -> dict[str, Any]:
    rows = [json.loads(line) for line in (model_dir() / "prompts.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = [r for r in rows if r["well_formed"] and len(r["messages"]) == 1 and r["mode"] != "off"]
    return max(rows, key=lambda r: len(r["greedy_ids"]))


LONG = _longest_row()
# A prompt whose prefill takes seconds on one thread (the demo prefills ~200 tokens a second).
LONG_PROMPT = "Repeat after me: " + " ".join(["the cat sat on the mat and the dog ran to the park"] * 60)


def _serve(tmp_path: Path, *extra: str) -> ServerProc:
    return ServerProc(["--demo", "--threads", "1", *extra], tmp_path)


def _body(messages: list[dict[str, str]], *, stream: bool, effort: str = "max", **kw: Any) -> bytes:
    return json.dumps({"messages": messages, "stream": stream, "reasoning_effort": effort, **kw}).encode()


def _post(port: int, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _health(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    except (OSError, ValueError):
        return {}
    finally:
        conn.close()


def _open_stream(port: int, body: bytes) -> tuple[socket.socket, Any]:
    """A streamed request on a raw socket, returned once the headers are in."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    reader = sock.makefile("rb")
    status = reader.readline()
    assert b" 200 " in status, status
    while reader.readline() not in (b"\r\n", b""):
        pass
    return sock, reader


def _next_event(reader: Any) -> str:
    """The data of the next SSE event (chunked transfer framing skipped)."""
    while True:
        line = reader.readline()
        if line == b"":
            raise AssertionError("the stream ended without [DONE]")
        line = line.strip()
        if line.startswith(b"data: "):
            return line[len(b"data: "):].decode()


@pytest.mark.timeout(180)
def test_sigterm_mid_answer_sends_what_was_generated_then_exits_5(tmp_path: Path) -> None:
    with _serve(tmp_path) as srv:
        sock, reader = _open_stream(srv.port, _body(LONG["messages"], stream=True, effort=LONG["mode"]))
        events = [_next_event(reader), _next_event(reader)]  # the role chunk, then the first text
        srv.signal(signal.SIGTERM)
        while events[-1] != "[DONE]":
            events.append(_next_event(reader))
        sock.close()
        code = srv.wait(60)
        chunks = [json.loads(e) for e in events[:-1]]
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert reasoning and LONG["reasoning"].startswith(reasoning)
        assert len(reasoning) < len(LONG["reasoning"])  # cut short, not run to its end
        assert code == 5, srv.stderr
        assert "cut short" in srv.stderr and "Traceback" not in srv.stderr


@pytest.mark.timeout(180)
def test_full_queue_is_503_and_sigterm_refuses_what_waits(tmp_path: Path) -> None:
    with _serve(tmp_path, "--queue", "1") as srv:
        replies: dict[str, tuple[int, bytes]] = {}
        slow = _body([{"role": "user", "content": LONG_PROMPT}], stream=False, effort="low")

        def ask(name: str) -> None:
            replies[name] = _post(srv.port, slow, timeout=120)

        first = threading.Thread(target=ask, args=("first",))
        first.start()
        assert wait_until(lambda: _health(srv.port).get("busy") is True, 30), srv.stderr
        second = threading.Thread(target=ask, args=("second",))
        second.start()
        assert wait_until(lambda: _health(srv.port).get("waiting") == 1, 30), srv.stderr
        status, raw = _post(srv.port, slow)
        assert status == 503 and json.loads(raw)["error"]["code"] == "queue_full"
        srv.signal(signal.SIGTERM)  # while the first request is still prefilling
        first.join(60)
        second.join(60)
        assert not first.is_alive() and not second.is_alive()
        assert replies["second"][0] == 503
        assert json.loads(replies["second"][1])["error"]["code"] == "shutting_down"
        status, raw = replies["first"]
        assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "abort"
        assert srv.wait(60) == 5


@pytest.mark.timeout(180)
def test_a_client_that_disconnects_cancels_its_generation(tmp_path: Path) -> None:
    with _serve(tmp_path) as srv:
        sock, reader = _open_stream(srv.port, _body(LONG["messages"], stream=True, effort=LONG["mode"]))
        _next_event(reader)
        _next_event(reader)
        reader.close()
        sock.shutdown(socket.SHUT_RDWR)  # gone after the first text
        sock.close()
        assert wait_until(lambda: _health(srv.port).get("cancelled") == 1, 30), _health(srv.port)
        health = _health(srv.port)
        assert health["busy"] is False and health["served"] == 0
        # the engine is free and answers the next client in full
        status, raw = _post(srv.port, _body(LONG["messages"], stream=False, effort=LONG["mode"]))
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == LONG["answer"]
        assert srv.stop() == 0

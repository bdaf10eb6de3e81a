"""The remote backend (`run --remote`): against our own `k3chat serve --demo` on loopback (a
real OpenAI-compatible peer) and against recorded vLLM-format streams (tests/data/remote),
replayed by a loopback peer. Expected texts come from the demo model's recorded greedy runs
(prompts.jsonl) or from the recorded stream files, never from the code under test."""
from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from remote_peer import MODEL, ReplayPeer
from server_proc import ServerProc

from k3chat.cli import main
from k3chat.demo import model_dir
from k3chat.history import HistoryStore

KEY = "k3-remote-test-key-5f1e0c9a"
REASONING = "The user asks for 9.11 vs 9.8. 9.8 = 9.80 > 9.11."  # what the recorded streams say
ANSWER = "9.8 is greater."


def _demo_row(mode: str) -> dict[str, Any]:
    rows = [json.loads(line) for line in (model_dir() / "prompts.jsonl").read_text(encoding="utf-8").splitlines()]
    return next(r for r in rows if r["mode"] == mode and r["well_formed"] and len(r["messages"]) == 1)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("K3CHAT_HOME", str(h))
    monkeypatch.delenv("K3CHAT_API_KEY", raising=False)
    return h


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    home = tmp_path_factory.mktemp("server-home")
    key_file = home / "key"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o600)
    with ServerProc(["--demo", "--threads", "1", "--api-key-file", str(key_file)], home) as srv:
        yield srv
        assert srv.stop() == 0, srv.stderr


def _sessions(home: Path) -> list[Any]:
    return HistoryStore().list() if (home).exists() else []


def _history_bytes(home: Path) -> bytes:
    return b"".join(p.read_bytes() for p in home.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- our own server


@pytest.mark.timeout(180)
def test_run_remote_against_our_server_answers_as_the_demo_model_and_reuses_the_prefix(
        server: ServerProc, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    row = _demo_row("low")
    monkeypatch.setenv("K3CHAT_API_KEY", KEY)
    # A proxy in the environment is not used: only the named host is contacted.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    out1, out2 = tmp_path / "1.json", tmp_path / "2.json"
    code = main(["run", "--remote", server.url, "--prompt", row["messages"][0]["content"], "--thinking-effort", "low",
                 "--session", "remote-chat", "--json", str(out1)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    first = json.loads(out1.read_text())
    assert (first["reasoning"], first["answer"]) == (row["reasoning"], row["answer"])
    assert first["prompt_tokens"] == len(row["prompt_ids"])
    # the server's usage counts every sampled id, the end id included, as a local turn records
    assert first["generated_tokens"] == len(row["greedy_ids"])
    assert first["remote"] == server.url + "/v1" and first["model"] == "k3chat-demo"
    assert f"--- reasoning ---\n{row['reasoning']}" in printed.out and row["answer"] in printed.out
    assert "remote model k3chat-demo at " + server.url in printed.err

    assert main(["run", "--remote", server.url, "--session", "remote-chat", "--prompt", "and 1 + 1?",
                 "--thinking-effort", "low", "--json", str(out2)]) == 0
    second = json.loads(out2.read_text())
    # The server kept the first turn: the whole first prompt at least is a cached prefix.
    assert second["reused_tokens"] >= len(row["prompt_ids"])
    assert second["prefilled_tokens"] == second["prompt_tokens"] - second["reused_tokens"] > 0

    records = HistoryStore().load(first["session"]).records
    assert [r["role"] for r in records] == ["user", "assistant", "user", "assistant"]
    assert records[1]["reasoning_content"] == row["reasoning"] and records[1]["content"] == row["answer"]
    assert records[1]["effort"] == "low" and records[1]["model"] == "k3chat-demo"
    assert records[1]["tokens"]["prompt"] == len(row["prompt_ids"])
    assert KEY.encode() not in _history_bytes(home)
    assert KEY not in printed.out + printed.err + out1.read_text() + out2.read_text()


@pytest.mark.timeout(180)
def test_run_remote_json_has_the_fields_of_a_local_run(server: ServerProc, home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    local, remote = tmp_path / "local.json", tmp_path / "remote.json"
    assert main(["run", "--demo", "--prompt", "2 + 3 = ?", "--thinking-effort", "low", "--json", str(local)]) == 0
    monkeypatch.setenv("K3CHAT_API_KEY", KEY)
    assert main(["run", "--remote", server.url, "--prompt", "2 + 3 = ?", "--thinking-effort", "low",
                 "--json", str(remote)]) == 0
    local_doc, remote_doc = json.loads(local.read_text()), json.loads(remote.read_text())
    assert set(local_doc) <= set(remote_doc)
    assert (remote_doc["answer"], remote_doc["reasoning"]) == (local_doc["answer"], local_doc["reasoning"])


@pytest.mark.timeout(120)
def test_a_wrong_key_is_refused_clearly_nothing_is_saved_and_the_key_is_never_written(
        server: ServerProc, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    wrong = "k3-wrong-key-ab12cd34"
    key_file = tmp_path / "key"
    key_file.write_text(wrong + "\n")
    caplog.set_level(logging.DEBUG)
    code = main(["run", "--remote", server.url, "--api-key-file", str(key_file), "--prompt", "hi",
                 "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert code == 1
    assert "refused the API key (HTTP 401)" in err and "nothing was saved" in err
    assert _sessions(home) == []
    logs = caplog.text + err
    assert wrong not in logs and wrong.encode() not in _history_bytes(home)


@pytest.mark.timeout(120)
def test_an_unknown_model_is_a_404_with_the_servers_reason(server: ServerProc, home: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("K3CHAT_API_KEY", KEY)
    assert main(["run", "--remote", server.url, "--model", "no-such-model", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "no-such-model" in err and "nothing was saved" in err
    assert _sessions(home) == []


# --------------------------------------------------------------------------- recorded vLLM streams


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", ["vllm_reasoning_content.sse", "vllm_reasoning.sse"])
def test_a_recorded_vllm_stream_is_shown_and_stored_like_a_local_turn(
        stream: str, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    with ReplayPeer(stream) as peer:
        code = main(["run", "--remote", peer.url, "--prompt", "9.11 and 9.8, which is greater?",
                     "--thinking-effort", "high", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert printed.out == f"--- reasoning ---\n{REASONING}\n--- answer ---\n{ANSWER}\n"
    doc = json.loads(out.read_text())
    assert (doc["reasoning"], doc["answer"], doc["stop"], doc["interrupted"]) == (REASONING, ANSWER, "end", False)
    assert (doc["prompt_tokens"], doc["generated_tokens"]) == (31, 9)  # the stream's usage
    assert doc["model"] == MODEL  # the server's first model, from GET /v1/models
    request = peer.requests[-1]
    assert request["path"] == "/v1/chat/completions"
    body = request["body"]
    assert body["model"] == MODEL and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["chat_template_kwargs"] == {"thinking": True, "thinking_effort": "high"}
    assert body["messages"] == [{"role": "user", "content": "9.11 and 9.8, which is greater?"}]
    assert "authorization" not in {k.lower() for k in request["headers"]}  # no key given, none sent
    record = HistoryStore().load(doc["session"]).records[-1]
    assert (record["reasoning_content"], record["content"]) == (REASONING, ANSWER)
    assert "interrupted" not in record and record["remote"] == peer.url + "/v1"
    assert record["stop"] == "end"  # why it ended is kept, as a local record keeps it
    speed = record["speed"]  # time to the first text and for the whole turn, as a local turn stores them
    assert 0 < speed["first_token_seconds"] <= speed["turn_seconds"], speed


@pytest.mark.timeout(60)
def test_the_key_goes_in_the_authorization_header_only(home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("K3CHAT_API_KEY", KEY)
    with ReplayPeer() as peer:
        assert main(["run", "--remote", peer.url, "--prompt", "hi", "--json", str(tmp_path / "o.json")]) == 0
    assert all(r["headers"].get("Authorization") == f"Bearer {KEY}" for r in peer.requests)
    assert KEY not in json.dumps([r["body"] for r in peer.requests])
    assert KEY.encode() not in _history_bytes(home)
    assert KEY not in capsys.readouterr().err + (tmp_path / "o.json").read_text()


@pytest.mark.timeout(60)
def test_a_stream_cut_in_the_middle_is_saved_interrupted_and_exits_1(
        home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    with ReplayPeer("vllm_cut.sse", cut=True) as peer:
        code = main(["run", "--remote", peer.url, "--prompt", "9.11 and 9.8, which is greater?", "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert "the connection to 127.0.0.1:" in err and "broke during the answer" in err
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["stop"] == "error" and doc["exit_code"] == 1
    record = HistoryStore().load(doc["session"]).records[-1]
    assert record["role"] == "assistant" and record["interrupted"] is True and record["stop"] == "error"
    assert (record["reasoning_content"], record["content"]) == (REASONING, "9.8 is")


@pytest.mark.timeout(60)
def test_a_stream_that_ends_without_done_is_not_taken_as_complete(home: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with ReplayPeer("vllm_cut.sse") as peer:  # a clean end of body, but no finish and no [DONE]
        code = main(["run", "--remote", peer.url, "--prompt", "hi", "--json", str(tmp_path / "o.json")])
    assert code == 1
    assert "ended before the answer was finished" in capsys.readouterr().err
    assert json.loads((tmp_path / "o.json").read_text())["interrupted"] is True


@pytest.mark.timeout(60)
def test_the_token_limit_is_said_and_saved_as_a_local_run_does(home: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    with ReplayPeer("vllm_length.sse") as peer:
        assert main(["run", "--remote", peer.url, "--prompt", "hi", "--max-tokens", "3", "--json", str(out)]) == 0
    assert peer.requests[-1]["body"]["max_tokens"] == 3
    assert "token limit" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert (doc["stop"], doc["interrupted"], doc["reasoning"], doc["answer"]) == (
        "limit", True, "The user asks for 9.11 vs 9.8.", "")
    assert HistoryStore().load(doc["session"]).records[-1]["stop"] == "limit"


@pytest.mark.timeout(60)
def test_a_server_error_status_says_what_the_server_said(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ReplayPeer(status=400, error="this request needs 9000 prompt tokens") as peer:
        assert main(["run", "--remote", peer.url, "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 400: this request needs 9000 prompt tokens" in err and "nothing was saved" in err
    assert _sessions(home) == []


@pytest.mark.timeout(60)
def test_abort_stops_a_silent_stream_at_once_and_keeps_what_arrived(home: Path) -> None:
    import threading
    import time

    from k3chat.events import ReasoningToken, TurnDone
    from k3chat.remote import Endpoint, RemoteClient, RemoteConversation

    # 2 lines per event (data + blank): the role chunk and the five reasoning chunks, then silence
    with ReplayPeer(stall_after=12) as peer:
        store = HistoryStore()
        info = store.create("abort")
        client = RemoteClient(Endpoint(url=peer.url + "/v1", model=MODEL))
        conv = RemoteConversation(client, MODEL, store, info.id)
        done: list[Any] = []
        all_reasoning = threading.Event()

        def seen(event: Any) -> None:
            done.append(event)
            if sum(isinstance(e, ReasoningToken) for e in done) == 5:
                all_reasoning.set()

        def stop_when_silent() -> None:
            if peer.stalled.wait(20) and all_reasoning.wait(20):
                conv.abort()

        threading.Thread(target=stop_when_silent, daemon=True).start()
        started = time.monotonic()
        result = conv.send("9.11 and 9.8, which is greater?", on_event=seen)
        elapsed = time.monotonic() - started
        client.close()
    assert elapsed < 10  # not the peer's 20 s of silence
    assert (result.stop, result.interrupted, result.reasoning, result.answer) == ("cancelled", True, REASONING, "")
    assert isinstance(done[-1], TurnDone)
    record = store.load(info.id).records[-1]
    assert (record["reasoning_content"], record["content"], record["interrupted"], record["stop"]) == (
        REASONING, "", True, "cancelled")


@pytest.mark.timeout(90)
def test_ctrl_c_twice_stops_run_remote_on_a_silent_server_saved_and_exit_5(home: Path, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "o.json"
    with ReplayPeer(stall_after=12) as peer:
        env = {**os.environ, "K3CHAT_HOME": str(home)}
        proc = subprocess.Popen([sys.executable, "-m", "k3chat", "run", "--remote", peer.url, "--prompt", "hi",
                                 "--json", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        try:
            assert peer.stalled.wait(30), "the run never reached the peer"
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)  # first: after the event in flight, but none comes
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)  # second: close the stream now
            _, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 5, err
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["stop"] == "cancelled"
    assert HistoryStore().load(doc["session"]).records[-1]["interrupted"] is True


# --------------------------------------------------------------------------- connection problems and usage


@pytest.mark.timeout(60)
def test_tls_is_verified_a_certificate_nobody_trusts_is_refused(home: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from remote_peer import self_signed
    with ReplayPeer(tls=self_signed(tmp_path)) as peer:
        assert main(["run", "--remote", peer.url, "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "could not be verified against the system's trust store" in err and "--remote-ca-file" in err and "nothing was saved" in err
    assert peer.requests == []  # no request was sent over the unverified connection
    assert _sessions(home) == []


@pytest.mark.timeout(60)
def test_a_private_ca_given_with_remote_ca_file_is_trusted(home: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from remote_peer import self_signed
    cert, key = self_signed(tmp_path)
    out = tmp_path / "o.json"
    with ReplayPeer(tls=(cert, key)) as peer:
        code = main(["run", "--remote", peer.url, "--remote-ca-file", str(cert), "--prompt", "hi", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["answer"] == ANSWER


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.timeout(60)
def test_connection_refused_is_a_clear_error_and_nothing_is_saved(home: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["run", "--remote", url, "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the server at {url}/v1" in err and "is it running" in err
    assert _sessions(home) == []


@pytest.mark.parametrize("argv, message", [
    (["--remote", "ftp://host"], "not an http:// or https:// address"),
    (["--remote", "https://user:pw@host"], "must not carry a user or password"),
    (["--remote", "http://127.0.0.1:1", "--memory", "8G"], "--memory is for the local model"),
    (["--remote", "http://127.0.0.1:1", "--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key: no such"),
    (["--demo", "--remote", "http://127.0.0.1:1"], "give no MODEL_DIR, --demo or --ids"),
    (["--demo", "--model", "x"], "--model, --api-key-file and --remote-ca-file are for --remote"),
])
def test_remote_usage_problems_exit_2_with_the_reason(argv: list[str], message: str, home: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *argv, "--prompt", "hi"]) == 2
    assert message in capsys.readouterr().err
    assert _sessions(home) == []


@pytest.mark.parametrize("argv, message", [
    (["--remote", "ftp://host"], "not an http:// or https:// address"),
    (["--remote", "http://127.0.0.1:1", "--memory", "8G"], "--memory is for the local model"),
    (["--remote", "http://127.0.0.1:1", "--threads", "2", "--context", "9"], "--threads, --context are for the local"),
    (["--demo", "--remote", "http://127.0.0.1:1"], "give no MODEL_DIR or --demo"),
    (["--remote", "http://127.0.0.1:1", "--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key"),
    (["--remote", "http://127.0.0.1:1"], "needs a terminal"),  # the remote app is built, then refused here
])
def test_chat_remote_usage_problems_exit_2_with_the_reason(argv: list[str], message: str, home: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_remote_config_key_is_used_and_a_model_on_the_command_line_beats_it(
        home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat import paths
    with ReplayPeer() as peer:
        config = paths.config_dir() / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(f'remote = "{peer.url}"\nremote_model = "{MODEL}"\n')
        out = tmp_path / "o.json"
        assert main(["run", "--prompt", "hi", "--json", str(out)]) == 0
        assert json.loads(out.read_text())["answer"] == ANSWER
        assert [r["path"] for r in peer.requests] == ["/v1/chat/completions"]  # the model was named: no lookup
        assert main(["run", "--demo", "--prompt", "2 + 3 = ?", "--max-tokens", "2", "--json", str(out)]) == 0
        assert len(peer.requests) == 1  # the local model answered
        assert "remote" not in json.loads(out.read_text())


# --------------------------------------------------------------------------- no socket without --remote


SOCKET_ATTEMPTS: list[tuple[Any, ...]] = []


class _NoSockets:
    """Counts every attempt (an error could be swallowed on the way) and refuses it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        SOCKET_ATTEMPTS.append(args)
        raise PermissionError("a socket was opened without --remote")


@pytest.mark.timeout(120)
def test_a_local_run_opens_no_socket(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "socket", _NoSockets)
    monkeypatch.setattr(socket, "create_connection", _NoSockets)
    SOCKET_ATTEMPTS.clear()
    out = tmp_path / "o.json"
    assert main(["run", "--demo", "--prompt", "2 + 3 = ?", "--thinking-effort", "low", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["answer"] == _demo_row("low")["answer"]
    assert SOCKET_ATTEMPTS == []


def _refuse(*args: Any, **kwargs: Any) -> Any:
    SOCKET_ATTEMPTS.append(args)
    raise PermissionError("a socket was opened without --remote")


def _guard_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """No connection, bind or name lookup; asyncio's in-process socketpair (the app's event
    loop) stays possible, which guarding socket.socket itself would break."""
    for name in ("connect", "connect_ex", "bind", "sendto"):
        monkeypatch.setattr(socket.socket, name, _refuse)
    for name in ("create_connection", "getaddrinfo", "create_server"):
        monkeypatch.setattr(socket, name, _refuse)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("guard", ["construction", "network"])
def test_the_socket_guards_do_catch_a_connection(guard: str, home: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The guards are not vacuous: a --remote run under either cannot connect."""
    if guard == "construction":
        monkeypatch.setattr(socket, "socket", _NoSockets)
        monkeypatch.setattr(socket, "create_connection", _NoSockets)
    else:
        _guard_network(monkeypatch)
    SOCKET_ATTEMPTS.clear()
    assert main(["run", "--remote", "http://127.0.0.1:9", "--prompt", "hi"]) == 1
    assert "a socket was opened without --remote" in capsys.readouterr().err
    assert SOCKET_ATTEMPTS != []


# --------------------------------------------------------------------------- the app


textual = pytest.importorskip("textual")


async def _until(pilot: Any, condition: Any, what: str, timeout: float = 120.0) -> None:
    import time
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def _ask(app: Any, pilot: Any, text: str) -> None:
    before = app.turns_over
    app.chat.prompt.set_text(text)
    await pilot.press("enter")
    await _until(pilot, lambda: app.turns_over > before, "the turn to end")
    await pilot.pause(0.05)


def _screen_text(app: Any) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


@pytest.mark.timeout(240)
def test_the_app_on_our_server_says_it_is_remote_and_keeps_history_and_reasoning(
        server: ServerProc, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from k3chat.app import build_app
    from k3chat.app.engine import open_remote_engine
    from k3chat.app.widgets.reasoning import ReasoningBlock
    from k3chat.app.widgets.transcript import AnswerBlock
    from k3chat.remote import Endpoint
    from k3chat.settings import Settings

    row = _demo_row("low")
    endpoint = Endpoint(url=server.url + "/v1", api_key=KEY)
    app = build_app(Path("the server"), settings=Settings(effort="low"), demo=False,
                    engine_factory=lambda _d, _s, progress: open_remote_engine(endpoint, progress))

    async def scenario() -> str:
        async with app.run_test(size=(170, 45)) as pilot:
            await _until(pilot, lambda: app.ready, "the remote model to be found")
            status = " ".join(app.chat.status.parts())
            assert "k3chat-demo (remote)" in status and f"remote: {server.url}/v1" in status
            await _ask(app, pilot, row["messages"][0]["content"])
            assert app.ui_errors == []
            assert app.chat.query(ReasoningBlock).last().text == row["reasoning"]
            assert row["answer"] in app.chat.query(AnswerBlock).last().text
            await _ask(app, pilot, "and 1 + 1?")
            assert app.ui_errors == []
            sid = app.conv.session_id
            await pilot.press("ctrl+q")
        return sid

    sid = asyncio.run(asyncio.wait_for(scenario(), 200))
    records = HistoryStore().load(sid).records
    assert [r["role"] for r in records] == ["user", "assistant", "user", "assistant"]
    assert (records[1]["reasoning_content"], records[1]["content"]) == (row["reasoning"], row["answer"])
    assert records[3]["tokens"]["reused"] >= len(row["prompt_ids"])  # the server reused the first turn
    assert KEY.encode() not in _history_bytes(home)


@pytest.mark.timeout(240)
def test_the_app_on_the_demo_model_opens_no_socket(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from k3chat.app import build_app
    from k3chat.app.widgets.transcript import AnswerBlock
    from k3chat.settings import Settings

    row = _demo_row("low")
    _guard_network(monkeypatch)
    SOCKET_ATTEMPTS.clear()
    app = build_app(None, settings=Settings(effort="low"), demo=True, threads=1)

    async def scenario() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await _until(pilot, lambda: app.ready, "the demo model to open")
            assert "remote" not in " ".join(app.chat.status.parts())
            await _ask(app, pilot, row["messages"][0]["content"])
            assert row["answer"] in app.chat.query(AnswerBlock).last().text
            await pilot.press("ctrl+q")

    asyncio.run(asyncio.wait_for(scenario(), 200))
    assert SOCKET_ATTEMPTS == []


def test_the_http_client_is_loaded_only_for_remote() -> None:
    """A local run does not even import the HTTP client; k3chat.remote without a client does not either."""
    import subprocess
    import sys
    import tempfile

    code = ("import sys, k3chat.cli, k3chat.chat_cli, k3chat.app, k3chat.remote, k3chat.settings; "
            "k3chat.settings.load_settings(); k3chat.cli.build_parser().parse_args(['run', '--remote', 'http://h', "
            "'--prompt', 'x']); assert 'httpx2' not in sys.modules and 'httpx' not in sys.modules; "
            "k3chat.remote.RemoteClient(k3chat.remote.Endpoint('http://h/v1')); assert 'httpx2' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tempfile.gettempdir())


@pytest.mark.timeout(60)
def test_editing_the_last_message_keeps_its_attachments(home: Path, tmp_path: Path) -> None:
    """RemoteConversation.edit_last keeps the message's files (stored, and sent in its text),
    as Conversation.edit_last does."""
    from k3chat.attachments import read_attachment
    from k3chat.remote import Endpoint, RemoteClient, RemoteConversation

    doc = tmp_path / "lease.txt"
    doc.write_text("The lease ends on 31 May.\n", encoding="utf-8")
    attachment = read_attachment(doc)
    store = HistoryStore()
    sid = store.create("lease").id
    with ReplayPeer() as peer:
        client = RemoteClient(Endpoint(peer.url + "/v1"))
        try:
            conv = RemoteConversation(client, MODEL, store, sid, thinking=False)
            conv.send("When does it end?", attachments=[attachment])
            conv.edit_last("When does the lease end?")
        finally:
            client.close()
    users = [r for r in HistoryStore().load(sid).records if r["role"] == "user"]
    assert [u["content"] for u in users] == ["When does the lease end?"]
    assert users[0]["attachments"] == [attachment.to_record()]
    sent = peer.requests[-1]["body"]["messages"][-1]
    assert sent["role"] == "user" and "The lease ends on 31 May." in sent["content"]
    assert "When does the lease end?" in sent["content"]

"""`k3chat serve --demo` against real clients: the official `openai` package and raw SSE.

Expected answers come from the demo model's recorded greedy runs (prompts.jsonl, checked
against the C engine by test_demo_model), never from the server; expected token counts are
the recorded prompt ids. One server (with an API key) serves the whole module.
"""
from __future__ import annotations

import http.client
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install '.[test]'")

from server_proc import ServerProc  # noqa: E402

from k3chat.demo import model_dir  # noqa: E402

KEY = "k3-test-key-0123456789abcdef"
EFFORT = {"low": "low", "high": "high", "max": "max", "off": "none"}


def _rows() -> list[dict[str, Any]]:
    path = model_dir() / "prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [r for r in rows if r["well_formed"] and len(r["messages"]) == 1]


ROWS = _rows()


def _row(mode: str, index: int = 0) -> dict[str, Any]:
    return [r for r in ROWS if r["mode"] == mode][index]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    home = tmp_path_factory.mktemp("home")
    key_file = home / "key"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o600)
    with ServerProc(["--demo", "--context", "2048", "--threads", "1", "--api-key-file", str(key_file)], home) as srv:
        yield srv
        assert srv.stop() == 0, srv.stderr
    assert KEY not in srv.stderr  # the key is never logged


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _ask(client: Any, row: dict[str, Any], **kw: Any) -> Any:
    return client.chat.completions.create(model="k3chat-demo", messages=row["messages"],
                                          reasoning_effort=EFFORT[row["mode"]], **kw)


def _reasoning(obj: Any) -> str | None:
    return getattr(obj, "reasoning_content", None)


@pytest.mark.timeout(120)
def test_models_lists_the_demo(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == ["k3chat-demo"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["low", "max", "off"])
def test_chat_answer_and_reasoning_are_separate_and_match_the_recorded_run(client: Any, mode: str) -> None:
    row = _row(mode)
    reply = _ask(client, row)
    message = reply.choices[0].message
    assert message.content == row["answer"]
    if mode == "off":
        assert _reasoning(message) is None
    else:
        assert _reasoning(message) == row["reasoning"]
        assert getattr(message, "reasoning") == row["reasoning"]
        assert row["reasoning"] not in message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(row["prompt_ids"])
    # every sampled id counts, the end id after the closed response included, as recorded
    assert reply.usage.completion_tokens == len(row["greedy_ids"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.timeout(120)
def test_streaming_deltas_rebuild_the_same_answer(client: Any) -> None:
    row = _row("high", 1)
    stream = _ask(client, row, stream=True, stream_options={"include_usage": True})
    reasoning, content, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if _reasoning(delta):
            reasoning.append(_reasoning(delta))
            assert not delta.content  # a delta is one channel or the other
        if delta.content:
            content.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == row["reasoning"]
    assert "".join(content) == row["answer"]
    assert len(reasoning) > 3 and len(content) > 3  # streamed, not one lump
    assert finish == "stop"
    assert usage is not None and usage.prompt_tokens == len(row["prompt_ids"])


@pytest.mark.timeout(120)
def test_second_turn_reuses_the_first_turns_prompt(client: Any) -> None:
    first, second = _row("low", 2), _row("low", 3)
    one = _ask(client, first)
    assert one.choices[0].message.content == first["answer"]
    # the client resends the conversation, without the reasoning (as most clients do)
    messages = first["messages"] + [{"role": "assistant", "content": one.choices[0].message.content},
                                    second["messages"][0]]
    two = client.chat.completions.create(model="k3chat-demo", messages=messages, reasoning_effort="low")
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(first["prompt_ids"])  # the whole first prompt was not fed again
    assert two.usage.prompt_tokens > cached
    # and with the reasoning resent, the first answer's tokens are reused too
    messages[1]["reasoning_content"] = _reasoning(one.choices[0].message)
    three = client.chat.completions.create(model="k3chat-demo", messages=messages, reasoning_effort="low")
    assert three.usage.prompt_tokens_details.cached_tokens >= len(first["prompt_ids"]) + len(first["reasoning"]) // 8
    # (the two prompts differ by the reasoning, so the answers may too: both end by themselves)
    assert two.choices[0].finish_reason == three.choices[0].finish_reason == "stop"


@pytest.mark.timeout(120)
def test_stop_strings_cut_the_answer(client: Any) -> None:
    row = _row("off", 1)
    cut = row["answer"].index("=")
    reply = _ask(client, row, stop=["="])
    assert reply.choices[0].message.content == row["answer"][:cut]
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.timeout(120)
def test_max_tokens_ends_with_length(client: Any) -> None:
    row = _row("off", 2)
    reply = _ask(client, row, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    assert row["answer"].startswith(reply.choices[0].message.content)


@pytest.mark.timeout(120)
def test_seeded_sampling_is_reproducible(client: Any) -> None:
    row = _row("max", 1)
    a = _ask(client, row, temperature=1.5, seed=7)
    b = _ask(client, row, temperature=1.5, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert _reasoning(a.choices[0].message) == _reasoning(b.choices[0].message)


@pytest.mark.timeout(120)
def test_text_completions(client: Any) -> None:
    reply = client.completions.create(model="k3chat-demo", prompt="2 + 3", max_tokens=4)
    assert reply.object == "text_completion"
    assert reply.usage.completion_tokens <= 4 and reply.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="k3chat-demo", prompt="2 + 3", max_tokens=4, stream=True) if c.choices)
    assert streamed == reply.choices[0].text


# --------------------------------------------------------------------------- errors


@pytest.mark.timeout(120)
def test_wrong_or_missing_key_is_401(server: ServerProc) -> None:
    for key in ("wrong-key", KEY[:-1], KEY + "x"):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key, timeout=30, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401
        assert key not in str(info.value)
    status, _, body = _raw(server, "GET", "/v1/models", None, key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.timeout(120)
def test_unknown_model_is_404(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "k3chat-demo" in str(info.value)


@pytest.mark.timeout(120)
def test_context_overflow_is_400_with_the_numbers(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="k3chat-demo", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5000)
    text = str(info.value)
    assert "5000" in text and "2048" in text and info.value.code == "context_length_exceeded"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "medium"}', "reasoning_effort"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n=2"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}', "at most 4"),
])
def test_malformed_requests_are_400_without_a_trace(server: ServerProc, body: bytes, fragment: str) -> None:
    status, headers, raw = _raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400
    error = json.loads(raw)["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert b"Traceback" not in raw


@pytest.mark.timeout(120)
def test_unknown_route_is_a_json_404(server: ServerProc) -> None:
    status, _, raw = _raw(server, "GET", "/v1/engines", None)
    assert status == 404 and "/v1/chat/completions" in json.loads(raw)["error"]["message"]


# --------------------------------------------------------------------------- raw SSE, as curl sees it


def _raw(server: ServerProc, method: str, path: str, body: bytes | None, *,
         key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _sse_events(raw: bytes) -> list[str]:
    """Events of a text/event-stream body: blank-line separated, each one `data:` line here."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert all(line.startswith("data: ") for line in lines), block
        events.append("\n".join(line[len("data: "):] for line in lines))
    return events


@pytest.mark.timeout(120)
def test_raw_sse_stream(server: ServerProc) -> None:
    row = _row("low", 4)
    body = json.dumps({"model": "k3chat-demo", "messages": row["messages"], "stream": True,
                       "chat_template_kwargs": {"thinking": True, "thinking_effort": "low"}}).encode()
    status, headers, raw = _raw(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == row["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == row["answer"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.timeout(120)
def test_thinking_off_through_chat_template_kwargs(server: ServerProc) -> None:
    row = _row("off", 3)
    body = json.dumps({"messages": row["messages"], "chat_template_kwargs": {"thinking": False}}).encode()
    status, _, raw = _raw(server, "POST", "/v1/chat/completions", body)
    message = json.loads(raw)["choices"][0]["message"]
    assert status == 200 and message["content"] == row["answer"] and "reasoning_content" not in message


# --------------------------------------------------------------------------- load


@pytest.mark.timeout(240)
def test_concurrent_clients_get_complete_answers_identical_to_solo_runs(server: ServerProc, client: Any) -> None:
    rows = [_row(mode, i) for mode in ("low", "high", "off") for i in (5, 6)]
    solo = {id(r): _ask(client, r).choices[0].message for r in rows}
    for r in rows:
        assert solo[id(r)].content == r["answer"]
    results: dict[tuple[int, int], Any] = {}
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        mine = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)
        try:
            for k, r in enumerate(rows[n:] + rows[:n]):  # each client in its own order
                if k % 2:
                    results[(n, id(r))] = _ask(mine, r).choices[0].message
                else:  # streamed
                    parts = {"reasoning": [], "content": []}
                    for chunk in _ask(mine, r, stream=True):
                        if chunk.choices:
                            d = chunk.choices[0].delta
                            parts["reasoning"].append(_reasoning(d) or "")
                            parts["content"].append(d.content or "")
                    results[(n, id(r))] = openai.types.chat.ChatCompletionMessage(
                        role="assistant", content="".join(parts["content"]),
                        reasoning_content="".join(parts["reasoning"]) or None)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert not any(t.is_alive() for t in threads), "a client did not finish in time"
    assert not errors, errors
    assert len(results) == 4 * len(rows)
    for (n, rid), message in results.items():
        assert message.content == solo[rid].content
        assert _reasoning(message) == _reasoning(solo[rid])
    # several conversations kept for reuse, within the room the plan has for one full state
    from k3engine.config import load_config
    from k3engine.planner import snapshot_bytes
    status, _, raw = _raw(server, "GET", "/health", None)
    health = json.loads(raw)
    assert health["saved_states"] >= 2
    assert 0 < health["saved_state_bytes"] <= snapshot_bytes(load_config(model_dir()), 2048)

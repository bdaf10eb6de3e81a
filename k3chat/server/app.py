"""The HTTP side: Starlette routes in the shape of the OpenAI API, as vLLM serves it.

- ``POST /v1/chat/completions``: messages rendered with our XTML template; the think channel
  comes back as ``reasoning_content`` (vLLM's name) and ``reasoning`` (the newer one), apart
  from ``content``; streamed as server-sent events or not;
- ``POST /v1/completions``: raw text continued (no template);
- ``GET /v1/models``, ``GET /health``.

The API key, when the server has one, is required on every /v1 route (``Authorization:
Bearer KEY``), compared in constant time and never written anywhere. Errors are OpenAI error
objects; nothing a client sees carries a stack trace.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from k3chat.conversation import DEFAULT_MAX_TOKENS
from k3chat.template import TemplateError, encode, render
from k3chat.tokenizer import Tokenizer

from .protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Generation,
    bad_request,
    context_overflow,
    parse_chat,
    parse_completion,
    parse_json_object,
    request_id,
)
from .worker import EngineWorker, Failed, Job, JobEvent, Outcome, Text

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # a conversation far beyond any context, still bounded
DISCONNECT_POLL_SECONDS = 0.25


@dataclass
class Service:
    """What the routes share: the engine thread and what describes the model."""

    worker: EngineWorker
    tokenizer: Tokenizer
    model_id: str
    context: int
    api_key: bytes | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    plan_bytes: int | None = None  # the memory plan's total, None when run without a plan

    def memory(self) -> dict[str, int | None]:
        """What /health tells an operator about memory: the process's peak against the plan."""
        stats = self.worker.model.stats()
        return {"peak_rss_bytes": stats.get("peak_rss_bytes"), "plan_bytes": self.plan_bytes,
                "expert_slots": stats.get("expert_slots"), "cache_evictions": stats.get("cache_evictions")}

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key)
        if not ok:
            raise ApiError(401, "missing or wrong API key: send the server's key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# --------------------------------------------------------------------------- requests to jobs


async def _json_body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(declared)} bytes; at most {MAX_BODY_BYTES} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes; send a shorter conversation")
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def _chat_prompt(req: ChatRequest, tokenizer: Tokenizer) -> list[int]:
    try:
        segments = render(req.messages, thinking=req.thinking, effort=req.effort, add_generation_prompt=True)
    except TemplateError as exc:
        raise bad_request(f"the messages cannot be rendered: {exc}", "messages") from None
    return encode(segments, tokenizer)


def _completion_budget(prompt: list[int], asked: int | None, default: int, context: int) -> int:
    """max_tokens checked against the context: the prompt plus the answer must fit. Without
    max_tokens, the default, shortened to what fits."""
    if asked is not None:
        if len(prompt) + asked > context:
            raise context_overflow(len(prompt), asked, context)
        return asked
    room = context - len(prompt)
    if room < 1:
        raise context_overflow(len(prompt), 1, context)
    return min(default, room)


class _Bridge:
    """Events from the engine thread to the request's task, through its event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[JobEvent] = asyncio.Queue()

    def put(self, event: JobEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody reads this
            pass


def _job_for(service: Service, req: Generation, prompt: list[int], max_tokens: int, bridge: _Bridge) -> Job:
    if isinstance(req, ChatRequest):
        return Job(prompt=prompt, sampler=req.sampler, max_tokens=max_tokens, emit=bridge.put, chat=True,
                   thinking=req.thinking, turn=req.turn, stop=req.stop)
    return Job(prompt=prompt, sampler=req.sampler, max_tokens=max_tokens, emit=bridge.put, chat=False,
               thinking=False, turn=1, stop=req.stop)


# --------------------------------------------------------------------------- response bodies


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens}}


def _chat_body(rid: str, created: int, model: str, outcome: Outcome) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content}
    if outcome.reasoning is not None:
        message["reasoning_content"] = outcome.reasoning
        message["reasoning"] = outcome.reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": outcome.finish_reason,
                         "logprobs": None}],
            "usage": _usage(outcome)}


def _completion_body(rid: str, created: int, model: str, outcome: Outcome) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": outcome.content, "finish_reason": outcome.finish_reason,
                         "logprobs": None}],
            "usage": _usage(outcome)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _ChatChunks:
    def __init__(self, rid: str, created: int, model: str) -> None:
        self.head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def choice(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def first(self) -> dict[str, Any]:
        return self.choice({"role": "assistant", "content": ""})

    def text(self, event: Text) -> dict[str, Any]:
        if event.channel == "reasoning":
            return self.choice({"reasoning_content": event.text, "reasoning": event.text})
        return self.choice({"content": event.text})

    def last(self, outcome: Outcome) -> dict[str, Any]:
        return self.choice({}, outcome.finish_reason)

    def usage(self, outcome: Outcome) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": _usage(outcome)}


class _CompletionChunks(_ChatChunks):
    def __init__(self, rid: str, created: int, model: str) -> None:
        self.head = {"id": rid, "object": "text_completion", "created": created, "model": model}

    def choice(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self.head, "choices": [{"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                                          "logprobs": None}]}

    def first(self) -> dict[str, Any] | None:  # type: ignore[override]
        return None


# --------------------------------------------------------------------------- answering


async def _outcome(request: Request, job: Job, bridge: _Bridge) -> Outcome:
    """Wait for the job's end; a client that disconnects cancels it."""
    while True:
        try:
            event = await asyncio.wait_for(bridge.queue.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ApiError(499, "the client closed the connection") from None
            continue
        if isinstance(event, Outcome):
            return event
        if isinstance(event, Failed):
            raise event.error


async def _stream(job: Job, bridge: _Bridge, chunks: _ChatChunks, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events until the job ends; if the client goes away (this generator is
    cancelled), the job is cancelled after the step in flight."""
    finished = False
    try:
        first = chunks.first()
        if first is not None:
            yield _sse(first)
        while True:
            event = await bridge.queue.get()
            if isinstance(event, Text):
                yield _sse(chunks.text(event))
            elif isinstance(event, Outcome):
                finished = True
                yield _sse(chunks.last(event))
                if include_usage:
                    yield _sse(chunks.usage(event))
                break
            else:
                finished = True
                yield _sse(event.error.body())  # the openai client raises on an "error" event
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            job.cancel()


async def _generate(request: Request, service: Service, req: Generation, prompt: list[int], max_tokens: int,
                    rid: str, chunks: _ChatChunks,
                    body: Callable[[str, int, str, Outcome], dict[str, Any]]) -> Response:
    bridge = _Bridge()
    job = _job_for(service, req, prompt, max_tokens, bridge)
    service.worker.submit(job)  # 503 here when the queue is full
    if req.stream:
        return StreamingResponse(_stream(job, bridge, chunks, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outcome = await _outcome(request, job, bridge)
    return JSONResponse(body(rid, int(time.time()), service.model_id, outcome))


def routes(service: Service) -> list[Route]:
    async def chat_completions(request: Request) -> Response:
        service.authorize(request)
        req = parse_chat(await _json_body(request), service.model_id)
        prompt = await run_in_threadpool(_chat_prompt, req, service.tokenizer)
        max_tokens = _completion_budget(prompt, req.max_tokens, DEFAULT_MAX_TOKENS, service.context)
        rid = request_id("chatcmpl")
        return await _generate(request, service, req, prompt, max_tokens, rid,
                               _ChatChunks(rid, int(time.time()), service.model_id), _chat_body)

    async def completions(request: Request) -> Response:
        service.authorize(request)
        req: CompletionRequest = parse_completion(await _json_body(request), service.model_id)
        prompt = await run_in_threadpool(service.tokenizer.encode_text, req.prompt)
        max_tokens = _completion_budget(prompt, req.max_tokens, DEFAULT_COMPLETION_TOKENS, service.context)
        rid = request_id("cmpl")
        return await _generate(request, service, req, prompt, max_tokens, rid,
                               _CompletionChunks(rid, int(time.time()), service.model_id), _completion_body)

    async def models(request: Request) -> Response:
        service.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "k3chat",
             "max_model_len": service.context}]})

    async def health(request: Request) -> Response:
        if service.worker.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        worker = service.worker
        return JSONResponse({"status": "ok", "model": service.model_id, "busy": worker.busy,
                             "waiting": worker.waiting, "served": worker.served, "cancelled": worker.cancelled,
                             "saved_states": len(worker.pool), "saved_state_bytes": worker.pool.bytes,
                             "memory": service.memory()})

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"])]


# --------------------------------------------------------------------------- errors


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}; this server has /v1/chat/completions, " \
                  "/v1/completions, /v1/models and /health"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    error = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    error = ApiError(500, "internal server error (the server's log says more)", type="server_error")
    return JSONResponse(error.body(), status_code=500)


def create_app(service: Service) -> Starlette:
    return Starlette(routes=routes(service),
                     exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                         Exception: _internal_error})


__all__ = ["Service", "create_app", "MAX_BODY_BYTES"]

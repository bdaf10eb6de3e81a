"""Request bodies of the OpenAI chat completions and completions APIs, checked field by field.

Every refusal is an ``ApiError``: an HTTP status and the OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``) that clients already parse. Messages
say what is wrong and what to send instead; none quotes the API key or a stack trace.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3chat.sampler import MASK64, SamplerError, SamplerSettings
from k3chat.template import EFFORTS

MAX_STOP_STRINGS = 4  # OpenAI's limit
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the server refuses, with the status and OpenAI error fields to send."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def context_overflow(prompt_tokens: int, max_tokens: int, context: int) -> ApiError:
    return ApiError(400, f"this request needs {prompt_tokens} prompt tokens + {max_tokens} completion tokens "
                         f"= {prompt_tokens + max_tokens}, more than the server's context of {context} positions; "
                         "send a shorter conversation or a smaller max_tokens",
                    param="messages", code="context_length_exceeded")


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(doc, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(doc).__name__}")
    return doc


# --------------------------------------------------------------------------- what a request asks


@dataclass
class Generation:
    """What the engine is asked to do, the parts common to both endpoints."""

    sampler: SamplerSettings
    max_tokens: int | None  # None: as many as fit (chat), or the endpoint default
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest(Generation):
    messages: list[dict[str, Any]] = field(default_factory=list)
    thinking: bool = True
    effort: str | None = "max"

    @property
    def turn(self) -> int:
        """The sampler's turn number, as Conversation counts it: the same seed and messages
        give the same answer here as in `k3chat run` (spec 4)."""
        return sum(1 for m in self.messages if m.get("role") == "assistant") + 1


@dataclass
class CompletionRequest(Generation):
    prompt: str = ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_model(doc: Mapping[str, Any], served: str) -> None:
    """The one model this server holds; a missing name means it."""
    name = doc.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise bad_request("model must be a string", "model")
    if name != served:
        raise ApiError(404, f"the model {name!r} does not exist here; this server serves {served!r} "
                            "(GET /v1/models lists it)", param="model", code="model_not_found")


def _refuse_unsupported(doc: Mapping[str, Any]) -> None:
    """Fields that would change the answer and that we cannot honour are refused, not ignored."""
    n = doc.get("n")
    if n is not None and n != 1:
        raise bad_request(f"n={n!r}: this server returns one choice per request; send n=1 or leave it out", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        value = doc.get(name)
        if value is not None and value != 0:
            raise bad_request(f"{name} is not supported (the sampler has none); leave it out or send 0", name)
    if doc.get("tools"):
        raise bad_request("tools are not supported by this server yet; send the request without tools", "tools")
    if doc.get("logprobs") not in (None, False, 0):
        raise bad_request("logprobs are not supported by this server; leave logprobs out", "logprobs")
    fmt = doc.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise bad_request("response_format other than text is not supported; leave it out", "response_format")


def _sampler(doc: Mapping[str, Any]) -> SamplerSettings:
    """temperature 0 (or none of the four fields) is greedy, as our CLI is by default;
    temperature, top_p, top_k or seed otherwise imply sampling (the peer rule)."""
    temperature, top_p, top_k, seed = (doc.get(k) for k in ("temperature", "top_p", "top_k", "seed"))
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise bad_request(f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}", "temperature")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise bad_request(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad_request(f"top_k must be an integer >= 0 (0 or -1: off), got {top_k!r}", "top_k")
    if seed is not None and (not _is_int(seed) or not -(1 << 63) <= seed <= MASK64):
        raise bad_request(f"seed must be an integer that fits in 64 bits, got {seed!r}", "seed")
    if temperature == 0:
        return SamplerSettings()
    if all(v is None for v in (temperature, top_p, top_k, seed)):
        return SamplerSettings()
    try:
        return SamplerSettings.from_options(
            temperature=None if temperature is None else float(temperature),
            top_p=None if top_p is None else float(top_p),
            top_k=None if top_k is None else max(int(top_k), 0),
            seed=None if seed is None else int(seed) & MASK64,  # negative seeds: two's complement
        )
    except SamplerError as exc:
        raise bad_request(str(exc)) from None


def _max_tokens(doc: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = doc.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise bad_request(f"{name} must be an integer >= 1, got {value!r}", name)
        return int(value)
    return None


def _stop(doc: Mapping[str, Any]) -> list[str]:
    value = doc.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if any(s == "" for s in items):
        raise bad_request("stop strings must not be empty", "stop")
    return list(items)


def _stream(doc: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = bool(options.get("include_usage")) if options else False
    return stream, include_usage


# --------------------------------------------------------------------------- chat messages


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad_request(f"{where}.content: only text parts are supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")


def _message(raw: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(raw, Mapping):
        raise bad_request(f"{where} must be an object with role and content", "messages")
    role = raw.get("role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    msg: dict[str, Any] = {"role": role, "content": _text_of(raw.get("content"), where)}
    if role == "assistant":
        # vLLM's field name, and the newer `reasoning`: what the model thought, if resent.
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise bad_request(f"{where}.reasoning_content must be a string", "messages")
            msg["reasoning_content"] = reasoning
        if raw.get("tool_calls"):
            raise bad_request(f"{where}: tool calls are not supported by this server yet", "messages")
    if role == "tool":
        raise bad_request(f"{where}: tool results are not supported by this server yet", "messages")
    return msg


def _messages(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    raw = doc.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    if messages[-1]["role"] == "assistant":
        raise bad_request("the last message is the assistant's; end with a user message to get an answer "
                          "(continuing a partial answer is not supported)", "messages")
    return messages


_EFFORT_NAMES = ", ".join(("none",) + EFFORTS)


def _thinking(doc: Mapping[str, Any]) -> tuple[bool, str | None]:
    """Thinking on (effort max) unless chat_template_kwargs or reasoning_effort say otherwise.
    `chat_template_kwargs` takes `thinking` (vLLM's Kimi and DeepSeek templates) or
    `enable_thinking` (Qwen's), and `thinking_effort`; `reasoning_effort` is OpenAI's field."""
    kwargs = doc.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    thinking = True
    for name in ("thinking", "enable_thinking"):
        if name in kwargs:
            if not isinstance(kwargs[name], bool):
                raise bad_request(f"chat_template_kwargs.{name} must be true or false", "chat_template_kwargs")
            thinking = kwargs[name]
    effort = doc.get("reasoning_effort", kwargs.get("thinking_effort"))
    if effort is None:
        return thinking, "max" if thinking else None
    if effort == "none":
        return False, None
    if effort not in EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {_EFFORT_NAMES} (K3 has no {effort!r}), got {effort!r}",
                          "reasoning_effort")
    if not thinking:
        raise bad_request(f"reasoning_effort={effort!r} asks for thinking, which chat_template_kwargs turns off; "
                          "send one or the other", "reasoning_effort")
    return True, effort


def parse_chat(doc: Mapping[str, Any], served: str) -> ChatRequest:
    check_model(doc, served)
    _refuse_unsupported(doc)
    messages = _messages(doc)
    thinking, effort = _thinking(doc)
    stream, include_usage = _stream(doc)
    return ChatRequest(sampler=_sampler(doc), max_tokens=_max_tokens(doc), stop=_stop(doc), stream=stream,
                       include_usage=include_usage, messages=messages, thinking=thinking, effort=effort)


def parse_completion(doc: Mapping[str, Any], served: str) -> CompletionRequest:
    check_model(doc, served)
    _refuse_unsupported(doc)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or prompt == "":
        raise bad_request("prompt must be a non-empty string (one prompt per request)", "prompt")
    if doc.get("echo"):
        raise bad_request("echo is not supported; leave it out", "echo")
    if doc.get("suffix"):
        raise bad_request("suffix is not supported; leave it out", "suffix")
    stream, include_usage = _stream(doc)
    return CompletionRequest(sampler=_sampler(doc), max_tokens=_max_tokens(doc), stop=_stop(doc), stream=stream,
                             include_usage=include_usage, prompt=prompt)


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Generation", "bad_request", "context_overflow",
           "parse_chat", "parse_completion", "parse_json_object", "check_model", "request_id",
           "DEFAULT_COMPLETION_TOKENS"]

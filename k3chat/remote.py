"""The remote backend (design 6): a turn answered by an OpenAI-compatible server the user
names (vLLM or SGLang on their own cluster, or our own `k3chat serve`), beside Conversation.

RemoteConversation has Conversation's public surface (send, respond, regenerate, edit_last,
cancel, abort, records, ...), emits the same events (k3chat/events.py) and stores the same
records, so chat_cli's printer and the app consume it unchanged. The server does its own
templating: we send the messages (past reasoning included, as `reasoning_content`, so a server
whose template keeps it can reuse its prefix) and map `reasoning_content` / `reasoning` deltas
to reasoning events.

Privacy rules kept here: only the named host is contacted (no proxy from the environment, no
redirects followed), TLS is verified by default, and the API key goes into one request header,
never into a record, a message or a log line. This module is imported only with --remote or a
configured `remote`, so a local run opens no socket.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from k3chat.attachments import Attachment, model_message
from k3chat.conversation import ConversationError, TurnFailed, TurnResult, assistant_record, user_record
from k3chat.events import AnswerToken, EventHandler, Notice, PhaseChanged, Prefill, ReasoningToken, Stats, TurnDone, ignore
from k3chat.history import HistoryStore
from k3chat.runtime import EXIT_RUNTIME, EXIT_USAGE
from k3chat.sampler import SamplerSettings

log = logging.getLogger(__name__)

API_KEY_ENV = "K3CHAT_API_KEY"
CONNECT_TIMEOUT = 10.0  # seconds to reach the server
READ_TIMEOUT = 600.0  # between two stream events: a cluster under load may queue a request
STATS_EVERY = 8  # deltas between two Stats events, as Conversation's default


class RemoteError(Exception):
    """The server could not be used: the message says what happened and what to do."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status


class RemoteRefused(ConversationError):
    """The server refused or could not be reached before the turn started: nothing was saved."""


# --------------------------------------------------------------------------- the endpoint


def normalise_url(url: str) -> str:
    """The API base (".../v1") from what the user typed, or ValueError with the reason."""
    text = url.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} is not an http:// or https:// address (e.g. https://k3.example:8000)")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host name")
    if parts.username or parts.password:
        raise ValueError("the address must not carry a user or password; give the key with --api-key-file or "
                         f"{API_KEY_ENV}")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a query or fragment; give the server's base address")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"  # servers put the OpenAI API under /v1
    return f"{parts.scheme}://{parts.netloc}{path}"


def read_api_key(path: str | Path | None, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key-file (first line), else K3CHAT_API_KEY, else None."""
    if path is not None:
        target = Path(path).expanduser()
        try:
            text = target.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RemoteError(f"--api-key-file {path}: no such file", EXIT_USAGE) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RemoteError(f"--api-key-file {path}: cannot be read ({exc})", EXIT_USAGE) from None
        key = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise RemoteError(f"--api-key-file {path} is empty; put the key on its first line", EXIT_USAGE)
        return key
    key = environ.get(API_KEY_ENV, "").strip()
    return key or None


@dataclass(frozen=True)
class Endpoint:
    """Where the model is; ``api_key`` is kept out of repr so it never reaches a log."""

    url: str  # normalised, ending in /v1
    model: str | None = None  # None: the server's first (usually only) model
    api_key: str | None = field(default=None, repr=False)
    ca_file: Path | None = None  # a private CA's certificate(s) instead of the system's trust store

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc

    def describe(self, model: str | None = None) -> str:
        """For the user: which model, where (never the key)."""
        return f"remote model {model or self.model or '(the server default)'} at {self.url}"


# --------------------------------------------------------------------------- the client


def _server_message(response: Any) -> str:
    """The server's own error text (OpenAI-style JSON), else the start of its body."""
    try:
        doc = json.loads(response.read() or b"{}")
    except (ValueError, UnicodeDecodeError):
        return response.text[:200].strip() if hasattr(response, "text") else ""
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or "")
    if isinstance(error, str):
        return error
    return str(doc.get("message") or doc.get("detail") or "") if isinstance(doc, dict) else ""


def _status_error(status: int, detail: str, endpoint: Endpoint) -> RemoteError:
    said = f": {detail}" if detail else ""
    if status == 401 or status == 403:
        hint = f"check the key (--api-key-file or {API_KEY_ENV})"
        return RemoteError(f"the server at {endpoint.host} refused the API key (HTTP {status}){said}; {hint}",
                           status=status)
    if status == 404:
        return RemoteError(f"the server at {endpoint.host} answered HTTP 404{said}; check --remote (the address "
                           "of an OpenAI-compatible server) and --model", status=status)
    return RemoteError(f"the server at {endpoint.host} answered HTTP {status}{said}", status=status)


def _tls_context(ca_file: Path | None) -> Any:
    """Certificates and host names always verified; by a private CA when one is given."""
    import ssl

    if ca_file is None:
        return True  # the client's default: verified against the system's trust store
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise RemoteError(f"--remote-ca-file {ca_file}: not a readable PEM certificate file ({exc})",
                          EXIT_USAGE) from None


class RemoteClient:
    """Chat completions over HTTP(S) to one host. ``transport`` is for tests (recorded streams)."""

    def __init__(self, endpoint: Endpoint, *, transport: Any = None) -> None:
        import httpx2  # the maintained successor of httpx; imported only for a remote backend

        self.endpoint = endpoint
        self._httpx = httpx2
        headers = {"Accept": "application/json"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        # trust_env=False: no proxy or netrc from the environment, so only this host is contacted.
        self._client = httpx2.Client(
            base_url=endpoint.url + "/", headers=headers, verify=_tls_context(endpoint.ca_file), trust_env=False,
            follow_redirects=False, transport=transport,
            timeout=httpx2.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT))

    def close(self) -> None:
        self._client.close()

    def _unreachable(self, exc: Exception) -> RemoteError:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc):
            trusted = f"the CA in {self.endpoint.ca_file}" if self.endpoint.ca_file else "the system's trust store"
            return RemoteError(f"the TLS certificate of {self.endpoint.host} could not be verified against {trusted} "
                               f"({exc}); for a private CA give its certificate with --remote-ca-file (or "
                               "`remote_ca_file` in config.toml)")
        return RemoteError(f"cannot reach the server at {self.endpoint.url} ({type(exc).__name__}: {exc}); is it "
                           "running, and is the address right?")

    def models(self) -> list[str]:
        """GET /models: the ids the server serves."""
        try:
            response = self._client.get("models")
        except self._httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code != 200:
            raise _status_error(response.status_code, _server_message(response), self.endpoint)
        try:
            data = response.json().get("data") or []
            return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError, TypeError):
            raise RemoteError(f"the server at {self.endpoint.host} sent a model list that is not OpenAI's "
                              "format; is it an OpenAI-compatible server?") from None

    def open_stream(self, payload: Mapping[str, Any]) -> Any:
        """POST /chat/completions and wait for the status; an error status is a RemoteError."""
        try:
            request = self._client.build_request("POST", "chat/completions", json=dict(payload),
                                                 headers={"Accept": "text/event-stream"})
            response = self._client.send(request, stream=True)
        except self._httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code != 200:
            try:
                detail = _server_message(response)
            finally:
                response.close()
            raise _status_error(response.status_code, detail, self.endpoint)
        return response

    def events(self, response: Any) -> Iterator[dict[str, Any]]:
        """The JSON objects of an SSE stream, until [DONE]; a cut or garbled stream raises."""
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    doc = json.loads(data)
                except ValueError:
                    raise RemoteError(f"the server at {self.endpoint.host} sent an event that is not JSON: "
                                      f"{data[:80]!r}") from None
                if isinstance(doc, dict) and doc.get("error"):
                    error = doc["error"]
                    text = error.get("message") if isinstance(error, dict) else str(error)
                    raise RemoteError(f"the server at {self.endpoint.host} stopped with an error: {text}")
                if isinstance(doc, dict):
                    yield doc
        except self._httpx.HTTPError as exc:
            raise RemoteError(f"the connection to {self.endpoint.host} broke during the answer "
                              f"({type(exc).__name__}: {exc})") from None
        raise RemoteError(f"the stream from {self.endpoint.host} ended before the answer was finished "
                          "(no [DONE]); the server or the network cut it")


def resolve_model(client: RemoteClient) -> str:
    """The model to ask for: --model, else the one the server lists first."""
    if client.endpoint.model:
        return client.endpoint.model
    names = client.models()
    if not names:
        raise RemoteError(f"the server at {client.endpoint.host} lists no model; give one with --model")
    return names[0]


# --------------------------------------------------------------------------- one turn


def _message(record: Mapping[str, Any]) -> dict[str, Any]:
    # A user record's attachments go to the server rendered into its text, as the local model reads them.
    msg: dict[str, Any] = {"role": record["role"], "content": model_message(record).get("content", "")}
    reasoning = record.get("reasoning_content")
    if record["role"] == "assistant" and reasoning:
        msg["reasoning_content"] = reasoning  # vLLM's field name; a template that keeps it reuses the prefix
    return msg


def chat_payload(records: Sequence[Mapping[str, Any]], model: str, *, thinking: bool, effort: str | None,
                 sampler: SamplerSettings, max_tokens: int) -> dict[str, Any]:
    """The request body. Effort goes in chat_template_kwargs (vLLM passes them to the template
    and refuses a `reasoning_effort` outside OpenAI's names, such as K3's "max")."""
    kwargs: dict[str, Any] = {"thinking": thinking}
    if thinking and effort:
        kwargs["thinking_effort"] = effort
    payload: dict[str, Any] = {
        "model": model, "messages": [_message(r) for r in records], "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "chat_template_kwargs": kwargs,
    }
    if sampler.greedy:
        payload["temperature"] = 0  # greedy, as the local default
    else:
        payload.update(temperature=sampler.temperature, top_p=sampler.top_p, seed=sampler.seed)
        if sampler.top_k:
            payload["top_k"] = sampler.top_k
    return payload


@dataclass
class RemoteTurnResult(TurnResult):
    """A TurnResult whose token count comes from the server's usage (no ids are sent back)."""

    completion_tokens: int = 0

    @property
    def generated_tokens(self) -> int:  # type: ignore[override]
        return self.completion_tokens


@dataclass
class _Stream:
    """What one streamed answer has said so far."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    deltas: int = 0
    finish: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    first_at: float | None = None
    last_at: float | None = None


def _delta_texts(doc: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of one chunk; `reasoning` is the newer vLLM name."""
    choices = doc.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", "", None
    choice = choices[0]
    delta = choice.get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    content = delta.get("content") or ""
    return str(reasoning), str(content), choice.get("finish_reason")


def _shut_down(response: Any) -> None:
    """End a stream another thread is blocked reading: closing the response alone does not
    wake a read in flight, shutting its socket down does (the reader then sees the end)."""
    import socket

    stream = response.extensions.get("network_stream") if hasattr(response, "extensions") else None
    sock = stream.get_extra_info("socket") if stream is not None else None
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        else:
            response.close()
    except Exception:  # already closed, or closing from another thread: the reader sees the end either way
        pass


class RemoteConversation:
    """One session's conversation with a remote model; Conversation's surface, no engine.

    Not thread-safe, except ``cancel()``/``abort()``: the stream is closed after the event in
    flight, which tells the server to stop (it sees the client go away)."""

    state_files = False

    def __init__(self, client: RemoteClient, model: str, store: HistoryStore, session_id: str, *,
                 thinking: bool = True, effort: str | None = "max", sampler: SamplerSettings | None = None,
                 max_tokens: int = 4096, clock: Callable[[], float] = time.perf_counter,
                 speculative: int = 0) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if speculative:
            raise ValueError("speculative decoding runs where the model runs: the remote server decodes on its own "
                             "(on that machine: k3chat serve --speculative N); use speculative 0 here")
        self.client = client
        self.model_name = model
        self.store = store
        self.session_id = session_id
        self.thinking = thinking
        self.effort = effort
        self.sampler = sampler or SamplerSettings()
        self.max_tokens = max_tokens
        self.context: int | None = None  # the server's: not known here
        self.grammar = None  # the server templates and parses
        self._clock = clock
        loaded = store.load(session_id)
        self._records: list[dict[str, Any]] = list(loaded.records)
        self.load_problems: list[str] = list(loaded.problems)
        self.session_settings: dict[str, Any] = dict(getattr(loaded, "settings", {}))
        self._cancel = threading.Event()
        self._aborted = threading.Event()
        self._response: Any = None  # the stream in flight, closed by abort()
        self._last_prompt_tokens = 0

    # ------------------------------------------------------------------ Conversation's surface

    @property
    def records(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._records]

    @property
    def pending_user(self) -> bool:
        return bool(self._records) and self._records[-1].get("role") == "user"

    @property
    def context_used(self) -> int:
        return self._last_prompt_tokens

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def abort(self) -> None:
        """Stop now (a second Ctrl-C): close the stream in flight, even if the server is silent."""
        self._aborted.set()
        self._cancel.set()
        response = self._response
        if response is not None:
            _shut_down(response)

    def prompt_ids(self, text: str | None = None) -> list[int]:
        raise ConversationError("the prompt is tokenized by the remote server")

    def save_state_now(self) -> str | None:
        return None  # the server holds the state; the history is all we keep

    def close(self) -> None:
        pass  # the client belongs to whoever opened it

    def send(self, text: str, *, system: str | None = None, attachments: Sequence[Attachment] = (),
             on_event: EventHandler = ignore) -> TurnResult | None:
        if text == "" and not attachments:
            return None
        if self.pending_user:
            self.store.check_idle(self.session_id)
            raise ConversationError("the last message has no answer yet: respond to it, or edit it")
        new: list[dict[str, Any]] = []
        if system is not None:
            if self._records:
                raise ConversationError("a system message can only start a conversation")
            new.append({"role": "system", "content": system})
        new.append(user_record(text, attachments))

        def commit() -> None:
            for record in new:
                self._append(record)

        return self._turn(self._records + new, commit, on_event)

    def respond(self, *, on_event: EventHandler = ignore) -> TurnResult:
        if not self.pending_user:
            raise ConversationError("there is no unanswered message")
        return self._turn(list(self._records), lambda: None, on_event)

    def regenerate(self, *, on_event: EventHandler = ignore) -> TurnResult:
        if not self._records or self._records[-1].get("role") != "assistant":
            raise ConversationError("there is no answer to regenerate")
        keep = len(self._records) - 1
        return self._turn(self._records[:keep], lambda: self._truncate(keep), on_event)

    def edit_last(self, text: str, *, on_event: EventHandler = ignore) -> TurnResult | None:
        if text == "":
            return None
        last_user = max((i for i, r in enumerate(self._records) if r.get("role") == "user"), default=None)
        if last_user is None:
            raise ConversationError("there is no message to edit")
        edited: dict[str, Any] = {"role": "user", "content": text}
        if self._records[last_user].get("attachments"):  # its files stay with it, as Conversation.edit_last
            edited["attachments"] = self._records[last_user]["attachments"]
        records = self._records[:last_user] + [edited]

        def commit() -> None:
            self._truncate(last_user)
            self._append(dict(edited))

        return self._turn(records, commit, on_event)

    # ------------------------------------------------------------------ history

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        stored = self.store.append(self.session_id, record)
        self._records.append(stored)
        return stored

    def _truncate(self, keep: int) -> None:
        self._records = list(self.store.truncate(self.session_id, keep).records)

    # ------------------------------------------------------------------ one turn

    def _turn(self, records: list[dict[str, Any]], commit: Callable[[], None], on_event: EventHandler) -> TurnResult:
        with self.store.answering(self.session_id):
            try:
                return self._answer(records, commit, on_event)
            finally:
                self._cancel.clear()
                self._aborted.clear()

    def _answer(self, records: list[dict[str, Any]], commit: Callable[[], None], on_event: EventHandler) -> TurnResult:
        turn = sum(1 for r in self._records if r.get("role") == "assistant") + 1
        thinking, effort, settings = self.thinking, self.effort, self.sampler
        payload = chat_payload(records, self.model_name, thinking=thinking, effort=effort, sampler=settings,
                               max_tokens=self.max_tokens)
        started = self._clock()
        on_event(PhaseChanged("prefill"))
        try:
            response = self.client.open_stream(payload)
        except RemoteError as exc:
            raise RemoteRefused(f"{exc.message}; nothing was saved") from exc
        # The server took the request: the user record is durable before the answer arrives.
        stream = _Stream()
        try:
            commit()
        except BaseException:
            response.close()
            raise
        self._response = response
        try:
            result = self._read_or_stop(response, stream, on_event, thinking)
        except RemoteError as exc:
            raise self._failed(turn, thinking, effort, settings, stream, started, exc, on_event) from exc
        except BaseException:
            self._save_quietly(turn, thinking, effort, settings, stream, started)
            raise
        finally:
            self._response = None
            response.close()  # on cancel, the server sees the client go away and stops
        stop, message = result
        return self._finish(turn, thinking, effort, settings, stream, started, stop, message, on_event)

    def _read_or_stop(self, response: Any, stream: _Stream, emit: EventHandler,
                      thinking: bool) -> tuple[str, str | None]:
        """_read, where whatever a stream closed by abort() raises means "stopped on request"."""
        stopped = "stopped on request; what the model said so far was kept, marked interrupted"
        try:
            return self._read(response, stream, emit, thinking)
        except Exception:
            if self._aborted.is_set():
                return "cancelled", stopped
            raise

    def _read(self, response: Any, stream: _Stream, emit: EventHandler, thinking: bool) -> tuple[str, str | None]:
        phase = ""
        for doc in self.client.events(response):
            if isinstance(doc.get("usage"), dict):
                stream.usage = doc["usage"]
            reasoning, content, finish = _delta_texts(doc)
            for channel, text in (("reasoning", reasoning), ("answer", content)):
                if not text:
                    continue
                if phase != channel:
                    if not phase and stream.first_at is None:
                        stream.first_at = self._clock()
                    phase = channel
                    emit(PhaseChanged(channel))  # type: ignore[arg-type]
                stream.deltas += 1
                stream.last_at = self._clock()
                (stream.reasoning if channel == "reasoning" else stream.content).append(text)
                emit(ReasoningToken(text) if channel == "reasoning" else AnswerToken(text))
            if finish:
                stream.finish = str(finish)
            if self._cancel.is_set():
                return "cancelled", "stopped on request; what the model said so far was kept, marked interrupted"
        if stream.finish == "length":
            return "limit", ("stopped at the token limit before the model finished its answer; what it said was "
                             "kept, marked interrupted")
        if stream.finish in ("stop", "eos", "end_turn"):
            return "end", None
        raise RemoteError(f"the stream from {self.client.endpoint.host} ended without a finish reason; the answer "
                          "may be incomplete")

    # ------------------------------------------------------------------ ending a turn

    def _counts(self, stream: _Stream) -> tuple[int, int, int]:
        """(prompt, cached, completion) tokens: the server's usage, else what was seen."""
        usage = stream.usage
        prompt = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        completion = int(usage.get("completion_tokens") or stream.deltas)
        return prompt, min(cached, prompt), completion

    def _record(self, thinking: bool, effort: str | None, settings: SamplerSettings, stream: _Stream,
                started: float, stop: str) -> dict[str, Any]:
        prompt, cached, completion = self._counts(stream)
        rec = assistant_record(content="".join(stream.content), reasoning="".join(stream.reasoning) if thinking else None,
                               stop=stop, model=self.model_name, effort=effort, sampler=settings,
                               prompt=prompt, reused=cached, generated=completion)
        rec["remote"] = self.client.endpoint.url  # where it was answered (no key: it is never stored)
        prefill_s, decode_s = self._seconds(stream, started)
        speed: dict[str, float] = {}
        if decode_s > 0 and completion > 1:
            speed["decode_tokens_per_second"] = round((completion - 1) / decode_s, 3)
        if stream.first_at is not None:  # as the local backend: first text, and the whole turn, seen from here
            speed["first_token_seconds"] = round(prefill_s, 3)
            speed["turn_seconds"] = round(prefill_s + decode_s, 3)
        if speed:
            rec["speed"] = speed
        return rec

    def _seconds(self, stream: _Stream, started: float) -> tuple[float, float]:
        """(until the first text, from it to the last): the server's prefill and decode, seen from here."""
        if stream.first_at is None:
            return self._clock() - started, 0.0
        return stream.first_at - started, max(0.0, (stream.last_at or stream.first_at) - stream.first_at)

    def _result(self, turn: int, settings: SamplerSettings, stream: _Stream, started: float, record: dict[str, Any],
                stop: str, message: str | None, saved: bool) -> RemoteTurnResult:
        prompt, cached, completion = self._counts(stream)
        prefill_s, decode_s = self._seconds(stream, started)
        self._last_prompt_tokens = prompt + completion
        return RemoteTurnResult(
            session_id=self.session_id, turn=turn, record=record,
            reasoning=record.get("reasoning_content") if record.get("thinking") else None,
            answer=record.get("content", ""), interrupted=bool(record.get("interrupted")), stop=stop, message=message,
            prompt_tokens=prompt, reused_tokens=cached, prefilled_tokens=prompt - cached,
            reuse_source="server_cache" if cached else None, reuse_note=None, generated_ids=[],
            prefill_seconds=prefill_s, decode_seconds=decode_s, seed=None if settings.greedy else settings.seed,
            greedy=settings.greedy, saved=saved, completion_tokens=completion)

    def _emit_end_stats(self, result: TurnResult, emit: EventHandler) -> None:
        if result.prompt_tokens:  # the server's usage; without it there is nothing true to say
            emit(Prefill(result.prompt_tokens, result.reused_tokens, result.prefilled_tokens, result.reuse_source))
        emit(Stats(prompt_tokens=result.prompt_tokens, reused_tokens=result.reused_tokens,
                   prefilled_tokens=result.prefilled_tokens, generated_tokens=result.generated_tokens,
                   prefill_seconds=result.prefill_seconds, decode_seconds=result.decode_seconds,
                   context_used=self._last_prompt_tokens, context_limit=0))

    def _finish(self, turn: int, thinking: bool, effort: str | None, settings: SamplerSettings, stream: _Stream,
                started: float, stop: str, message: str | None, emit: EventHandler) -> TurnResult:
        record = self._record(thinking, effort, settings, stream, started, stop)
        stored = self._append(record)
        result = self._result(turn, settings, stream, started, stored, stop, message, saved=True)
        if message:
            emit(Notice(stop, message))
        self._emit_end_stats(result, emit)
        emit(PhaseChanged("done"))
        emit(TurnDone(result))
        return result

    def _failed(self, turn: int, thinking: bool, effort: str | None, settings: SamplerSettings, stream: _Stream,
                started: float, exc: RemoteError, emit: EventHandler) -> TurnFailed:
        record = self._record(thinking, effort, settings, stream, started, "error")
        try:
            stored, saved = self._append(record), True
        except Exception as save_exc:
            log.error("could not save the partial answer: %s", save_exc)
            stored, saved = record, False
        result = self._result(turn, settings, stream, started, stored, "error", f"the turn failed: {exc}", saved)
        emit(Notice("error", result.message or str(exc)))
        emit(PhaseChanged("done"))
        emit(TurnDone(result))
        return TurnFailed(result, exc)

    def _save_quietly(self, turn: int, thinking: bool, effort: str | None, settings: SamplerSettings,
                      stream: _Stream, started: float) -> None:
        try:
            self._append(self._record(thinking, effort, settings, stream, started, "error"))
        except Exception as exc:
            log.error("could not save the partial answer: %s", exc)


def remote_conversation_factory(client: RemoteClient, model: str) -> Callable[..., RemoteConversation]:
    """A maker with Conversation's signature (what the app calls), bound to this server and model."""

    def make(_model: Any, _tokenizer: Any, store: HistoryStore, session_id: str, *, thinking: bool = True,
             effort: str | None = "max", max_tokens: int = 4096, **_local: Any) -> RemoteConversation:
        # _local: context, model_name, state options: the local engine's, not the server's
        return RemoteConversation(client, model, store, session_id, thinking=thinking, effort=effort,
                                  max_tokens=max_tokens)

    return make


__all__ = ["remote_conversation_factory", "Endpoint", "RemoteClient", "RemoteConversation", "RemoteError", "RemoteRefused", "RemoteTurnResult",
           "normalise_url", "read_api_key", "resolve_model", "chat_payload", "API_KEY_ENV"]

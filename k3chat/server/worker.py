"""The one engine thread: a first-come, first-served queue in front of one engine session.

Requests are rendered and tokenized by the HTTP side; a ``Job`` carries the prompt ids and
the generation settings here. The thread positions the session at the longest reusable
prefix (the live state, or a state from the pool), prefills only the rest, and samples with
the chat core's sampler and stream parser, sending text events back as they arrive.

Stopping, at three levels, as everywhere in k3chat (runtime.StopPolicy):
- a client that goes away cancels its job after the step in flight (during a prefill the
  engine stops between layers: nobody waits for that answer any more);
- ``stop_after_step`` (SIGTERM): no new work, queued requests are refused with 503, the job
  in flight ends after its step and answers what it has (finish_reason "abort");
- ``abort_step`` (a second signal): the step in flight stops between two layers too.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from k3chat.engine_api import EngineModel, EngineSession, VerifyingSession
from k3chat.sampler import Sampler, SamplerError, SamplerSettings
from k3chat.speculative import Speculator
from k3chat.template import Grammar, StreamParser
from k3chat.tokenizer import Tokenizer

from .pool import StatePool, extends
from .protocol import ApiError

log = logging.getLogger(__name__)

Channel = Literal["reasoning", "content"]


# --------------------------------------------------------------------------- what a job sends back


@dataclass(frozen=True)
class Text:
    channel: Channel
    text: str


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # "stop", "length", or "abort" (the client left or the server is stopping)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    reasoning: str | None  # None when thinking was off (and for text completions)
    content: str


@dataclass(frozen=True)
class Failed:
    error: ApiError


JobEvent = Union[Text, Outcome, Failed]


@dataclass
class Job:
    prompt: list[int]
    sampler: SamplerSettings
    max_tokens: int
    emit: Callable[[JobEvent], None]  # thread-safe; called on the engine thread
    chat: bool = True  # False: a raw text completion (no template, no channels)
    thinking: bool = True
    turn: int = 1
    stop: list[str] = field(default_factory=list)
    gone: threading.Event = field(default_factory=threading.Event)  # the client disconnected
    engine_cancel: Any = None  # k3engine CancelFlag, made by the worker

    def cancel(self) -> None:
        """The client went away: stop after the step in flight (a prefill stops at once)."""
        self.gone.set()
        if self.engine_cancel is not None and not self._decoding:
            self.engine_cancel.set()

    _decoding: bool = False


class StopStrings:
    """Cuts the answer before the first stop string, holding back text that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = self._pending(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def _pending(self, buf: str) -> int:
        """The longest tail of buf that begins some stop string."""
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


# --------------------------------------------------------------------------- the engine thread


class QueueFull(ApiError):
    def __init__(self, waiting: int) -> None:
        super().__init__(503, f"the server is busy: {waiting} requests are already waiting for the engine; "
                              "retry in a moment", type="server_error", code="queue_full",
                         headers={"Retry-After": "2"})


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; this request was not started", type="server_error",
                    code="shutting_down")


class EngineWorker:
    """One thread owns the engine session; jobs run one at a time in arrival order."""

    def __init__(self, model: EngineModel, tokenizer: Tokenizer, *, context: int, pool_budget: int,
                 state_size: Callable[[int], int], queue_limit: int = 8, speculative: int = 0) -> None:
        self.model = model
        self.speculative = speculative  # drafted tokens verified per pass (0: off); answers are the same
        self.tokenizer = tokenizer
        self.grammar = Grammar(tokenizer)
        self.context = context
        self.pool = StatePool(pool_budget)
        self.state_size = state_size  # bytes of an exported state holding n positions
        self.queue_limit = queue_limit
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._current: Job | None = None
        self._stopping = False
        self._closed = False
        self.cut_short = 0  # answers ended early because the server was stopped
        self.cancelled = 0  # generations stopped because their client went away
        self.served = 0  # answers sent in full (stop or length)
        self.drafts_proposed = 0  # speculative decoding, over every answer
        self.drafts_accepted = 0
        self._session: EngineSession | None = None
        self._live: list[int] | None = None  # ids the session holds; None: unknown (tainted)
        self._thread = threading.Thread(target=self._loop, name="k3chat-engine", daemon=True)

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def submit(self, job: Job) -> None:
        """Queue a job, or raise (503) when the queue is full or the server is stopping."""
        with self._cond:
            if self._stopping or self._closed:
                raise shutting_down()
            if len(self._queue) >= self.queue_limit:
                raise QueueFull(len(self._queue))
            self._queue.append(job)
            self._cond.notify()

    def stop_after_step(self) -> None:
        """No new work; queued jobs are refused; the job in flight ends after its step."""
        with self._cond:
            self._stopping = True
            refused = list(self._queue)
            self._queue.clear()
            current = self._current
            self._cond.notify_all()
        for job in refused:
            job.emit(Failed(shutting_down()))
        if current is not None and current.engine_cancel is not None and not current._decoding:
            current.engine_cancel.set()  # a prefill would otherwise run to its end

    def abort_step(self) -> None:
        """Also stop the engine step in flight, between two layers."""
        self.stop_after_step()
        current = self._current
        if current is not None and current.engine_cancel is not None:
            current.engine_cancel.set()

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._session is not None and not self._thread.is_alive():
            self._session.close()
            self._session = None

    # ------------------------------------------------------------------ the thread

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            job = self._queue.popleft()
            self._current = job
            return job

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                if not job.gone.is_set():
                    self._run(job)
            except ApiError as exc:
                job.emit(Failed(exc))
            except Exception as exc:  # never a traceback to the client; one line in the log
                log.error("request failed: %s: %s", type(exc).__name__, exc)
                job.emit(Failed(ApiError(500, f"the engine failed: {exc}", type="server_error",
                                         code="engine_error")))
            finally:
                with self._cond:
                    self._current = None

    def _run(self, job: Job) -> None:
        from k3engine.model import CancelFlag, Cancelled, EngineError

        job.engine_cancel = CancelFlag()
        if job.gone.is_set() or self._stopping:
            job.engine_cancel.set()
        try:
            reused, logits = self._position_at(job.prompt)
            if logits is None:
                logits = self._feed(job.prompt[reused:], job.engine_cancel)
                self._keep_prompt_state(job.prompt, logits)
        except Cancelled:
            self._finish_early(job)
            job.emit(Outcome("abort", len(job.prompt), 0, 0, 0, "" if job.chat and job.thinking else None, ""))
            return
        except EngineError as exc:
            raise ApiError(500, f"the engine failed during the prefill: {exc}", type="server_error",
                           code="engine_error") from exc
        job._decoding = True
        try:
            outcome = self._decode(job, logits, reused)
        except SamplerError as exc:
            raise ApiError(500, f"the sampler failed: {exc}", type="server_error", code="engine_error") from exc
        except EngineError as exc:
            raise ApiError(500, f"the engine failed while answering: {exc}", type="server_error",
                           code="engine_error") from exc
        job.emit(outcome)

    def _finish_early(self, job: Job) -> None:
        if job.gone.is_set():
            self.cancelled += 1
        elif self._stopping:
            self.cut_short += 1

    # ------------------------------------------------------------------ engine state

    def _ensure_session(self) -> EngineSession:
        if self._session is None:
            self._session = self.model.session(self.context)
            self._live = []
        return self._session

    def _feed(self, ids: Sequence[int], cancel: Any) -> Any:
        session = self._ensure_session()
        try:
            logits = session.feed(list(ids), cancel=cancel)
        except BaseException:
            self._live = None
            raise
        assert self._live is not None
        self._live.extend(int(i) for i in ids)
        return logits

    def _live_usable(self) -> bool:
        return self._session is not None and self._live is not None and not self._session.tainted

    def _position_at(self, prompt: list[int]) -> tuple[int, Any]:
        """Bring the session to the longest reusable prefix of the prompt: (its length, the
        logits at the prompt's end when a saved state is the whole prompt, else None)."""
        session = self._ensure_session()
        live = len(self._live or []) if self._live_usable() and extends(self._live or [], prompt) else 0
        saved = self.pool.best_for(prompt)
        if saved is not None and len(saved.ids) > live:
            self._stash_live()
            try:
                session.import_state(saved.payload)
                if session.length != len(saved.ids):
                    raise ValueError(f"the engine holds {session.length} positions, the saved state "
                                     f"{len(saved.ids)}")
            except Exception as exc:  # a lost optimisation: prefill instead
                log.warning("a saved state was not usable (%s); prefilling", exc)
                self.pool.drop(saved.ids)
                self._live = None
                return self._position_at(prompt)
            self._live = list(saved.ids)
            if len(saved.ids) == len(prompt):
                return len(prompt), saved.logits.copy()
            return len(saved.ids), None
        if live:
            return live, None
        self._stash_live()
        session.reset()
        self._live = []
        return 0, None

    def _stash_live(self) -> None:
        """Before the session is repositioned, keep what it holds (another conversation's
        state, with its answer) if the pool has room for it."""
        if not self._live_usable() or not self._live or self.pool.holds(self._live):
            return
        if not self.pool.make_room(self.state_size(len(self._live))):
            return
        try:
            payload = self._ensure_session().export_state()
        except Exception as exc:
            log.warning("engine state not kept for reuse: %s", exc)
            return
        self.pool.put(self._live, payload)

    def _keep_prompt_state(self, prompt: list[int], logits: Any) -> None:
        """The state at the end of the prompt: the next turn of this conversation extends it
        whether or not the client resends the reasoning (most do not)."""
        if not self._live_usable() or self.pool.holds(prompt):
            return
        if not self.pool.make_room(self.state_size(len(prompt)) + int(logits.nbytes)):
            return
        try:
            payload = self._ensure_session().export_state()
        except Exception as exc:
            log.warning("prompt state not kept for reuse: %s", exc)
            return
        self.pool.put(prompt, payload, logits.copy())

    # ------------------------------------------------------------------ sampling

    def _speculator(self, job: Job) -> Speculator | None:
        session = self._session
        if self.speculative <= 0 or not isinstance(session, VerifyingSession) or not self._live_usable():
            return None

        def fed(ids: Sequence[int]) -> None:
            assert self._live is not None
            self._live.extend(int(i) for i in ids)

        def lost() -> None:
            self._live = None

        return Speculator(session, self._live or [], limit=self.speculative, stop_ids=self.grammar.end_ids,
                          feed=lambda ids: self._feed(ids, job.engine_cancel), fed=fed, lost=lost,
                          cancel=job.engine_cancel)

    def _should_stop(self, job: Job) -> bool:
        return job.gone.is_set() or self._stopping

    def _decode(self, job: Job, logits: Any, reused: int) -> Outcome:
        from k3engine.model import Cancelled

        sampler = Sampler(job.sampler, job.turn)
        stops = StopStrings(job.stop)
        out = _Collected(job)
        emit_text = out.emitter(stops)
        parser = StreamParser(self.grammar, job.thinking) if job.chat else None
        decoder = self.tokenizer.stream_decoder() if parser is None else None
        generated = 0
        finish = ""
        spec = self._speculator(job)
        while not finish:
            token = int(sampler.sample(logits))
            generated += 1
            if spec is not None:
                spec.sampled(token)
            if parser is not None:
                was_closed = parser.closed
                if parser.channel == "reasoning":
                    out.reasoning_tokens += 1
                for channel, text in parser.push(token):
                    if emit_text(channel, text):  # type: ignore[arg-type]
                        finish = "stop"
                        break
                ended = token in self.grammar.end_ids or parser.channel == "done"
                if ended and parser.closed and not was_closed and token not in self.grammar.end_ids:
                    # One more step samples the end id after CLOSURE, as a local turn does: the
                    # strict parse needs it, and usage then counts what history records.
                    ended = generated >= job.max_tokens
            else:
                ended = self.tokenizer.is_special(token)
                if not ended and decoder is not None and emit_text("content", decoder.push(token)):
                    finish = "stop"
            if finish:
                break
            if ended:
                finish = "stop"
            elif generated >= job.max_tokens:
                finish = "length"
            elif self._should_stop(job):
                finish = "abort"
            else:
                try:
                    if spec is not None:
                        logits = spec.next_logits(token, room=job.max_tokens - generated)
                    else:
                        logits = self._feed([token], job.engine_cancel)
                except Cancelled:
                    finish = "abort"
        if spec is not None:
            spec.settle()  # the verified positions the sampler went through; the rest is dropped
            self.drafts_proposed += spec.proposed
            self.drafts_accepted += spec.accepted
        if not out.stopped:  # the text held back for a delimiter or a stop string that never came
            tail = parser.finish() if parser is not None else [("content", decoder.flush() if decoder else "")]
            for channel, text in tail:
                if emit_text(channel, text):  # type: ignore[arg-type]
                    break
        if not out.stopped:
            out.send("content", stops.flush())
        if finish == "abort":
            self._finish_early(job)
        else:
            self.served += 1
        return Outcome(finish, len(job.prompt), reused, generated, out.reasoning_tokens,
                       out.reasoning if job.chat and job.thinking else None, out.content)


class _Collected:
    """The text sent so far, by channel (the non-streamed answer is exactly what a stream
    would have shown)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.reasoning_tokens = 0
        self.stopped = False

    def send(self, channel: Channel, text: str) -> None:
        if text:
            self.parts[channel].append(text)
            self.job.emit(Text(channel, text))

    def emitter(self, stops: StopStrings) -> Callable[[Channel, str], bool]:
        def emit(channel: Channel, text: str) -> bool:
            if self.stopped:
                return True
            if channel == "content":
                text, hit = stops.push(text)
                self.send("content", text)
                if hit:
                    self.stopped = True
                return hit
            self.send(channel, text)
            return False
        return emit

    @property
    def reasoning(self) -> str:
        return "".join(self.parts["reasoning"])

    @property
    def content(self) -> str:
        return "".join(self.parts["content"])

"""The one runtime behind every front-end (`k3chat run`, the chat app, the server).

Three things live here so that they are written once and mean the same everywhere:

- **Opening** a model directory and its tokenizer under a memory budget (``open_model``),
  with every way that can fail mapped to one error type;
- **Failure**: an error whose message is for the user and which carries its exit code
  (``k3engine.exit_codes``: 0 ok, 1 runtime, 2 usage/config/checkpoint, 4 expert read,
  5 interrupted);
- **The stop policy** (``StopPolicy``): the first stop request lets the step in flight finish
  and saves what was generated; the second aborts the step in flight (between two layers) and
  still saves what was generated (not the engine state); the third exits at once. Front-ends
  only adapt their inputs to ``StopPolicy.request``: ``SignalStops`` maps SIGINT, SIGTERM and
  SIGHUP for the command line; the app maps its ctrl+c key and its event-loop signals.

Nothing here imports Textual.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from k3engine.exit_codes import EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE

from .display import for_terminal

if TYPE_CHECKING:
    from k3engine.model import Model, StreamOptions
    from k3engine.planner import Plan

    from .tokenizer import Tokenizer

__all__ = ["Failure", "OpenedModel", "open_model", "model_directory", "memory_option", "StopPolicy", "SignalStops",
           "one_at_a_time", "say", "EXIT_OK", "EXIT_RUNTIME", "EXIT_USAGE", "EXIT_EXPERT_IO", "EXIT_INTERRUPTED"]

MAX_THREADS = 64  # the engine's pool limit

Progress = Callable[[str], None]


class Failure(Exception):
    """Something the user must be told, and the exit code that says it to scripts."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    @property
    def usage(self) -> bool:
        """The command line, the configuration or the checkpoint is at fault (exit 2)."""
        return self.code == EXIT_USAGE


def say(message: str) -> None:
    """One ``k3chat: ...`` status line on standard error, controls shown, never obeyed (the
    messages quote paths, names and engine text). A closed stderr is not an error: the exit
    code still says what happened."""
    _to_stderr(for_terminal(f"k3chat: {message}") + "\n")


def _to_stderr(text: str) -> None:
    """Write to standard error from anywhere, a signal handler included. A handler may run
    while its own thread is inside a write to sys.stderr (a write to a full pipe interrupted):
    the buffered stream refuses the nested call with RuntimeError, so the text goes to the
    descriptor directly."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except RuntimeError:
        try:
            os.write(2, text.encode("utf-8", "replace"))
        except OSError:
            pass
    except (OSError, ValueError):
        pass


# --------------------------------------------------------------------------- opening


def memory_option(given: str | None, configured: str) -> str:
    """The memory budget to plan for: ``--memory`` when given (an empty value is a mistake,
    not a request for the default), else config.toml's."""
    if given is None:
        return configured
    if given.strip() == "":
        raise Failure("--memory is empty; give a size such as 12G, a preset (small, medium, large, huge), "
                      "auto or all", EXIT_USAGE)
    return given


@dataclass
class OpenedModel:
    """An open model, its tokenizer (None when not asked for) and the plan it runs under."""

    model: Model
    tokenizer: Tokenizer | None
    model_dir: Path
    plan: Plan | None  # None when every weight is resident without a plan (--memory all)
    options: StreamOptions
    memory: str
    threads: int

    @property
    def context(self) -> int | None:
        """The context the memory plan was made for (a Conversation must not outgrow it)."""
        return self.plan.context if self.plan is not None else None

    def close(self) -> None:
        self.model.close()


def model_directory(path: str | Path) -> tuple[Path, str | None]:
    """The model directory the user meant, and a note when it is not exactly what was typed
    (the path of config.json itself names its directory). A path that does not exist, a
    file, or a directory without config.json is a Failure (exit 2) that says which, before
    anything reads the checkpoint."""
    given = Path(path).expanduser()
    if given.name == "config.json" and given.is_file():
        return given.parent, f"{given} is the model's config file; using its directory {given.parent}"
    if not given.exists():
        raise Failure(f"the model directory {given} does not exist{_nearby(given)}; {_GIVE_MODEL_DIR}", EXIT_USAGE)
    if not given.is_dir():
        raise Failure(f"{given} is a file, not a model directory; {_GIVE_MODEL_DIR}", EXIT_USAGE)
    if not (given / "config.json").exists():
        raise Failure(f"{given} has no config.json, so it is not a model directory; {_GIVE_MODEL_DIR}", EXIT_USAGE)
    return given, None


_GIVE_MODEL_DIR = ("give the directory that holds the checkpoint (config.json, the model-*.safetensors shards "
                   "and their index)")


def _nearby(path: Path) -> str:
    """A hint for a mistyped path: a close name beside it, or the first missing parent."""
    import difflib

    parent = path.parent
    if not parent.is_dir():
        missing = parent
        while not missing.parent.exists() and missing.parent != missing:
            missing = missing.parent
        return f" (neither does {missing})"
    try:
        names = [entry.name for entry in parent.iterdir() if entry.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    return f" (did you mean {parent / close[0]}?)" if close else ""


def thread_count(threads: int | None) -> int:
    return min(threads or os.cpu_count() or 1, MAX_THREADS)


# Below this hidden width the default is one thread: waking a second one for each small matrix
# costs more than its share (the demo, hidden 256, decoded 505 tok/s on 1 thread and 74 on 2
# here). Output bits never depend on the thread count; --threads N still wins.
SMALL_MODEL_HIDDEN = 1024


def default_threads(hidden: int, threads: int | None) -> int:
    """The thread count to run a model of this hidden width with: ``threads`` when given,
    else one for a small model and every core (up to MAX_THREADS) otherwise."""
    if threads is None and hidden < SMALL_MODEL_HIDDEN:
        return 1
    return thread_count(threads)


def open_model(model_dir: str | Path, *, memory: str, context: int, threads: int | None = None,
               lookahead: int | None = None, scalar: bool = False, tokenizer: bool = True,
               progress: Progress | None = None, speculative: int = 0) -> OpenedModel:
    """Plan ``memory`` for ``context`` positions, open the model under that plan and (unless
    ``tokenizer`` is False) its tokenizer; every failure is a Failure with its exit code."""
    from k3engine.budgeted import open_budgeted

    model_dir, _ = model_directory(model_dir)  # front-ends say the note themselves
    n_threads = thread_count(threads)
    if progress is not None:
        progress(f"Planning memory ({memory}) and opening {model_dir}")
    try:
        opened = open_budgeted(model_dir, memory=memory, context=context, lookahead=lookahead,
                               threads=n_threads, scalar=scalar, speculative=speculative)
    except BaseException as exc:
        failure = _open_failure(model_dir, exc)
        if failure is None:
            raise
        raise failure from exc
    wanted = default_threads(opened.model.config.hidden, threads)
    if wanted != n_threads:
        opened.model.set_threads(wanted)
        n_threads = wanted
    tok = None
    if tokenizer:
        if progress is not None:
            progress("Loading the tokenizer")
        try:
            tok = _load_tokenizer(model_dir, opened.model.config.vocab)
        except BaseException:
            opened.model.close()
            raise
    return OpenedModel(model=opened.model, tokenizer=tok, model_dir=model_dir, plan=opened.plan,
                       options=opened.options, memory=memory, threads=n_threads)


def _open_failure(model_dir: Path, exc: BaseException) -> Failure | None:
    """The user's message and exit code for an exception raised while opening a model."""
    from k3engine.budgeted import LookaheadError
    from k3engine.errors import CheckpointError
    from k3engine.model import EngineError, ExpertReadError
    from k3engine.planner import PlanError
    from k3engine.sizes import MemorySizeError

    if isinstance(exc, (PlanError, MemorySizeError, LookaheadError)):
        return Failure(str(exc), EXIT_USAGE)
    if isinstance(exc, CheckpointError):
        return Failure(f"cannot open {model_dir}:\n{exc}", EXIT_USAGE)
    if isinstance(exc, EngineError):
        return Failure(f"the engine refused {model_dir}: {exc}",
                       EXIT_EXPERT_IO if isinstance(exc, ExpertReadError) else EXIT_RUNTIME)
    if isinstance(exc, MemoryError):
        return Failure(f"out of memory opening {model_dir}; try a smaller --memory or --context")
    if isinstance(exc, FileNotFoundError):
        return Failure(str(exc), EXIT_USAGE)
    if isinstance(exc, (OSError, ValueError, KeyError, TypeError)):  # unreadable files, bad values
        return Failure(f"cannot open {model_dir}: {exc}", EXIT_USAGE)
    return None


def _load_tokenizer(model_dir: Path, vocab: int) -> Tokenizer:
    from .tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_dir(model_dir)
        tok.engine_vocab_check(vocab)
    except TokenizerError as exc:
        raise Failure(f"tokenizer in {model_dir}: {exc}", EXIT_USAGE) from exc
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot load the tokenizer in {model_dir}: {exc}", EXIT_USAGE) from exc
    return tok


# --------------------------------------------------------------------------- stopping

AFTER_STEP, ABORT_STEP, NOW = 1, 2, 3


class StopPolicy:
    """Escalating stop requests, shared by every front-end (see the module docstring).

    ``bind`` names what each level does for the work now running (``conv.cancel`` and
    ``conv.abort`` for a chat turn, a CancelFlag for raw ids); with nothing bound the request
    is only recorded. ``finish`` marks the work as saved: a later request no longer changes
    the outcome (the first two are noted and ignored), only a third exits at once. Thread-safe;
    ``request`` may be called from a signal handler.
    """

    def __init__(self, exit_now: Callable[[], None] | None = None) -> None:
        self.requested = threading.Event()  # any request so far
        self.level = 0
        self.finished = False
        self._after_step: Callable[[], None] | None = None
        self._abort_step: Callable[[], None] | None = None
        self._exit_now = exit_now or _exit_interrupted
        # Reentrant: a signal handler runs in the main thread between two bytecodes, so it may
        # call request() while that same thread is inside bind() or request(). With a plain
        # Lock it waited forever for itself, and the work it meant to stop ran on (a CI run).
        self._lock = threading.RLock()

    def bind(self, *, after_step: Callable[[], None] | None = None,
             abort_step: Callable[[], None] | None = None) -> None:
        """What levels 1 and 2 do for the work that runs now. A request that came before the
        work could be bound is applied to it at once."""
        with self._lock:
            self._after_step, self._abort_step = after_step, abort_step
            level = self.level
        if level >= AFTER_STEP and after_step is not None:
            after_step()
        if level >= ABORT_STEP and abort_step is not None:
            abort_step()

    @property
    def can_abort(self) -> bool:
        return self._abort_step is not None

    def finish(self) -> None:
        """The work is done and saved: later requests do not change its outcome."""
        self.finished = True

    def request(self) -> int:
        """One more stop request; returns the level reached (1, 2 or 3)."""
        with self._lock:
            if self.finished and self.level < NOW - 1:
                self.level = NOW - 1  # the next request still exits at once
                return 0
            self.level = min(self.level + 1, NOW)
            level = self.level
            action = {AFTER_STEP: self._after_step, ABORT_STEP: self._abort_step}.get(level)
        self.requested.set()
        if level >= NOW:
            self._exit_now()
        elif action is not None:
            action()
        return level


def _exit_interrupted() -> None:
    os._exit(EXIT_INTERRUPTED)


SignalHandler = Callable[[int, "FrameType | None"], None]


def one_at_a_time(handler: SignalHandler) -> SignalHandler:
    """The handler, made to finish one signal before it starts on the next.

    Python runs a handler again inside itself when a second signal lands while the first is
    handled (two quick Ctrl-Cs): the inner run would work on state the outer one has half
    changed. Here the inner run only queues its signal and the outer run handles it next, so
    each signal is handled once, whole, in arrival order. deque.append and popleft are single
    C calls, so no signal can land inside one.
    """
    queued: deque[int] = deque()
    busy = [False]

    def run(signum: int, frame: FrameType | None) -> None:
        queued.append(signum)
        # The condition is checked again after busy drops: a signal that landed between the
        # inner loop's last check and busy = False is still handled.
        while queued and not busy[0]:
            busy[0] = True
            try:
                while queued:
                    handler(queued.popleft(), frame)
            finally:
                busy[0] = False

    return run


class SignalStops:
    """The command line's adapter: SIGINT, SIGTERM and SIGHUP are stop requests (SIGHUP, the
    terminal going away, is a request like any other). Messages go to standard error.

    Installed for the whole command, until the exit code is known, so that a signal arriving
    after the work was saved is handled like any other (and not turned into a traceback or a
    130 by Python's default handler). With nothing bound for the second level (no turn runs
    yet), the second request raises KeyboardInterrupt in the main thread: before the work
    starts nothing needs saving and unwinding leaves no trace.
    """

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self, policy: StopPolicy | None = None, *, what: str = "generated") -> None:
        self.policy = policy or StopPolicy(exit_now=self._exit_now)
        self.what = what
        self.step = "the current step"  # what the first request lets finish (a front-end may say more)
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> threading.Event:
        return self.policy.requested

    def _write(self, text: str) -> None:
        _to_stderr(text)

    def _exit_now(self) -> None:
        self._write("\nk3chat: stopped at once\n")
        os._exit(EXIT_INTERRUPTED)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        policy = self.policy
        if policy.finished and policy.level < NOW - 1:
            policy.request()
            self._write("\nk3chat: already saved; finishing (a second signal quits at once)\n")
            return
        if policy.level == AFTER_STEP and not policy.can_abort:
            policy.level = ABORT_STEP
            raise KeyboardInterrupt
        level = policy.request()
        if level == AFTER_STEP:
            self._write(f"\nk3chat: stopping after {self.step} and saving what was {self.what} "
                        "(Ctrl-C again to abort the step)\n")
        elif level == ABORT_STEP:
            self._write(f"\nk3chat: aborting the current step; saving what was {self.what} "
                        "(a third Ctrl-C quits at once)\n")

    def __enter__(self) -> SignalStops:
        if threading.current_thread() is threading.main_thread():
            handler = one_at_a_time(self._handler)
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._old[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()

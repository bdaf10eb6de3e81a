"""`k3chat run --prompt` (one chat turn, saved to a session) and `k3chat sessions ...`.

Output of `run --prompt`: reasoning and answer on standard output under their own headers,
streamed; status lines (session, token counts, notices) on standard error, so
`k3chat run M --prompt Q --no-think > answer.txt` keeps only the answer and its header.

Ctrl-C (or SIGTERM/SIGHUP): the first lets the step in flight finish, saves what was
generated (marked interrupted) and exits 5; a second exits at once. The turn runs on a worker
thread so that the main thread is always free to take the second signal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from .cli import EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from .events import AnswerToken, Event, Notice, PhaseChanged, Prefill, ReasoningToken
from .history import HistoryError, HistoryStore, SessionInfo


def usage_error(message: str) -> int:
    print(f"k3chat: {message}", file=sys.stderr)
    return EXIT_USAGE


def _fail(message: str, code: int = EXIT_RUNTIME) -> int:
    print(f"k3chat: {message}", file=sys.stderr)
    return code


class _Usage(Exception):
    """A usage or configuration problem: exit 2 with this message."""


# --------------------------------------------------------------------------- settings


def _settings(overrides: dict[str, Any] | None = None) -> Any:
    from .settings import SettingsError, load_settings, merge_cli
    try:
        s = load_settings()
        return merge_cli(s, overrides) if overrides else s
    except SettingsError as exc:
        raise _Usage(str(exc)) from None


def default_model_dir() -> Path | int:
    """MODEL_DIR from config.toml when the command line omits it (or an exit code)."""
    try:
        s = _settings()
    except _Usage as exc:
        return usage_error(str(exc))
    if s.model is None:
        return usage_error("MODEL_DIR is required (or set `model` in config.toml)")
    return Path(s.model)


def _run_settings(args: argparse.Namespace) -> Any:
    overrides = {
        "model": args.model_dir,
        "effort": args.thinking_effort,
        # An effort on the command line means thinking, even if the config turned it off.
        "thinking": False if args.no_think else (True if args.thinking_effort else None),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }
    s = _settings(overrides)
    if s.model is None:
        raise _Usage("MODEL_DIR is required (or set `model` in config.toml)")
    return s


# --------------------------------------------------------------------------- sessions


def _open_store() -> HistoryStore:
    return HistoryStore()


def find_session(store: HistoryStore, ref: str) -> SessionInfo | None:
    """A session by id, else by exact name (refused when several share it)."""
    infos = store.list()
    for info in infos:
        if info.id == ref:
            return info
    named = [info for info in infos if info.name == ref]
    if len(named) > 1:
        ids = ", ".join(info.id for info in named)
        raise _Usage(f"several sessions are named {ref!r} ({ids}); use an id")
    return named[0] if named else None


def _session_name(prompt: str) -> str:
    line = " ".join(prompt.split())
    name = "".join(ch for ch in line if ch.isprintable())[:60].strip()
    return name or "untitled"


# --------------------------------------------------------------------------- signals


class _Signals:
    """First signal: ask the turn to stop after the step in flight. Second: exit now."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.on_first: Callable[[], None] | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            try:
                sys.stderr.write("\nk3chat: stopped at once\n")
                sys.stderr.flush()
            finally:
                os._exit(EXIT_INTERRUPTED)
        self.requested.set()
        sys.stderr.write("\nk3chat: stopping after the current step and saving (Ctrl-C again to quit now)\n")
        sys.stderr.flush()
        if self.on_first is not None:
            self.on_first()

    def __enter__(self) -> _Signals:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _in_worker(fn: Callable[[], Any]) -> Any:
    """Run fn on a thread while the main thread stays free for signals; re-raise its error."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the main thread
            box["error"] = exc

    t = threading.Thread(target=work, name="k3chat-turn", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
    if "error" in box:
        raise box["error"]
    return box.get("value")


# --------------------------------------------------------------------------- output


class _Printer:
    """Streams a turn: text to stdout under headers, status to stderr."""

    def __init__(self, session: SessionInfo) -> None:
        self.session = session
        self._at_line_start = True
        self._announced = False

    def _out(self, text: str) -> None:
        if not text:
            return
        sys.stdout.write(text)
        sys.stdout.flush()
        self._at_line_start = text.endswith("\n")

    def _header(self, title: str) -> None:
        if not self._at_line_start:
            self._out("\n")
        self._out(f"--- {title} ---\n")

    def __call__(self, event: Event) -> None:
        if isinstance(event, Prefill):
            where = f" (from {event.source.replace('_', ' ')})" if event.source else ""
            print(f"k3chat: session {self.session.name!r} ({self.session.id}): prompt {event.prompt_tokens} tokens, "
                  f"reused {event.reused_tokens}{where}, prefilling {event.prefilled_tokens}", file=sys.stderr)
        elif isinstance(event, PhaseChanged):
            if event.phase in ("reasoning", "answer"):
                if not self._announced:
                    self._announced = True
                    print("k3chat: generating (Ctrl-C stops after the current token)", file=sys.stderr, flush=True)
                self._header(event.phase)
            elif event.phase == "sync":
                print("k3chat: lining the engine state up with the saved history", file=sys.stderr)
            elif event.phase == "done" and not self._at_line_start:
                self._out("\n")
        elif isinstance(event, (ReasoningToken, AnswerToken)):
            self._out(event.text)
        elif isinstance(event, Notice):
            if not self._at_line_start:
                self._out("\n")
            print(f"k3chat: {event.text}", file=sys.stderr, flush=True)


def _write_json(path: str, payload: dict[str, Any]) -> None:
    from . import paths
    # The conversation is in it: private like the history, and replaced atomically.
    paths.atomic_write(Path(path), (json.dumps(payload, ensure_ascii=False, indent=1) + "\n").encode("utf-8"))


# --------------------------------------------------------------------------- run --prompt


def run_chat(args: argparse.Namespace) -> int:
    try:
        return _run_chat(args)
    except _Usage as exc:
        return usage_error(str(exc))


def _check_args(args: argparse.Namespace) -> None:
    if args.gen is not None:
        raise _Usage("--gen is for --ids runs; use --max-tokens with --prompt")
    if args.resume and not args.session:
        raise _Usage("--resume needs --session")
    if args.resume and args.system is not None:
        raise _Usage("--system starts a new session; it cannot be used with --resume")
    if args.prompt is not None and args.prompt == "":
        raise _Usage("--prompt is empty")


def _prepare_session(store: HistoryStore, args: argparse.Namespace) -> tuple[SessionInfo | None, str | None]:
    """(existing session or None, the system message to send with the first turn)."""
    info = find_session(store, args.session) if args.session else None
    if info is None:
        if args.resume:
            raise _Usage(f"no session {args.session!r} to resume")
        return None, args.system
    records = store.load(info.id).records
    pending = bool(records) and records[-1]["role"] == "user"
    if args.resume and not pending:
        raise _Usage(f"session {info.name!r} has no unanswered message to resume")
    if not args.resume and pending:
        raise _Usage(f"session {info.name!r} ends with an unanswered message; answer it first with "
                     f"--session {info.id} --resume")
    if args.system is not None:
        if not records:
            return info, args.system
        if records[0]["role"] != "system" or records[0]["content"] != args.system:
            raise _Usage(f"session {info.name!r} already has messages; --system can only start a session "
                         "(or repeat its system message exactly)")
    return info, None


def _run_chat(args: argparse.Namespace) -> int:
    _check_args(args)
    settings = _run_settings(args)
    from . import paths
    try:
        store = _open_store()
        info, system = _prepare_session(store, args)
    except (HistoryError, paths.UnsafePathError, OSError) as exc:
        return _fail(f"cannot open the history: {exc}")

    with _Signals() as signals:
        opened = _open_model(Path(settings.model), args, args.memory or settings.memory)
        if isinstance(opened, int):
            return opened
        model, tokenizer = opened
        if signals.requested.is_set():
            return _fail("interrupted before the turn started; nothing was changed", EXIT_INTERRUPTED)
        created = False
        try:
            if info is None:
                name = args.session or _session_name(args.prompt)
                info = store.create(name, model=Path(settings.model).name)
                created = True
        except HistoryError as exc:
            return _fail(f"cannot create the session: {exc}")
        return _run_turn(args, settings, store, info, created, system, model, tokenizer, signals)


def _open_model(model_dir: Path, args: argparse.Namespace, memory: str) -> tuple[Any, Any] | int:
    from k3engine.budgeted import open_budgeted
    from k3engine.errors import CheckpointError
    from k3engine.model import EngineError, ExpertReadError
    from k3engine.planner import DEFAULT_CONTEXT, PlanError
    from k3engine.sizes import MemorySizeError

    from .tokenizer import Tokenizer, TokenizerError

    threads = args.threads or os.cpu_count() or 1
    try:
        model = open_budgeted(model_dir, memory=memory, context=args.context or DEFAULT_CONTEXT,
                              lookahead=args.lookahead, threads=min(threads, 64), scalar=args.scalar).model
    except (PlanError, MemorySizeError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except CheckpointError as exc:
        return _fail(f"cannot open {model_dir}:\n{exc}", EXIT_USAGE)
    except FileNotFoundError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except EngineError as exc:
        return _fail(f"the engine refused {model_dir}: {exc}",
                     EXIT_EXPERT_IO if isinstance(exc, ExpertReadError) else EXIT_RUNTIME)
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
        tokenizer.engine_vocab_check(model.config.vocab)
    except TokenizerError as exc:
        return _fail(f"tokenizer in {model_dir}: {exc}", EXIT_USAGE)
    return model, tokenizer


def _run_turn(args: argparse.Namespace, settings: Any, store: HistoryStore, info: SessionInfo, created: bool,
              system: str | None, model: Any, tokenizer: Any, signals: _Signals) -> int:
    from k3engine.model import ExpertReadError

    from .conversation import ContextOverflow, Conversation, ConversationError, TurnFailed, sampler_settings

    conv = Conversation(model, tokenizer, store, info.id, thinking=settings.thinking, effort=settings.effort,
                        max_tokens=settings.max_tokens, context=args.context, model_name=Path(settings.model).name)
    conv.sampler = sampler_settings(sampling=settings.sampling, temperature=settings.temperature,
                                    top_p=settings.top_p, top_k=settings.top_k, seed=settings.seed,
                                    records=conv.records)
    if not conv.sampler.greedy:
        print(f"k3chat: sampling with seed {conv.sampler.seed}", file=sys.stderr)
    for problem in conv.load_problems:
        print(f"k3chat: warning: session {info.id}: {problem}", file=sys.stderr)
    signals.on_first = conv.cancel
    if signals.requested.is_set():  # before anything was committed: leave no trace
        if created:
            store.delete(info.id)
        return _fail("interrupted before the turn started; nothing was changed", EXIT_INTERRUPTED)
    printer = _Printer(info)
    payload: dict[str, Any] = {"session": info.id, "session_name": info.name, "model_dir": str(settings.model)}
    code = EXIT_OK
    result = None
    try:
        if args.resume:
            result = _in_worker(lambda: conv.respond(on_event=printer))
        else:
            result = _in_worker(lambda: conv.send(args.prompt, system=system, on_event=printer))
    except ContextOverflow as exc:
        if created:
            store.delete(info.id)  # nothing of this run remains
        payload.update(error=str(exc), prompt_tokens=exc.prompt_tokens, interrupted=False)
        code = _fail(str(exc))
    except TurnFailed as exc:
        result = exc.result
        code = _fail(f"the turn failed: {exc}",
                     EXIT_EXPERT_IO if isinstance(exc.cause, ExpertReadError) else EXIT_RUNTIME)
        payload["error"] = str(exc)
    except (ConversationError, HistoryError) as exc:
        code = _fail(str(exc))
        payload["error"] = str(exc)
    except Exception as exc:  # the answer may have been shown: never report success
        code = _fail(f"the turn failed: {type(exc).__name__}: {exc}")
        payload["error"] = f"{type(exc).__name__}: {exc}"
    if result is not None:
        payload.update(result.to_json())
        payload.setdefault("error", None)
        if code == EXIT_OK:
            if result.stop == "cancelled" or signals.requested.is_set():
                code = EXIT_INTERRUPTED  # Ctrl-C, even if it only stopped the state sync
            elif result.interrupted and result.stop != "limit":
                code = EXIT_RUNTIME  # a malformed answer: saved, marked, said so above
        _summary(result, info)
    payload["exit_code"] = code
    if args.json_out:
        try:
            _write_json(args.json_out, payload)
        except OSError as exc:
            print(f"k3chat: cannot write {args.json_out}: {exc}", file=sys.stderr)
            code = code or EXIT_RUNTIME
    return code


def _summary(result: Any, info: SessionInfo) -> None:
    speed = ""
    if result.decode_seconds > 0 and result.generated_tokens > 1:
        speed = f" ({(result.generated_tokens - 1) / result.decode_seconds:.1f} tokens/s)"
    status = " [interrupted]" if result.interrupted else ""
    saved = "saved to" if result.saved else "NOT saved to"
    print(f"k3chat: {result.generated_tokens} tokens generated{speed}{status}; {saved} session "
          f"{info.name!r} (continue with --session {info.id})", file=sys.stderr)


# --------------------------------------------------------------------------- sessions


def sessions_main(args: argparse.Namespace) -> int:
    from . import paths
    actions = {"list": _sessions_list, "show": _sessions_show, "export": _sessions_export,
               "rename": _sessions_rename, "rm": _sessions_rm}
    try:
        store = _open_store()
        return actions[args.action](store, args)
    except _Usage as exc:
        return usage_error(str(exc))
    except (HistoryError, paths.UnsafePathError, OSError) as exc:
        return _fail(str(exc))


def _resolve(store: HistoryStore, ref: str) -> SessionInfo:
    info = find_session(store, ref)
    if info is None:
        raise _Usage(f"no session {ref!r} (see `k3chat sessions list`)")
    return info


def _local(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def _sessions_list(store: HistoryStore, args: argparse.Namespace) -> int:
    infos = store.list()
    if args.json:
        doc = [{"id": i.id, "name": i.name, "created": i.created, "updated": i.updated,
                "messages": i.n_messages, "model": i.model} for i in infos]
        print(json.dumps(doc, ensure_ascii=False, indent=1))
        return EXIT_OK
    if not infos:
        print("no sessions", file=sys.stderr)
        return EXIT_OK
    print(f"{'ID':<24}  {'UPDATED':<16}  {'MSGS':>4}  NAME")
    for i in infos:
        print(f"{i.id:<24}  {_local(i.updated):<16}  {i.n_messages:>4}  {i.name}")
    return EXIT_OK


def _sessions_show(store: HistoryStore, args: argparse.Namespace) -> int:
    info = _resolve(store, args.session)
    for problem in store.load(info.id).problems:
        print(f"k3chat: warning: {problem}", file=sys.stderr)
    sys.stdout.write(store.export_markdown(info.id))
    return EXIT_OK


def _sessions_export(store: HistoryStore, args: argparse.Namespace) -> int:
    from . import paths
    info = _resolve(store, args.session)
    text = {"md": store.export_markdown, "json": store.export_json, "jsonl": store.export_peer_jsonl}[args.format](info.id)
    if args.output:
        paths.atomic_write(Path(args.output), text.encode("utf-8"))
        print(f"k3chat: wrote {args.output} (mode 0600)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _sessions_rename(store: HistoryStore, args: argparse.Namespace) -> int:
    from .history import _check_name
    info = _resolve(store, args.session)
    try:
        _check_name(args.name)
    except HistoryError as exc:
        raise _Usage(str(exc)) from None
    renamed = store.rename(info.id, args.name)
    print(f"k3chat: renamed {info.id}: {info.name!r} -> {renamed.name!r}", file=sys.stderr)
    return EXIT_OK


def _sessions_rm(store: HistoryStore, args: argparse.Namespace) -> int:
    from .conversation import delete_state
    info = _resolve(store, args.session)
    if not args.yes:
        if not sys.stdin.isatty():
            raise _Usage(f"refusing to delete session {info.name!r} without --yes")
        answer = input(f"Delete session {info.name!r} ({info.id}, {info.n_messages} messages)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("k3chat: not deleted", file=sys.stderr)
            return EXIT_OK
    store.delete(info.id)
    delete_state(info.id)
    print(f"k3chat: deleted session {info.name!r} ({info.id})", file=sys.stderr)
    return EXIT_OK


__all__ = ["run_chat", "sessions_main", "default_model_dir", "usage_error", "find_session"]

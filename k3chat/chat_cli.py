"""`k3chat run --prompt` (one chat turn, saved to a session) and `k3chat sessions ...`.

Output of `run --prompt`: reasoning and answer on standard output under their own headers,
streamed; status lines (session, token counts, notices) on standard error, so
`k3chat run M --prompt Q --no-think > answer.txt` keeps only the answer and its header.

Prefill progress goes to standard error (see _Printer). Ctrl-C (or SIGTERM/SIGHUP) while the
prompt is read stops at the next chunk boundary: no answer is stored, the message stays in the
session unanswered, the engine state read so far is saved, and `--session S --resume` reads
only the rest; exit 5.

Ctrl-C (or SIGTERM/SIGHUP): the first lets the step in flight finish, saves what was
generated (marked interrupted) and exits 5. A second aborts the engine step in flight (between
two layers), still saves what was generated (parsed leniently, marked interrupted), skips the
engine state file and exits 5. Only a third exits at once, saving nothing more. The turn runs
on a worker thread so that the main thread is always free to take the signals.

Everything stored, generated or typed that reaches the terminal goes through
display.for_terminal (escape sequences, C1 and bidi controls are shown, never obeyed); JSON
on standard output goes through display.json_safe.

Exit codes (cli.py): 0 done (an answer cut at the token limit too: saved, marked, said);
1 a runtime failure: the turn failed or its answer was malformed (what was generated is saved,
marked interrupted), the history could not be read or written, the engine failed; 2 a usage or
configuration problem, including a checkpoint or tokenizer that cannot be opened, a memory plan
that cannot fit, an invalid prompt text or session name, a --file or --prompt-file that cannot
be read as text (k3chat.attachments says why), a message that does not fit the context
(nothing is sent or saved; k3chat.context_fit gives the context and memory that would hold it),
and --context above the model's max_position_embeddings;
4 a routed expert could not be read; 5 interrupted (Ctrl-C, SIGTERM, SIGHUP). Every failure
prints one `k3chat: ...` line saying what happened and whether anything was saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from .display import for_terminal, json_safe
from .events import AnswerToken, Event, Notice, PhaseChanged, Prefill, PrefillProgress, ReasoningToken
from .history import (AmbiguousSession, HistoryError, HistoryStore, NameTaken, SessionBusy, SessionExists,
                      SessionInfo, display_name, open_store)
from .runtime import (EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, Failure,
                      SignalStops, memory_option, open_model)
from .runtime import say as _err
from .vault import VaultError


def usage_error(message: str) -> int:
    _err(message)
    return EXIT_USAGE


def _fail(message: str, code: int = EXIT_RUNTIME) -> int:
    _err(message)
    return code


def _tolerant_streams() -> None:
    """Never die on output encoding: a non-UTF-8 locale gets backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def json_path_problem(path: str | None) -> str | None:
    """Why --json PATH can certainly not be written (checked before any work), or None."""
    if not path:
        return None
    target = Path(path)
    if target.is_dir():
        return f"--json {path} is a directory; give a file name"
    if not target.parent.is_dir():
        return f"--json: the directory {target.parent} does not exist"
    return None


def _text_problem(option: str, text: str | None) -> str | None:
    """Why ``text`` (from the command line) cannot be stored, or None."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return (f"{option} is not valid text: it contains bytes that are not UTF-8 (check the "
                "terminal's or the script's encoding)")
    return None


class _Usage(Failure):
    """A usage or configuration problem: exit 2 with this message."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


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
        return usage_error("MODEL_DIR is required (or --demo, or set `model` in config.toml)")
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
        "speculative": getattr(args, "speculative", None),
        "remote": getattr(args, "remote", None),
        "remote_model": getattr(args, "remote_model", None),
        "api_key_file": getattr(args, "api_key_file", None),
        "remote_ca_file": getattr(args, "remote_ca_file", None),
    }
    s = _settings(overrides)
    if args.model_dir is not None and getattr(args, "remote", None) is None:
        s = dataclasses.replace(s, remote=None)  # a model named on the command line beats a configured remote
    if s.model is None and s.remote is None:
        raise _Usage("MODEL_DIR is required (or --demo, or set `model` in config.toml)")
    return s


# --------------------------------------------------------------------------- sessions


def _open_store() -> HistoryStore:
    return open_store()  # unlocks an encrypted history (the passphrase, once per process)


def find_session(store: HistoryStore, ref: str) -> SessionInfo | None:
    """A session by id or name; a shared name is a usage error."""
    try:
        return store.find(ref)
    except AmbiguousSession as exc:
        raise _Usage(str(exc)) from None


def _discard_if_empty(store: HistoryStore, info: SessionInfo) -> None:
    """Remove a session this run created if nothing was ever written to it."""
    from .conversation import delete_state
    try:
        if not store.load(info.id).records:
            store.delete(info.id)
            delete_state(info.id)
    except (HistoryError, OSError) as exc:
        _err(f"warning: could not remove the empty session {info.id}: {exc}")


def _session_name(prompt: str) -> str:
    line = " ".join(prompt.split())
    name = "".join(ch for ch in line if ch.isprintable())[:60].strip()
    return name or "untitled"


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


# Without a terminal, a prefill progress line at most this often (seconds), beside the
# first and the last: a log of an hour's prefill stays a few hundred lines.
LOG_PROGRESS_EVERY = 10.0


class _Printer:
    """Streams a turn: text to stdout under headers, status to stderr.

    Prefill progress goes to stderr: on a terminal one line redrawn in place; otherwise (a
    log, a pipe) a line when the prefill starts, every LOG_PROGRESS_EVERY seconds and when
    it ends or stops."""

    def __init__(self, session: SessionInfo, signals: SignalStops | None = None) -> None:
        self.session = session
        self.signals = signals
        self._at_line_start = True
        self._announced = False
        self._stdout_gone = False
        self._progress_open = False  # a redrawn progress line is on the terminal, unfinished
        self._progress_logged: float | None = None
        try:
            self._tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            self._tty = False

    def _progress(self, event: PrefillProgress) -> None:
        from .progress import progress_bar, progress_line

        last = event.done >= event.total
        if self._tty:
            text = f"k3chat: {progress_line(event)} {progress_bar(event)}"
            try:
                sys.stderr.write("\r" + text + "\x1b[K" + ("\n" if last else ""))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            self._progress_open = not last
            return
        logged = self._progress_logged
        if last or logged is None or event.seconds - logged >= LOG_PROGRESS_EVERY or event.done == 0:
            self._progress_logged = event.seconds
            _err(progress_line(event))

    def _end_progress(self) -> None:
        """Other stderr output follows: finish a redrawn progress line first."""
        if self._progress_open:
            self._progress_open = False
            try:
                sys.stderr.write("\n")
            except (OSError, ValueError):
                pass

    def _out(self, text: str) -> None:
        text = for_terminal(text)  # per character, so each streamed piece is safe alone
        if not text or self._stdout_gone:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            # The reader went away (`| head`): keep generating and saving, stop printing.
            self._stdout_gone = True
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass
            return
        self._at_line_start = text.endswith("\n")

    def _header(self, title: str) -> None:
        if not self._at_line_start:
            self._out("\n")
        self._out(f"--- {title} ---\n")

    def __call__(self, event: Event) -> None:
        if isinstance(event, PrefillProgress):
            if self.signals is not None:  # what a first Ctrl-C lets finish, said when it comes
                self.signals.step, self.signals.what = "the chunk of the prompt in flight", "read"
            self._progress(event)
            return
        self._end_progress()
        if isinstance(event, Prefill):
            where = f" (from {event.source.replace('_', ' ')})" if event.source else ""
            _err(f"session {self.session.name!r} ({self.session.id}): prompt {event.prompt_tokens} tokens, "
                 f"reused {event.reused_tokens}{where}, prefilling {event.prefilled_tokens}")
        elif isinstance(event, PhaseChanged):
            if event.phase != "prefill" and self.signals is not None:
                self.signals.step, self.signals.what = "the current step", "generated"
            if event.phase in ("reasoning", "answer"):
                if not self._announced:
                    self._announced = True
                    _err("generating (Ctrl-C stops after the current token)")
                self._header(event.phase)
            elif event.phase == "sync":
                _err("lining the engine state up with the saved history")
            elif event.phase == "done" and not self._at_line_start:
                self._out("\n")
        elif isinstance(event, (ReasoningToken, AnswerToken)):
            self._out(event.text)
        elif isinstance(event, Notice):
            if not self._at_line_start:
                self._out("\n")
            _err(event.text)


def _write_json(path: str, payload: dict[str, Any]) -> None:
    from . import paths
    # The conversation is in it: private like the history, and replaced atomically.
    text = json_safe(json.dumps(payload, ensure_ascii=False, indent=1)) + "\n"
    paths.atomic_write(Path(path), text.encode("utf-8", errors="backslashreplace"))


# --------------------------------------------------------------------------- run --prompt


def run_chat(args: argparse.Namespace) -> int:
    _tolerant_streams()
    with SignalStops() as signals:  # until the exit code is known: a late signal is handled too
        try:
            return _run_chat(args, signals)
        except Failure as exc:
            return _fail(exc.message, exc.code)
        except KeyboardInterrupt:  # a second signal before the turn could start
            return _fail("interrupted before the turn started; nothing was changed", EXIT_INTERRUPTED)


def _check_args(args: argparse.Namespace) -> None:
    if args.gen is not None:
        raise _Usage("--gen is for --ids runs; use --max-tokens with --prompt")
    if args.resume and not args.session:
        raise _Usage("--resume needs --session")
    if args.resume and args.system is not None:
        raise _Usage("--system starts a new session; it cannot be used with --resume")
    if getattr(args, "files", None) and args.resume:
        raise _Usage("--file attaches files to a new message; --resume answers the stored one as it is")
    _read_prompt(args)
    if args.prompt is not None and args.prompt == "":
        raise _Usage("--prompt is empty")
    if args.lookahead is not None and args.lookahead < 0:
        raise _Usage(f"--lookahead must be >= 0 (0 turns it off), got {args.lookahead}")
    problem = json_path_problem(args.json_out)
    if problem is not None:
        raise _Usage(problem)
    # Checked before anything is created: text that cannot be stored must leave no trace.
    for option, text in (("--prompt", args.prompt), ("--system", args.system), ("--session", args.session)):
        problem = _text_problem(option, text)
        if problem is not None:
            raise _Usage(problem)


def _read_prompt(args: argparse.Namespace) -> None:
    """``args.prompt`` from --prompt-file or standard input (--prompt -), and
    ``args.attachments`` from each --file: all read and checked before anything is created."""
    from .attachments import read_attachment, read_text_file

    if getattr(args, "prompt_file", None) is not None:
        args.prompt = read_text_file(args.prompt_file, "--prompt-file")
    elif args.prompt == "-":
        args.prompt = _stdin_prompt()
    args.attachments = [read_attachment(path) for path in getattr(args, "files", None) or ()]


def _stdin_prompt() -> str:
    if _isatty(sys.stdin):
        raise _Usage("--prompt - reads the message from standard input, which is a terminal here; pipe it in "
                     "(k3chat run ... --prompt - < question.txt) or give --prompt-file PATH")
    try:
        data = sys.stdin.buffer.read()
    except (OSError, ValueError, AttributeError) as exc:
        raise _Usage(f"--prompt -: cannot read standard input: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Usage(f"--prompt -: standard input is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                     f"{exc.start:,}); convert it first (e.g. with iconv)") from None
    if not text:
        raise _Usage("--prompt -: standard input was empty; pipe the message in")
    return text.removeprefix("\ufeff")


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (OSError, ValueError, AttributeError):
        return False


def _context(args: argparse.Namespace, model_dir: Path) -> int:
    """N_ctx: --context, else the planner's default (capped by the model's own limit). The
    memory plan and the conversation both use exactly this."""
    from .conversation import default_context, model_max_positions

    limit = model_max_positions(model_dir)
    if args.context is None:
        return default_context(model_dir)
    if limit is not None and args.context > limit:
        raise _Usage(f"--context {args.context:,} is more than the model's max_position_embeddings ({limit:,})")
    return int(args.context)


def _prepare_session(store: HistoryStore, args: argparse.Namespace) -> tuple[SessionInfo | None, str | None]:
    """(existing session or None, the system message to send with the first turn)."""
    from .history import _check_name

    info = find_session(store, args.session) if args.session else None
    if info is None:
        if args.resume:
            raise _Usage(f"no session {args.session!r} to resume")
        if args.session is not None:
            try:
                _check_name(args.session)  # the name of the session this run will create
            except HistoryError as exc:
                raise _Usage(f"--session: {exc}") from None
        return None, args.system
    loaded = store.load(info.id)
    records = loaded.records
    pending = bool(records) and records[-1]["role"] == "user"
    if pending:
        _check_not_being_answered(store, info)  # its message may be the other k3chat's
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


def _check_not_being_answered(store: HistoryStore, info: SessionInfo) -> None:
    try:
        store.check_idle(info.id)
    except SessionBusy as exc:
        raise SessionBusy(repr(info.name) + f" ({info.id})", exc.pid) from None


def _open_session(args: argparse.Namespace) -> tuple[HistoryStore, SessionInfo | None, str | None]:
    """The history and the session this run continues (None: a new one) with its system
    message, for a local and a remote turn alike; a Failure says why they cannot be had."""
    from . import paths
    try:
        store = _open_store()
        return (store, *_prepare_session(store, args))
    except VaultError:
        raise  # a Failure with its own exit code
    except SessionBusy as exc:
        raise Failure(str(exc)) from None
    except (HistoryError, paths.UnsafePathError, OSError) as exc:
        raise Failure(f"cannot open the history: {exc}") from None


def _run_chat(args: argparse.Namespace, signals: SignalStops) -> int:
    _check_args(args)
    settings = _run_settings(args)
    if settings.remote is not None:
        return _run_remote_chat(args, settings, signals)
    from .runtime import model_directory
    model_dir, note = model_directory(settings.model)  # before anything reads the checkpoint
    if note:
        _err(note)
    if model_dir != Path(settings.model):
        settings = dataclasses.replace(settings, model=model_dir)
    context = _context(args, model_dir)
    memory = memory_option(args.memory, settings.memory)
    store, info, system = _open_session(args)

    created: SessionInfo | None = None
    try:
        opened = open_model(model_dir, memory=memory, context=context, threads=args.threads,
                            lookahead=args.lookahead, scalar=args.scalar, speculative=settings.speculative)
        if signals.requested.is_set():
            opened.close()
            return _fail("interrupted before the turn started; nothing was changed", EXIT_INTERRUPTED)
        if info is None:
            name = args.session or _session_name(args.prompt)
            try:
                # --session NAME names one session: created only if no other k3chat
                # created it since this run looked (checked under the index lock).
                info = created = store.create(name, model=model_dir.name, unique_name=args.session is not None,
                                              numbered=args.session is None)
            except SessionExists as exc:
                return _fail(f"another k3chat created session {exc.info.name!r} ({exc.info.id}) after this run "
                             f"started; nothing was saved; continue it with --session {exc.info.id}")
            except (HistoryError, OSError) as exc:
                return _fail(f"cannot create the session: {exc}")
        return _run_turn(args, settings, store, info, created is not None, system, opened.model,
                         opened.tokenizer, signals, context, fit=_fit_for(opened))
    finally:
        if created is not None:
            _discard_if_empty(store, created)  # a failure before the first record: no trace


def _fit_for(opened: Any) -> Callable[[Any], Any]:
    """The advice for a message that does not fit, planned as this session's plan was."""
    from .context_fit import advise
    plan = opened.plan
    lookahead = plan.lookahead if plan is not None else 0
    process = plan.process_bytes if plan is not None else 0
    return lambda overflow: advise(overflow, opened.model_dir, lookahead=lookahead, process_bytes=process)


def _conversation(args: argparse.Namespace, settings: Any, store: HistoryStore, info: SessionInfo, model: Any,
                  tokenizer: Any, context: int) -> Any:
    """The Conversation, or an exit code after saying why it could not be built."""
    from .conversation import Conversation, sampler_settings
    from .tokenizer import TokenizerError

    try:
        conv = Conversation(model, tokenizer, store, info.id, thinking=settings.thinking, effort=settings.effort,
                            max_tokens=settings.max_tokens, context=context,
                            model_name=Path(settings.model).name, speculative=settings.speculative)
        conv.sampler = sampler_settings(sampling=settings.sampling, temperature=settings.temperature,
                                        top_p=settings.top_p, top_k=settings.top_k, seed=settings.seed,
                                        records=conv.records)
    except TokenizerError as exc:
        return _fail(f"tokenizer: {exc}", EXIT_USAGE)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except (HistoryError, OSError) as exc:
        return _fail(f"cannot load session {info.id}: {exc}")
    return conv


def _run_turn(args: argparse.Namespace, settings: Any, store: HistoryStore, info: SessionInfo, created: bool,
              system: str | None, model: Any, tokenizer: Any, signals: SignalStops, context: int,
              conv: Any = None, fit: Callable[[Any], Any] | None = None) -> int:
    from k3engine.model import ExpertReadError

    from .conversation import ContextOverflow, ConversationError, TurnFailed

    if conv is None:
        conv = _conversation(args, settings, store, info, model, tokenizer, context)
    if isinstance(conv, int):
        return conv
    if not conv.sampler.greedy:
        _err(f"sampling with seed {conv.sampler.seed}")
    for problem in conv.load_problems:
        _err(f"warning: session {info.id}: {problem}")
    if signals.requested.is_set():  # before anything was committed: leave no trace
        return _fail("interrupted before the turn started; nothing was changed", EXIT_INTERRUPTED)
    signals.policy.bind(after_step=conv.cancel, abort_step=conv.abort)
    printer = _Printer(info, signals)
    payload: dict[str, Any] = {"session": info.id, "session_name": info.name,
                               "model_dir": None if settings.model is None else str(settings.model)}
    if settings.remote is not None:
        payload.update(remote=settings.remote, model=conv.model_name)
    code = EXIT_OK
    result = None
    try:
        if args.resume:
            result = _in_worker(lambda: conv.respond(on_event=printer))
        else:
            result = _in_worker(lambda: conv.send(args.prompt, system=system, attachments=getattr(args, "attachments", ()),
                                                  on_event=printer))
    except ContextOverflow as exc:
        payload.update(error=str(exc), prompt_tokens=exc.prompt_tokens, interrupted=False)
        if fit is not None:
            advice = fit(exc)
            payload.update(error=advice.message(settings.model), fit=dataclasses.asdict(advice))
            code = _fail(advice.message(settings.model), EXIT_USAGE)
        else:
            code = _fail(str(exc), EXIT_USAGE)
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
    # The turn is over and saved: a signal from now on does not change what happened.
    stopped = signals.requested.is_set()
    signals.policy.finish()
    if result is not None:
        payload.update(result.to_json())
        payload.setdefault("error", None)
        if code == EXIT_OK:
            if result.stop == "cancelled" or stopped:
                code = EXIT_INTERRUPTED  # Ctrl-C, even if it only stopped the state sync
            elif result.interrupted and result.stop != "limit":
                code = EXIT_RUNTIME  # a malformed answer: saved, marked, said so above
        _summary(result, info)
    elif stopped and code == EXIT_OK:
        code = EXIT_INTERRUPTED
    payload["exit_code"] = code
    if args.json_out:
        try:
            _write_json(args.json_out, payload)
        except OSError as exc:
            _err(f"cannot write {args.json_out}: {exc}")
            code = code or EXIT_RUNTIME
    return code


def _run_remote_chat(args: argparse.Namespace, settings: Any, signals: SignalStops) -> int:
    """run --prompt against an OpenAI-compatible server (k3chat.remote): the same session
    handling, printer, summary and JSON as a local run; no local model is opened."""
    from .remote import RemoteClient, RemoteError, resolve_model

    local_only = {"--memory": args.memory, "--threads": args.threads, "--lookahead": args.lookahead,
                  "--context": args.context, "--scalar": args.scalar or None,
                  "--speculative": getattr(args, "speculative", None)}
    given = [name for name, value in local_only.items() if value is not None]
    if given:
        raise _Usage(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the local model; the remote "
                     "server has its own")
    try:
        client = RemoteClient(remote_endpoint(settings))
    except RemoteError as exc:
        raise Failure(exc.message, exc.code) from None
    try:
        model = resolve_model(client)
        return _remote_turn(args, settings, signals, client, model)
    except RemoteError as exc:
        return _fail(f"{exc.message}; nothing was saved", exc.code)
    finally:
        client.close()


def remote_endpoint(settings: Any) -> Any:
    """The Endpoint of settings.remote, with the key from api_key_file or K3CHAT_API_KEY."""
    from .remote import Endpoint, read_api_key
    key = read_api_key(settings.api_key_file, os.environ)
    return Endpoint(url=settings.remote, model=settings.remote_model, api_key=key, ca_file=settings.remote_ca_file)


def _remote_turn(args: argparse.Namespace, settings: Any, signals: SignalStops, client: Any, model: str) -> int:
    from .conversation import sampler_settings
    from .remote import RemoteConversation

    store, info, system = _open_session(args)
    if signals.requested.is_set():
        return _fail("interrupted before the turn started; nothing was changed", EXIT_INTERRUPTED)
    created: SessionInfo | None = None
    try:
        if info is None:
            name = args.session or _session_name(args.prompt)
            try:
                info = created = store.create(name, model=model, unique_name=args.session is not None,
                                              numbered=args.session is None)
            except SessionExists as exc:
                return _fail(f"another k3chat created session {exc.info.name!r} ({exc.info.id}) after this run "
                             f"started; nothing was saved; continue it with --session {exc.info.id}")
            except (HistoryError, OSError) as exc:
                return _fail(f"cannot create the session: {exc}")
        try:
            conv = RemoteConversation(client, model, store, info.id, thinking=settings.thinking,
                                      effort=settings.effort, max_tokens=settings.max_tokens)
        except (HistoryError, OSError) as exc:
            return _fail(f"cannot load session {info.id}: {exc}")
        conv.sampler = sampler_settings(sampling=settings.sampling, temperature=settings.temperature,
                                        top_p=settings.top_p, top_k=settings.top_k, seed=settings.seed,
                                        records=conv.records)
        _err(f"session {info.name!r} ({info.id}): {client.endpoint.describe(model)}")
        return _run_turn(args, settings, store, info, created is not None, system, None, None, signals, 0,
                         conv=conv)
    finally:
        if created is not None:
            _discard_if_empty(store, created)


def _summary(result: Any, info: SessionInfo) -> None:
    if getattr(result, "pending", False):
        rate = ""
        if result.prefill_seconds > 0 and result.prefilled_tokens:
            rate = f" in {result.prefill_seconds:.1f} s ({result.prefilled_tokens / result.prefill_seconds:.0f} tok/s)"
        held = result.reused_tokens + result.prefilled_tokens
        _err(f"prefill stopped: {result.prefilled_tokens:,} prompt tokens read{rate}, {held:,} of "
             f"{result.prompt_tokens:,} held; the message is saved unanswered in session {info.name!r} "
             f"(continue with --session {info.id} --resume)")
        return
    speed = ""
    if result.decode_seconds > 0 and result.generated_tokens > 1:
        speed = f" ({(result.generated_tokens - 1) / result.decode_seconds:.1f} tokens/s)"
    status = " [interrupted]" if result.interrupted else ""
    saved = "saved to" if result.saved else "NOT saved to"
    _err(f"{result.generated_tokens} tokens generated{speed}{status}; {saved} session "
         f"{info.name!r} (continue with --session {info.id})")


# --------------------------------------------------------------------------- sessions


def _open_sessions_store(read_only: bool = False) -> HistoryStore:
    from .conversation import sweep_state_temps
    store = open_store(read_only=read_only)  # unlocks an encrypted history (the passphrase, once)
    try:
        sweep_state_temps()  # the history store sweeps its own directory when it opens
    except OSError as exc:
        _err(f"warning: stale state temp files not removed: {exc}")
    return store


def sessions_main(args: argparse.Namespace) -> int:
    from . import paths
    _tolerant_streams()
    actions = {"list": _sessions_list, "show": _sessions_show, "export": _sessions_export,
               "rename": _sessions_rename, "rm": _sessions_rm, "wipe": _sessions_wipe, "search": _sessions_search}
    if args.action in ("encrypt", "decrypt"):
        return _sessions_convert(args.action)
    try:
        # Reading needs no write access: a read-only home (or backup) can still be listed,
        # shown and exported.
        store = _open_sessions_store(read_only=args.action in ("list", "show", "export", "search"))
        return actions[args.action](store, args)
    except _Usage as exc:
        return usage_error(str(exc))
    except VaultError as exc:
        return _fail(str(exc), exc.exit_code)
    except (HistoryError, paths.UnsafePathError, OSError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)


def _stdout(text: str) -> None:
    """Text for the terminal (or a pipe): controls shown, never obeyed."""
    sys.stdout.write(for_terminal(text))
    sys.stdout.flush()


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
        _stdout(json_safe(json.dumps(doc, ensure_ascii=False, indent=1)) + "\n")
        return EXIT_OK
    if not infos:
        _err("no sessions")
        return EXIT_OK
    lines = [f"{'ID':<24}  {'UPDATED':<16}  {'MSGS':>4}  NAME"]
    lines += [f"{i.id:<24}  {_local(i.updated):<16}  {i.n_messages:>4}  {display_name(i.name)}" for i in infos]
    _stdout("\n".join(lines) + "\n")
    return EXIT_OK


def _sessions_show(store: HistoryStore, args: argparse.Namespace) -> int:
    info = _resolve(store, args.session)
    for problem in store.load(info.id).problems:
        _err(f"warning: {problem}")
    _stdout(store.export_text(info.id))
    return EXIT_OK


def _sessions_search(store: HistoryStore, args: argparse.Namespace) -> int:
    from .session_search import search_sessions
    try:
        result = search_sessions(store, args.text)
    except ValueError as exc:
        raise _Usage(f"sessions search: {exc}") from None
    if args.json:
        _stdout(json_safe(json.dumps([hit.to_json() for hit in result.hits], ensure_ascii=False, indent=1)) + "\n")
    elif result.hits:
        _stdout("".join(f"{hit.session.id}  {display_name(hit.session.name)}  ({hit.where}): {hit.snippet}\n"
                        for hit in result.hits))
    else:
        _err(f"no session mentions {args.text!r}")
    for problem in result.problems:
        _err(f"warning: {problem}")
    if result.problems:
        return _fail(f"{len(result.problems)} session(s) could not be searched; the matches above are from the rest")
    return EXIT_OK


def _output_problem(output: str | None, force: bool = False) -> str | None:
    """Why ``-o OUTPUT`` cannot be written (checked before any work), or None."""
    if not output:
        return None
    target = Path(output)
    if target.exists() and not target.is_dir() and not force:
        return f"-o {output} already exists; nothing was written: give another name, or --force to replace it"
    if target.is_dir():
        return f"-o {output} is a directory; give a file name, e.g. -o {target / 'session.md'}"
    if not target.parent.is_dir():
        return f"-o {output}: the directory {target.parent} does not exist"
    return None


def _sessions_export(store: HistoryStore, args: argparse.Namespace) -> int:
    from . import paths
    problem = _output_problem(args.output, args.force)
    if problem is not None:
        raise _Usage(problem)
    info = _resolve(store, args.session)
    code = EXIT_OK
    if args.format == "jsonl":
        text, warnings = store.export_peer_jsonl_checked(info.id)
        for warning in warnings:
            _err(f"warning: {warning}")
        if any(w.startswith("damaged line") for w in warnings):
            # The peer would be given a different conversation without knowing it.
            code = _fail(f"the export of session {info.id} is incomplete: damaged lines were left out", EXIT_RUNTIME)
    else:
        for problem in store.load(info.id).problems:
            _err(f"warning: {problem} (noted in the export)")
        text = {"md": store.export_markdown, "json": store.export_json}[args.format](info.id)
    if args.output:
        try:
            paths.atomic_write(Path(args.output), text.encode("utf-8"), replace=args.force)
        except FileExistsError:
            return usage_error(f"-o {args.output} appeared while exporting; nothing was written: give another "
                               "name, or --force to replace it")
        except OSError as exc:
            return _fail(f"cannot write {args.output}: {exc.strerror or exc}; nothing was written")
        _err(f"wrote {args.output} (mode 0600)")
        if store.vault is not None:
            _err(f"note: {args.output} is plaintext: the history is encrypted, this export is not")
    else:
        _stdout(text)
    return code


def _sessions_rename(store: HistoryStore, args: argparse.Namespace) -> int:
    from .history import _check_name
    info = _resolve(store, args.session)
    try:
        _check_name(args.name)
    except HistoryError as exc:
        raise _Usage(str(exc)) from None
    try:
        renamed = store.rename(info.id, args.name)
    except NameTaken as exc:
        raise _Usage(str(exc)) from None  # a usage problem: another name works
    _err(f"renamed {info.id}: {info.name!r} -> {renamed.name!r}")
    return EXIT_OK


def _confirmed(info: SessionInfo, args: argparse.Namespace, verb: str) -> bool:
    """--yes, or a "y" typed at the terminal; without a terminal, --yes is required."""
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise _Usage(f"refusing to {verb} session {info.name!r} without --yes")
    try:
        answer = input(for_terminal(f"{verb.capitalize()} session {info.name!r} ({info.id}, {info.n_messages} "
                                    "messages)? [y/N] "))
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def _sessions_rm(store: HistoryStore, args: argparse.Namespace) -> int:
    from .conversation import delete_state
    info = _resolve(store, args.session)
    if not _confirmed(info, args, "delete"):
        _err("not deleted")
        return EXIT_OK
    store.delete(info.id)  # also removes temp copies of the session file
    delete_state(info.id)  # the state file and its temp copies
    _err(f"deleted session {info.name!r} ({info.id})")
    return EXIT_OK


def _sessions_convert(action: str) -> int:
    """`sessions encrypt` / `sessions decrypt`: the whole history, one atomic file at a time."""
    from . import paths
    from .vault_convert import decrypt_history, encrypt_history

    try:
        if action == "encrypt":
            report = encrypt_history()
        else:
            done = decrypt_history()
            if done is None:
                _err("the history is not encrypted; nothing to do")
                return EXIT_OK
            report = done
    except VaultError as exc:
        return _fail(str(exc), exc.exit_code)
    except (HistoryError, paths.UnsafePathError, OSError) as exc:
        return _fail(f"{action} stopped: {exc}; every file is either converted or as it was: fix the "
                     f"cause and run `k3chat sessions {action}` again")
    except KeyboardInterrupt:
        return _fail(f"interrupted: every file is either converted or as it was; run `k3chat sessions "
                     f"{action}` again to finish", EXIT_INTERRUPTED)
    for note in report.notes:
        _err(f"warning: {note}")
    _err(_conversion_summary(action, report))
    return EXIT_OK


def _conversion_summary(action: str, report: Any) -> str:
    done = f"{action}ed {report.sessions} session(s) and {report.states} engine state file(s)"
    skipped = report.sessions_skipped + report.states_skipped
    if skipped:
        done += f" ({skipped} file(s) were already {action}ed)"
    if action == "decrypt":
        return done + "; the history is plaintext again and the key file is removed"
    return (done + "; from now on every command asks for the passphrase (or reads K3CHAT_PASSPHRASE_FILE). "
            "Copies of the replaced plaintext files may remain in the disk's free space")


def _sessions_wipe(store: HistoryStore, args: argparse.Namespace) -> int:
    from . import paths
    from .conversation import state_path
    from .history import temp_copies, wipe_caveat, wipe_file
    info = _resolve(store, args.session)
    if not _confirmed(info, args, "wipe"):
        _err("not wiped")
        return EXIT_OK
    caveat = wipe_caveat(store.root)  # asked before the files are gone
    wiped = store.wipe(info.id)  # the session file, its temp copies, its index entry
    state = state_path(info.id)
    state_files = [p for p in (state, *temp_copies(state.parent, state.name)) if wipe_file(p)]
    if state_files:
        paths.fsync_dir(state.parent)  # the unlinks, durable
    wiped += state_files
    _err(f"wiped session {info.name!r} ({info.id}): {len(wiped)} file(s) overwritten with zeros, synced and "
         "deleted, and its index entry removed")
    _err(f"note: {caveat}")
    return EXIT_OK


__all__ = ["run_chat", "sessions_main", "default_model_dir", "usage_error", "find_session"]

"""`k3chat` command line: subcommands and their documented exit codes.

Exit codes: 0 success (a chat answer cut at the token limit is still a success: it is saved,
marked interrupted, and the limit is said); 1 runtime failure, including a malformed answer
(saved, marked interrupted, the reason printed); 2 usage or config/checkpoint error, or a
memory plan that cannot fit; 4 expert read failure; 5 interrupted (Ctrl-C or SIGTERM).

To add a subcommand: an ``_add_NAME(sub)`` that declares it, a ``cmd_NAME(args) -> int``, and
an entry in COMMANDS.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .restart import RestartRequest
    from .settings import Settings

from k3engine.exit_codes import EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from k3engine.limits import positive_arg

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_RUNTIME", "EXIT_USAGE", "EXIT_EXPERT_IO", "EXIT_INTERRUPTED"]


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with the usage line (its default) but never prints a traceback."""


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids must be comma-separated integers, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--ids needs at least one id")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("--ids must be non-negative")
    return ids


def _add_remote_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote", metavar="URL", default=None,
                   help="chat with an OpenAI-compatible server (vLLM, SGLang, k3chat serve) at URL instead of a "
                        "local model; default: `remote` in config.toml")
    p.add_argument("--model", dest="remote_model", metavar="NAME", default=None,
                   help="--remote: the model to ask for (default: the server's first)")
    p.add_argument("--api-key-file", metavar="F", default=None,
                   help="--remote: a file whose first line is the API key (default: K3CHAT_API_KEY)")
    p.add_argument("--remote-ca-file", metavar="F", default=None,
                   help="--remote: verify the server's TLS certificate with this CA (PEM) instead of the system's")


SPECULATIVE_HELP = ("exact speculative decoding: verify up to N tokens drafted from the conversation "
                    "itself in one pass (0 = off, the default; config key `speculative`); the "
                    "output is the same, only the speed changes")


def _add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="one-shot generation: a chat turn (--prompt) or raw ids (--ids)")
    r.add_argument("model_dir", nargs="?", default=None,
                   help="checkpoint directory (config.json, shards, index); default: `model` in config.toml")
    r.add_argument("--demo", action="store_true", help="use the built-in demo model")
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--ids", type=_ids, help="prompt as comma-separated token ids (no tokenizer, no chat format)")
    what.add_argument("--prompt", help="a chat message; the answer is saved to the session ('-': read it from "
                                       "standard input)")
    what.add_argument("--prompt-file", metavar="PATH", help="read the chat message from this UTF-8 text file")
    what.add_argument("--resume", action="store_true",
                      help="answer the unanswered last message of --session (after a crash)")
    r.add_argument("--gen", type=positive_arg, default=None, help="--ids only: tokens to generate (default 16)")
    r.add_argument("--file", dest="files", action="append", metavar="PATH", default=None,
                   help="attach this file to the message (repeatable): text, Markdown, source code, CSV/TSV, JSON "
                        "or PDF, up to 16 MiB each")
    r.add_argument("--system", help="system message (starts a new session)")
    think = r.add_mutually_exclusive_group()
    think.add_argument("--thinking-effort", choices=("low", "high", "max"), default=None,
                       help="reasoning effort (default max, or config.toml)")
    think.add_argument("--no-think", action="store_true", help="answer without reasoning")
    # Sampler values are checked by settings.merge_cli, which names the option in its message.
    r.add_argument("--temperature", metavar="X", help="sampling temperature (> 0); implies sampling")
    r.add_argument("--top-p", metavar="P", help="nucleus mass (0 < P <= 1); implies sampling")
    r.add_argument("--top-k", metavar="K", help="keep the K likeliest ids (0 = off); implies sampling")
    r.add_argument("--seed", metavar="N", help="sampling seed (0..2^64-1); implies sampling")
    r.add_argument("--session", metavar="NAME", help="continue this session (id or name); created if new")
    r.add_argument("--max-tokens", metavar="N", help="per-turn generation limit (default 4096)")
    r.add_argument("--speculative", metavar="N", help=SPECULATIVE_HELP)
    r.add_argument("--context", type=positive_arg, default=None, metavar="N",
                   help="context limit in positions, also what the memory plan is sized for "
                        "(default 8192, capped at the model's limit)")
    r.add_argument("--json", dest="json_out", help="write the result as JSON to this file")
    r.add_argument("--threads", type=positive_arg, default=None, help="compute threads (default: all cores; one for a model as small as the demo)")
    r.add_argument("--scalar", action="store_true", help="force the portable scalar kernels")
    r.add_argument("--memory", metavar="X", default=None,
                   help="memory budget: 12G, a preset (small, medium, large, huge), auto, or all "
                        "(every weight resident, no plan); default: config.toml, else auto")
    r.add_argument("--lookahead", type=int, default=None, metavar="N",
                   help="experts per token prefetched for the next layer (default: top-k; 0 = off)")
    _add_remote_options(r)


def _add_sessions(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("sessions", help="list, search, show, export, rename, delete, wipe or encrypt saved "
                                        "conversations")
    ss = s.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = ss.add_parser("list", help="all sessions, most recent first")
    ls.add_argument("--json", action="store_true", help="print JSON")
    se = ss.add_parser("search", help="find TEXT in every session, in messages and reasoning (case-insensitive), "
                                      "with the text around each match")
    se.add_argument("text", metavar="TEXT", help="the text to look for (taken literally)")
    se.add_argument("--json", action="store_true", help="print JSON: one object per match")
    show = ss.add_parser("show", help="print a session as readable text")
    show.add_argument("session", help="session id or name")
    ex = ss.add_parser("export", help="write a session as Markdown, JSON or peer JSONL")
    ex.add_argument("session", help="session id or name")
    ex.add_argument("--format", choices=("md", "json", "jsonl"), default="md",
                    help="md (default: Markdown to read; links and images shown as text), json (everything, "
                         "metadata included) or jsonl (one message per line: role, content, reasoning)")
    ex.add_argument("-o", "--output", help="file to write (private, 0600); default: standard output")
    ex.add_argument("--force", action="store_true", help="replace the -o file if it exists (default: refuse)")
    rn = ss.add_parser("rename", help="rename a session (names are unique)")
    rn.add_argument("session", help="session id or name")
    rn.add_argument("name", help="the new name")
    rm = ss.add_parser("rm", help="delete a session and its saved engine state")
    rm.add_argument("session", help="session id or name")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    ss.add_parser("encrypt", help="encrypt the history at rest under a new passphrase (asked twice, or "
                                  "K3CHAT_PASSPHRASE_FILE); converts every session; run again to resume")
    ss.add_parser("decrypt", help="turn encryption off: convert the whole history back to plaintext")
    wp = ss.add_parser("wipe", help="overwrite a session and its engine state with zeros, then delete them "
                                    "(says what an overwrite cannot promise on this disk)")
    wp.add_argument("session", help="session id or name")
    wp.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("chat", help="the full-screen chat app (keyboard first; f1 lists the keys)")
    c.add_argument("model_dir", nargs="?", default=None,
                   help="checkpoint directory; default: `model` in config.toml")
    c.add_argument("--demo", action="store_true",
                   help="chat with the built-in demo model (also the default when no model is configured)")
    c.add_argument("--session", metavar="NAME", help="resume this session (id or name); a new name starts one")
    c.add_argument("--memory", metavar="X", default=None,
                   help="memory budget: 12G, a preset (small, medium, large, huge), auto, or all; "
                        "default: config.toml, else auto")
    think = c.add_mutually_exclusive_group()
    think.add_argument("--thinking-effort", choices=("low", "high", "max"), default=None,
                       help="reasoning effort (default max, or config.toml)")
    think.add_argument("--no-think", action="store_true", help="answer without reasoning")
    # Given here, these win over a resumed session's stored settings for this run (not stored).
    c.add_argument("--temperature", metavar="X", help="sampling temperature (> 0); implies sampling")
    c.add_argument("--top-p", metavar="P", help="nucleus mass (0 < P <= 1); implies sampling")
    c.add_argument("--top-k", metavar="K", help="keep the K likeliest ids (0 = off); implies sampling")
    c.add_argument("--seed", metavar="N", help="sampling seed (0..2^64-1); implies sampling")
    c.add_argument("--max-tokens", metavar="N", help="per-turn generation limit (default 4096)")
    c.add_argument("--speculative", metavar="N", help=SPECULATIVE_HELP)
    c.add_argument("--context", type=positive_arg, default=None, metavar="N",
                   help="context in positions that the memory plan is sized for (default: the planner's, 8192)")
    c.add_argument("--threads", type=positive_arg, default=None, help="compute threads (default: all cores; one for a model as small as the demo)")
    _add_remote_options(c)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from .server.serve import add_arguments  # argparse only: the HTTP stack loads in cmd_serve
    add_arguments(sub.add_parser("serve", help="serve the model on an OpenAI-compatible HTTP API (loopback only "
                                               "by default)"))


def _add_verify(sub: argparse._SubParsersAction) -> None:
    from .verify import add_arguments
    add_arguments(sub.add_parser("verify", help="check a downloaded checkpoint: every shard's size "
                                                "and SHA-256, every header, the index"))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="k3chat", description="Private, local chat with Kimi K3.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_sessions(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_verify(sub)
    helps = {"fixture": "write a test checkpoint (presets: tiny, wide)",
             "eval-demo": "score the built-in demo model on held-out questions (C engine)",
             "train-demo": "retrain the built-in demo model (needs pip install '.[train]')",
             "plan": "print the memory plan for a model and budget, before loading anything",
             "doctor": "this machine: CPU, memory, disk and its direct-I/O read bandwidth",
             "bench": "measure streaming speed on a checkpoint with the real expert size"}
    for name, text in helps.items():
        sub.add_parser(name, help=text, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return p


# One function per subcommand; each returns the exit code.


def cmd_run(args: argparse.Namespace) -> int:
    from .chat_cli import run_chat, usage_error
    if args.remote is not None and (args.demo or args.model_dir is not None or args.ids is not None):
        return usage_error("--remote chats with a server's model: give no MODEL_DIR, --demo or --ids with it")
    if args.remote is None and (args.remote_model, args.api_key_file, args.remote_ca_file) != (None, None, None):
        return _remote_needed(args, run_chat)
    if args.demo:
        if args.model_dir is not None:
            return usage_error("give MODEL_DIR or --demo, not both")
        from .demo import model_dir as demo_model_dir
        args.model_dir = str(demo_model_dir())
    if args.ids is None:
        return run_chat(args)
    chat_only = {"--system": args.system, "--session": args.session, "--temperature": args.temperature,
                 "--top-p": args.top_p, "--top-k": args.top_k, "--seed": args.seed,
                 "--max-tokens": args.max_tokens, "--thinking-effort": args.thinking_effort,
                 "--no-think": args.no_think or None, "--context": args.context, "--file": args.files,
                 "--speculative": args.speculative}
    given = [name for name, value in chat_only.items() if value is not None]
    if given:
        return usage_error(f"{', '.join(given)} need --prompt (--ids runs raw ids, greedy; use --gen for its length)")
    if args.model_dir is None:
        from .chat_cli import default_model_dir
        model_dir = default_model_dir()
        if isinstance(model_dir, int):
            return model_dir
        args.model_dir = str(model_dir)
    if args.gen is None:
        args.gen = 16
    from .runtime import Failure, model_directory, say
    try:
        model_dir, note = model_directory(args.model_dir)
    except Failure as exc:
        return usage_error(exc.message)
    if note:
        say(note)
    args.model_dir = str(model_dir)
    from .run_ids import run_ids
    return run_ids(args)


def _remote_needed(args: argparse.Namespace, then: "Callable[[argparse.Namespace], int]") -> int:
    """--model / --api-key-file without --remote: fine when config.toml names a remote."""
    from .chat_cli import usage_error
    from .settings import SettingsError, load_settings
    try:
        configured = load_settings().remote
    except SettingsError as exc:
        return usage_error(str(exc))
    if configured is None or args.demo or args.model_dir is not None:
        return usage_error("--model, --api-key-file and --remote-ca-file are for --remote (or `remote` in config.toml)")
    return then(args)


def cmd_sessions(args: argparse.Namespace) -> int:
    from .chat_cli import sessions_main
    return sessions_main(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat_cli import usage_error
    from .settings import SettingsError, load_settings, merge_cli

    if args.demo and args.model_dir is not None:
        return usage_error("give MODEL_DIR or --demo, not both")
    if args.remote is not None and (args.demo or args.model_dir is not None):
        return usage_error("--remote chats with a server's model: give no MODEL_DIR or --demo with it")
    if args.remote is None and (args.remote_model, args.api_key_file, args.remote_ca_file) != (None, None, None):
        return _remote_needed(args, _chat_with_configured_remote)
    overrides = {
        "model": args.model_dir,
        "memory": args.memory,
        "effort": args.thinking_effort,
        "thinking": False if args.no_think else (True if args.thinking_effort else None),
        **chat_sampler_options(args),
        "speculative": args.speculative,
        "remote": args.remote,
        "remote_model": args.remote_model,
        "api_key_file": args.api_key_file,
        "remote_ca_file": args.remote_ca_file,
    }
    try:
        settings = merge_cli(load_settings(), overrides)
    except SettingsError as exc:
        return usage_error(str(exc))
    if args.demo or args.model_dir is not None:
        settings = replace(settings, remote=None)  # a model on the command line beats a configured remote
    if settings.remote is not None:
        return _chat_remote(args, settings)
    return _chat_local(args, settings)


def chat_sampler_options(args: argparse.Namespace) -> dict[str, str | None]:
    """`chat`'s sampler options as Settings fields (None: not given)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            "max_tokens": args.max_tokens}


def sampler_given(args: argparse.Namespace) -> frozenset[str]:
    """The Settings fields the command line chose: they win over a resumed session's stored
    ones for this run. A sampler value means sampling (merge_cli), so that is chosen too."""
    given = {name for name, value in chat_sampler_options(args).items() if value is not None}
    if given - {"max_tokens"}:
        given.add("sampling")
    return frozenset(given)


def _chat_with_configured_remote(args: argparse.Namespace) -> int:
    from .chat_cli import usage_error
    from .settings import SettingsError, load_settings
    try:
        args.remote = load_settings().remote
    except SettingsError as exc:
        return usage_error(str(exc))
    return cmd_chat(args)


def _chat_remote(args: argparse.Namespace, settings: object) -> int:
    """The app on a remote model (k3chat.remote): the same app, sessions and history."""
    from urllib.parse import urlsplit

    from .app.engine import open_remote_engine
    from .chat_cli import remote_endpoint, usage_error
    from .remote import RemoteError

    local_only = {"--memory": args.memory, "--threads": args.threads, "--context": args.context,
                  "--speculative": args.speculative}
    given = [name for name, value in local_only.items() if value is not None]
    if given:
        return usage_error(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the local model; the "
                           "remote server has its own")
    try:
        endpoint = remote_endpoint(settings)
    except RemoteError as exc:
        return usage_error(exc.message) if exc.code == EXIT_USAGE else exc.code
    where = Path(f"the server at {urlsplit(endpoint.url).netloc}")  # what "Opening ..." names

    def factory(_dir: object, _settings: object, progress: Callable[[str], None]) -> object:
        return open_remote_engine(endpoint, progress)

    return _run_app(args, settings, where, factory, configured_model=None)


def _chat_local(args: argparse.Namespace, settings: "Settings") -> int:
    from .chat_cli import usage_error
    from .runtime import Failure, memory_option
    try:
        memory = memory_option(args.memory, settings.memory)
    except Failure as exc:
        return usage_error(exc.message)
    configured_model = settings.model
    if settings.model is None:
        args.demo = True  # nothing configured: the built-in demo model
    elif not args.demo:
        from .runtime import model_directory, say
        try:
            model_dir, note = model_directory(settings.model)  # before the screen is taken over
        except Failure as exc:
            return usage_error(exc.message)
        if note:
            say(note)  # stays on the terminal below the app's screen
        settings = replace(settings, model=model_dir)
    return _run_app(args, settings, None if args.demo else settings.model, None, configured_model,
                    memory=memory)


def _run_app(args: argparse.Namespace, settings: "Settings", model: object, factory: object,
             configured_model: object, *, memory: str | None = None) -> int:
    from .app import AppUsageError, build_app
    from .chat_cli import usage_error
    from .history import HistoryError
    from .paths import UnsafePathError
    from .vault import VaultError

    try:
        app = build_app(model, settings=settings, demo=args.demo, engine_factory=factory,  # type: ignore[arg-type]
                        session=args.session, memory=memory, threads=args.threads, context=args.context,
                        thinking_given=bool(args.no_think or args.thinking_effort),
                        sampler_given=sampler_given(args))
    except AppUsageError as exc:
        return usage_error(str(exc))
    except VaultError as exc:  # the passphrase is asked here, before the screen starts
        print(f"k3chat: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("k3chat: interrupted before the app started", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (HistoryError, UnsafePathError, OSError) as exc:
        print(f"k3chat: cannot open the history: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    problem = terminal_problem()
    if problem is not None:
        return usage_error(problem)
    app.resume_command = _resume_command(args, settings.model, configured_model, settings.remote)
    code = app.run()
    if app.load_error:
        from .app.text import neutralise
        print(f"k3chat: cannot open the model: {neutralise(app.load_error)}", file=sys.stderr)
    from .display import for_terminal
    for line in app.goodbye():  # how to resume, and what could not be saved
        print(for_terminal(line), file=sys.stderr)
    if app.restart is not None:  # the user chose a larger context for a message that did not fit
        return _restart(getattr(args, "argv", sys.argv[1:]), app.restart, app.store.vault)
    return int(code if code is not None else (app.return_code or EXIT_OK))


def _restart(argv: Sequence[str], request: "RestartRequest", sealer: object) -> int:
    """Hand the unsent message over (k3chat.restart) and execute `k3chat` again with the new
    context and memory; returns only if that failed (the message then waits for the next start)."""
    import shlex

    from .restart import hand_over, restart_argv

    new = restart_argv(argv, request)
    try:
        hand_over(request.draft, sealer)  # type: ignore[arg-type]
    except OSError as exc:
        print(f"k3chat: cannot keep the message for the restart ({exc}); start again with: "
              f"k3chat {shlex.join(new)}", file=sys.stderr)
        return EXIT_RUNTIME
    print(f"k3chat: starting again with: k3chat {shlex.join(new)}", file=sys.stderr)
    sys.stderr.flush()
    try:
        _reexec(new)
    except OSError as exc:
        print(f"k3chat: could not start again ({exc}); run: k3chat {shlex.join(new)} (your message comes back "
              "in the input)", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK  # not reached: the process is replaced


def _reexec(argv: Sequence[str]) -> None:
    """Replace this process with `python -m k3chat ARGV` (the same interpreter and package)."""
    os.execv(sys.executable, [sys.executable, "-m", "k3chat", *argv])


def terminal_problem() -> str | None:
    """Why the full-screen app cannot run here, or None. Textual reads keys from standard
    input and draws on standard error: without a terminal on both it would start anyway and
    spin, waiting for keys that never come."""
    missing = [name for name, stream in (("standard input", sys.stdin), ("standard error", sys.stderr))
               if stream is None or not _isatty(stream)]
    if not missing:
        return None
    return (f"the chat app is full-screen and needs a terminal, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not one (redirected, piped or closed). Run it in a "
            "terminal; for one answer from a script use: k3chat run --prompt TEXT")


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        return False


def _resume_command(args: argparse.Namespace, model: object, configured: object, remote: object = None) -> str:
    """`k3chat chat ...` as it must be typed to reach the same model again (less --session)."""
    import shlex

    parts = ["k3chat", "chat"]
    if args.remote is not None:
        parts += ["--remote", shlex.quote(str(remote or args.remote))]
        if args.remote_model is not None:
            parts += ["--model", shlex.quote(args.remote_model)]
    elif args.demo and configured is not None:
        parts.append("--demo")
    elif args.model_dir is not None and model is not None:
        parts.append(shlex.quote(str(model)))
    return " ".join(parts)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.serve import main_serve
    return main_serve(args)


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import main_verify
    return main_verify(args)


COMMANDS = {"run": cmd_run, "sessions": cmd_sessions, "chat": cmd_chat, "serve": cmd_serve,
            "verify": cmd_verify}


def _passthrough() -> dict[str, str]:
    """Subcommands with their own parsers: name -> 'module:function' taking argv."""
    return {"fixture": "k3engine.fixture:main", "plan": "k3engine.planner:main_plan",
            "doctor": "k3engine.doctor:main_doctor", "bench": "k3engine.bench:main_bench",
            "eval-demo": "k3chat.demo.evaluate:main", "train-demo": "k3chat.demo.train:main"}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; a Ctrl-C that arrives before a command has its own handling (while
    Python is still importing) exits 5 with one line, never a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        try:
            sys.stderr.write("\nk3chat: interrupted\n")
        except (OSError, ValueError):
            pass
        return EXIT_INTERRUPTED


def unknown_option(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.ArgumentParser, str] | None:
    """The first option the (sub)command does not know, named with the closest one it does,
    and that command's parser (for its usage line). argparse checks required options first,
    so `run --promt hi` would only hear that --prompt is missing. Unambiguous abbreviations
    (`--prom`) are left to argparse, which accepts them."""
    import difflib

    words, rest = ["k3chat"], list(argv)
    while True:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        command = next((t for t in rest if not t.startswith("-")), None)
        if not subparsers or command is None or command not in subparsers[0].choices:
            break
        parser = subparsers[0].choices[command]
        words.append(command)
        rest = rest[rest.index(command) + 1:]
    if len(words) == 1:
        return None
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    for token in rest:
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if name in parser._option_string_actions or any(o.startswith(name) for o in known):
            continue  # known, or an abbreviation argparse resolves (or calls ambiguous itself)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)  # a likely typo, not any option
        hint = f" (did you mean {close[0]}?)" if close else ""
        where = " ".join(words)
        return parser, f"{where}: unknown option {name}{hint}; see {where} --help"
    return None


def _main(argv: Sequence[str] | None) -> int:
    import importlib

    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if args_list and args_list[0] in _passthrough():
        module, fn = _passthrough()[args_list[0]].split(":")
        return int(getattr(importlib.import_module(module), fn)(args_list[1:]))
    unknown = unknown_option(parser, args_list)
    if unknown is not None:
        command_parser, problem = unknown
        command_parser.print_usage(sys.stderr)
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: 2 on usage errors, 0 for --help
        return int(exc.code or 0)
    args.argv = args_list  # `chat` starts itself again with them (k3chat.restart)
    handler = COMMANDS.get(args.command)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())

"""`k3chat serve`: open the model through the runtime, bind, serve until a signal.

Loopback only unless another address is asked for; then a warning, and an API key file is
required (a server reachable from other machines answers nobody without the key). The key
file must be private to its owner, like every k3chat file. Signals go through the runtime's
StopPolicy: the first SIGTERM or SIGINT finishes the step in flight, answers what it can and
exits; a second aborts the step in flight; a third exits at once (5).

Exit codes: 0 after a clean stop, 5 when a stop cut an answer short, 2 for options, the
key file or the checkpoint, 1 when the address cannot be bound, 4 for an expert read failure
at open.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import stat
import sys
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any

from k3engine.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from k3engine.limits import positive_arg, speculative_arg

from ..runtime import Failure, StopPolicy, one_at_a_time, open_model, say

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 8
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", default=None,
                   help="checkpoint directory; default: `model` in config.toml")
    p.add_argument("--demo", action="store_true", help="serve the built-in demo model")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}, this machine only); any other "
                        "address needs --api-key-file")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free)")
    p.add_argument("--api-key-file", metavar="F",
                   help="file holding the API key clients must send (Authorization: Bearer KEY); mode 0600")
    p.add_argument("--memory", metavar="X", default=None,
                   help="memory budget: 12G, a preset (small, medium, large, huge), auto, or all; "
                        "default: config.toml, else auto")
    p.add_argument("--context", type=positive_arg, default=None, metavar="N",
                   help="positions per request (prompt + answer), what the memory plan is sized for "
                        "(default 8192, capped at the model's limit)")
    p.add_argument("--threads", type=positive_arg, default=None, help="compute threads (default: all cores; one for a model as small as the demo)")
    p.add_argument("--queue", type=positive_arg, default=DEFAULT_QUEUE, metavar="N",
                   help=f"requests that may wait for the engine; more get 503 (default {DEFAULT_QUEUE})")
    p.add_argument("--speculative", type=speculative_arg, default=None, metavar="N",
                   help="exact speculative decoding: verify up to N tokens drafted from each conversation in "
                        "one pass (0 = off; default: config.toml, else 0); answers are the same")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be a number from 0 to 65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be from 0 to 65535, got {value}")
    return value


# --------------------------------------------------------------------------- checks before opening


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and `localhost` count: a name is never looked up."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_api_key(path: str) -> bytes:
    """The key from a file only its owner can read; a Failure (exit 2) says what to fix."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise Failure(f"--api-key-file {path} is not a regular file", EXIT_USAGE)
        if st.st_mode & 0o077:
            raise Failure(f"--api-key-file {path} can be read by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                          f"make it private: chmod 600 {path}", EXIT_USAGE)
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise Failure(f"cannot read --api-key-file {path}: {exc.strerror or exc}", EXIT_USAGE) from None
    key = raw.strip()
    if not key:
        raise Failure(f"--api-key-file {path} is empty; put the key on its first line", EXIT_USAGE)
    if b"\n" in key or any(c < 0x21 or c > 0x7E for c in key):
        raise Failure(f"--api-key-file {path}: the key must be one line of printable ASCII without spaces",
                      EXIT_USAGE)
    return key


def _model_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """(checkpoint directory, the model id clients name)."""
    if args.demo:
        if args.model_dir is not None:
            raise Failure("give MODEL_DIR or --demo, not both", EXIT_USAGE)
        from ..demo import model_dir as demo_model_dir
        return demo_model_dir(), "k3chat-demo"
    if args.model_dir is None:
        from ..settings import SettingsError, load_settings
        try:
            configured = load_settings().model
        except SettingsError as exc:
            raise Failure(str(exc), EXIT_USAGE) from None
        if configured is None:
            raise Failure("MODEL_DIR is required (or --demo, or set `model` in config.toml)", EXIT_USAGE)
        args.model_dir = configured
    path = Path(args.model_dir)
    return path, path.resolve().name or str(path)


def _memory(args: argparse.Namespace) -> str:
    from ..runtime import memory_option
    from ..settings import SettingsError, load_settings
    if args.memory is not None:
        return memory_option(args.memory, "auto")
    try:
        return load_settings().memory
    except SettingsError as exc:
        raise Failure(str(exc), EXIT_USAGE) from None


def _speculative_setting(args: argparse.Namespace) -> int:
    from ..settings import SettingsError, load_settings
    if args.speculative is not None:
        return int(args.speculative)
    try:
        return load_settings().speculative
    except SettingsError as exc:
        raise Failure(str(exc), EXIT_USAGE) from None


def _context(args: argparse.Namespace, model_dir: Path) -> int:
    from ..conversation import default_context, model_max_positions
    if args.context is None:
        return default_context(model_dir)
    limit = model_max_positions(model_dir)
    if limit is not None and args.context > limit:
        raise Failure(f"--context {args.context:,} is more than the model's max_position_embeddings ({limit:,})",
                      EXIT_USAGE)
    return int(args.context)


def _check_binding(args: argparse.Namespace) -> bytes | None:
    key = read_api_key(args.api_key_file) if args.api_key_file else None
    if not is_loopback(args.host):
        if key is None:
            raise Failure(f"--host {args.host} would make the server reachable from other machines; that needs "
                          "--api-key-file F (a private file with the key clients must send), or keep the "
                          f"default --host {DEFAULT_HOST}", EXIT_USAGE)
        say(f"warning: listening on {args.host}, reachable from other machines; every request needs the API key "
            "and travels unencrypted (put a TLS proxy in front for anything but a trusted network)")
    return key


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, reuse_port=False)
    except OSError as exc:
        raise Failure(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                      + ("; give another --port (0 picks a free one)" if exc.errno == 98 else ""),
                      EXIT_RUNTIME) from None


# --------------------------------------------------------------------------- serving


def _server_class() -> Any:
    import uvicorn

    class StoppableServer(uvicorn.Server):
        """uvicorn with our stop policy in place of its signal handling (which would re-raise
        the signal at the end and so turn a clean stop into a death by SIGTERM)."""

        def __init__(self, config: uvicorn.Config, policy: StopPolicy) -> None:
            super().__init__(config)
            self.policy = policy

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            import threading
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {}
            handler = one_at_a_time(self.handle_exit)  # a second signal inside the first waits its turn
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    old[sig] = signal.signal(sig, handler)
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            level = self.policy.request()
            self.should_exit = True
            if level == 1:
                say("stopping: refusing new requests, finishing the step in flight and answering what it has "
                    "(again to abort the step)")
            elif level == 2:
                say("aborting the step in flight (a third signal exits at once)")

    return StoppableServer


def _exit_now() -> None:
    try:
        os.write(2, b"k3chat: stopped at once\n")
    finally:
        os._exit(EXIT_INTERRUPTED)


def _pool_budget(opened: Any, cfg: Any, context: int) -> int:
    """The room the memory plan set aside for turn snapshots (one full state at the context):
    the server spends it on saved states for prefix reuse instead."""
    from k3engine.planner import snapshot_bytes
    if opened.plan is not None:
        return int(opened.plan.snapshot_bytes)
    return snapshot_bytes(cfg, context)


def serve(args: argparse.Namespace) -> int:
    key = _check_binding(args)
    model_dir, model_id = _model_dir(args)
    memory = _memory(args)
    context = _context(args, model_dir)
    args.speculative = _speculative_setting(args)
    policy = StopPolicy(exit_now=_exit_now)
    opened = open_model(model_dir, memory=memory, context=context, threads=args.threads, progress=say,
                        speculative=args.speculative)
    try:
        return _serve_opened(args, opened, model_id, context, key, policy)
    finally:
        opened.close()


def _serve_opened(args: argparse.Namespace, opened: Any, model_id: str, context: int, key: bytes | None,
                  policy: StopPolicy) -> int:
    import uvicorn
    from k3engine.config import load_config
    from k3engine.planner import snapshot_bytes

    from .app import Service, create_app
    from .worker import EngineWorker

    cfg = load_config(opened.model_dir)
    worker = EngineWorker(opened.model, opened.tokenizer, context=context,
                          pool_budget=_pool_budget(opened, cfg, context),
                          state_size=lambda n: snapshot_bytes(cfg, n), queue_limit=args.queue,
                          speculative=args.speculative)
    policy.bind(after_step=worker.stop_after_step, abort_step=worker.abort_step)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(Service(worker, opened.tokenizer, model_id, context, key,
                                                      plan_bytes=opened.plan.total if opened.plan else None)),
                            log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=30)
    server = _server_class()(config, policy)
    worker.start()
    shown = f"[{args.host}]" if ":" in args.host else args.host
    drafts = f", speculative {args.speculative}" if args.speculative else ""
    say(f"serving {model_id} on http://{shown}:{port}/v1 (OpenAI API; context {context}{drafts}, "
        f"{'API key required' if key else 'no API key'}); Ctrl-C or SIGTERM stops")
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop_after_step()
        worker.close()
        sock.close()
    if worker.cut_short:
        say(f"stopped; {worker.cut_short} answer(s) were cut short")
        return EXIT_INTERRUPTED
    say("stopped")
    return EXIT_OK


def main_serve(args: argparse.Namespace) -> int:
    try:
        return serve(args)
    except Failure as exc:
        say(exc.message)
        return exc.code
    except KeyboardInterrupt:
        say("interrupted before the server started")
        return EXIT_INTERRUPTED


__all__ = ["add_arguments", "main_serve", "is_loopback", "read_api_key"]

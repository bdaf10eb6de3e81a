"""The `k3chat` console script's entry point, kept apart from k3chat.cli on purpose.

Python turns a Ctrl-C into KeyboardInterrupt from its first instruction, so a Ctrl-C while
the interpreter is still importing our modules (the first tens of milliseconds) used to end
in a traceback. This module installs a quiet handler before importing anything else of ours:
until a command installs its own handling (runtime.SignalStops, the app's), a SIGINT exits 5
with one line. Nothing has been done yet at that point, so exiting at once loses nothing.
Only the console script imports this module: importing k3chat as a library changes no
signal handling.
"""

import os
import signal
import sys


def _early_interrupt(signum, frame):  # noqa: ANN001 - a signal handler
    try:
        os.write(2, b"\nk3chat: interrupted before anything started; nothing was changed\n")
    finally:
        os._exit(5)


signal.signal(signal.SIGINT, _early_interrupt)


def main() -> int:
    from k3chat.cli import main as cli_main

    # From here on KeyboardInterrupt is handled by the command (cli.main catches it too).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = cli_main()
    # The exit code is known and the command has put its handlers back: a signal in the last
    # moments before exit must not turn it into a death by SIGINT (-2) or a traceback.
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The exit codes every k3chat command returns, defined once (the k3chat front-ends and the
engine's own tools, `plan`, `doctor`, `bench`, `fixture`, all use these).

0 success; 1 a runtime failure; 2 a usage, configuration or checkpoint problem, or a memory
plan that cannot fit; 4 a routed expert could not be read; 5 interrupted (Ctrl-C, SIGTERM,
SIGHUP).
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode", "EXIT_OK", "EXIT_RUNTIME", "EXIT_USAGE", "EXIT_EXPERT_IO", "EXIT_INTERRUPTED"]


class ExitCode(IntEnum):
    OK = 0
    RUNTIME = 1
    USAGE = 2
    EXPERT_IO = 4
    INTERRUPTED = 5


EXIT_OK = int(ExitCode.OK)
EXIT_RUNTIME = int(ExitCode.RUNTIME)
EXIT_USAGE = int(ExitCode.USAGE)
EXIT_EXPERT_IO = int(ExitCode.EXPERT_IO)
EXIT_INTERRUPTED = int(ExitCode.INTERRUPTED)

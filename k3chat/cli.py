"""`k3chat` command line: subcommands and their documented exit codes.

Exit codes: 0 success; 1 runtime failure; 2 usage or config/checkpoint error;
4 expert read failure; 5 interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_EXPERT_IO = 4
EXIT_INTERRUPTED = 5


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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="k3chat", description="Private, local chat with Kimi K3.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser("run", help="one-shot generation on a model directory")
    r.add_argument("model_dir", help="checkpoint directory (config.json, shards, index)")
    r.add_argument("--ids", type=_ids, required=True,
                   help="prompt as comma-separated token ids (no tokenizer needed)")
    r.add_argument("--gen", type=_positive, default=16, help="tokens to generate (default 16)")
    r.add_argument("--json", dest="json_out", help="write the result as JSON to this file")
    r.add_argument("--threads", type=_positive, default=None, help="compute threads (default: all cores)")
    r.add_argument("--scalar", action="store_true", help="force the portable scalar kernels")
    f = sub.add_parser("fixture", help="write a test checkpoint (presets: tiny, wide)")
    f.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if args_list and args_list[0] == "fixture":
        from k3engine.fixture import main as fixture_main
        return fixture_main(args_list[1:])
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: 2 on usage errors, 0 for --help
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "run":
        from .run_ids import run_ids
        return run_ids(args)
    parser.print_help(sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

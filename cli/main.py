"""`iquest`: the command line. Each subcommand lives in its own module and registers its flags."""

from __future__ import annotations

import argparse
import sys

from ..reference.checkpoint import CheckpointError
from ..reference.config import ConfigError
from . import bench_cmd, card_cmd, debug_cmd, fit_cmd, fixture_cmd, generate_cmd, info_cmd, qualify_cmd, serve_cmd

COMMANDS = [generate_cmd, fixture_cmd, bench_cmd, card_cmd, fit_cmd, serve_cmd, info_cmd, qualify_cmd, debug_cmd]


class UserError(Exception):
    """A problem with what the user asked for: printed as one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (subcommand parsers inherit this class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="iquest", description="IQuestRT: speculative decoding runtime for IQuest-Q1 (fast engine + float64 reference).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed as one line
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.run(args) or 0)
    except (UserError, ConfigError, CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"iquest {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"iquest {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m iquest.cli.main` (ci/gpu.sh) runs this file as __main__, a second copy of the module: the commands
    # raise iquest.cli.main.UserError, which only that module's main() catches.
    from iquest.cli.main import main as package_main

    sys.exit(package_main())

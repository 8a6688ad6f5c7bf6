"""`iquest`: the command line. Each subcommand lives in its own module and registers its flags.

This module imports nothing heavy at its top: the commands (and torch with them) are imported inside main(), after
its Ctrl-C handling is in place, so an interrupt during `import torch` is the same one line as one during a decode.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = ("generate_cmd", "fixture_cmd", "bench_cmd", "card_cmd", "fit_cmd", "serve_cmd", "info_cmd", "qualify_cmd",
            "debug_cmd", "check_cmd")

# One example per command, shown at the end of its --help (tests/test_cli_help.py parses every one).
EXAMPLES = {
    "iquest": "iquest generate --prompt 'def fibonacci(n):' --max-new-tokens 64",
    "generate": "iquest generate --prompt-file task.py --max-new-tokens 128 --seed 1",
    "make-fixture": "iquest make-fixture --preset tiny --out /tmp/tiny",
    "check-checkpoint": "iquest check-checkpoint fixtures/tiny --headers-only",
    "bench": "iquest bench step --context 1024 --drafts 5 --kernels torch,triton",
    "bench step": "iquest bench step --context 1024 --drafts 5 --kernels torch,triton --out step.json",
    "bench context": "iquest bench context --kernels triton --out bench/results/context.json",
    "bench kernels": "iquest bench kernels --rows 1,8 --out kernels.json",
    "bench tune": "iquest bench tune --ops moe,attention_full --out tune.json",
    "bench allreduce": "iquest bench allreduce --ranks 2",
    "bench sass": "iquest bench sass --kernels fp8_linear --set fp8_linear.PRELOAD=0",
    "bench graph-trace": "iquest bench graph-trace --kernels triton --context 1024",
    "bench stream-probe": "iquest bench stream-probe --out stream.json",
    "card": "iquest card --prompts 12 --tokens 48 --no-write",
    "fit-depth": "iquest fit-depth --round-costs cpu --no-write",
    "serve": "iquest serve --port 8000 --api-key secret",
    "info": "iquest info --config configs/iquest-q1.json --tp 8 --context 131072",
    "qualify": "iquest qualify --quick --model fixtures/tiny --json > report.json",
    "debug": "iquest debug diff --prompt 'def f(x):' --position -1",
    "debug diff": "iquest debug diff --prompt-file prompt.txt --position 12 --control rope_shift_rows",
    "debug chain": "iquest debug chain --dtype fp32 --jobs 4",
}


class UserError(Exception):
    """A problem with what the user asked for: printed as one line, no traceback."""


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, but the example epilog keeps its line breaks."""

    def _fill_text(self, text, width, indent):
        if text.startswith("example:"):
            return "".join(indent + line + "\n" for line in text.splitlines()).rstrip("\n")
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (subcommand parsers inherit this class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments:") and ".json" in message:
            message += " (--json takes no file name: it prints the JSON on stdout; > FILE keeps it)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from .. import __version__
    from ..provenance import commit

    return f"iquest {__version__} (commit {commit()})"


def _parsers(parser: argparse.ArgumentParser, name: str):
    """(name, parser) of `parser` and every subcommand under it, e.g. ("bench step", ...)."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}".strip())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="iquest", description="IQuestRT: speculative decoding runtime for IQuest-Q1 (fast engine + float64 reference).")
    parser.add_argument("--version", action="version", version=_version(), help="print the version and commit, exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(f".{module}", __package__).register(sub)
    for name, p in _parsers(parser, ""):
        example = EXAMPLES.get(name or "iquest")
        if example:
            p.epilog = f"example:\n  {example}"
    return parser


def _command(argv: list[str]) -> str:
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:  # at any point: importing torch, loading, decoding
        print(" ".join(filter(None, ("iquest", _command(argv)))) + ": interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left early (iquest info | head -2): no message, and none at exit
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


def _main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed as one line
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        raise
    except (UserError, ValueError, OSError) as exc:  # ValueError: ConfigError and CheckpointError too
        print(f"iquest {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m iquest.cli.main` (ci/gpu.sh) runs this file as __main__, a second copy of the module: the commands
    # raise iquest.cli.main.UserError, which only that module's main() catches.
    from iquest.cli.main import main as package_main

    sys.exit(package_main())

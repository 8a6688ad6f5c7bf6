"""`iquest make-fixture`: write a deterministic random checkpoint for tests and experiments."""

from __future__ import annotations

import argparse


class _Presets:
    """fixtures/make.py's preset names, read when argparse first asks (that module imports torch)."""

    def _names(self) -> list[str]:
        from ..fixtures.make import PRESETS

        return sorted(PRESETS)

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


def register(sub) -> None:
    p = sub.add_parser("make-fixture", help="write a deterministic random IQuest-Q1 checkpoint",
                       description="Write a random-weight checkpoint (configs, FP8 safetensors, tokenizer) "
                                   "that is identical for the same preset and seed.")
    p.add_argument("--preset", required=True, choices=_Presets(), metavar="PRESET",
                   help="model size and shape: one of %(choices)s")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..fixtures.make import make_fixture

    out = make_fixture(args.preset, args.out, args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0

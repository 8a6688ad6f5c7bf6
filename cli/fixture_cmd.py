"""`iquest make-fixture`: write a deterministic random checkpoint for tests and experiments."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from ..fixtures.make import PRESETS

    p = sub.add_parser("make-fixture", help="write a deterministic random IQuest-Q1 checkpoint",
                       description="Write a random-weight checkpoint (configs, FP8 safetensors, tokenizer) "
                                   "that is identical for the same preset and seed.")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model size and shape")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..fixtures.make import make_fixture

    out = make_fixture(args.preset, args.out, args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0

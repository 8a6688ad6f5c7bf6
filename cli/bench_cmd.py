"""`iquest bench`: performance measurements (benchmarks, never timed tests)."""

from __future__ import annotations

import argparse

from .generate_cmd import _drafts


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (need a CUDA device)",
                       description="Performance benchmarks. Each prints a table and can write raw JSON.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    s = bsub.add_parser("step", help="median latency of one speculative round: CUDA graphs vs eager",
                        description="Prefill a prompt of --context tokens, then time decode chunks with the "
                                    "captured decode-loop graph and with an eager loop, alternating in one process.")
    s.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    s.add_argument("--context", type=int, default=1024, help="prompt length in tokens (default 1024)")
    s.add_argument("--drafts", type=_drafts, default=5, help="fixed draft depth 3..7 or auto (default 5)")
    s.add_argument("--repeats", type=int, default=10, help="measurements per variant (default 10)")
    s.add_argument("--chunk-tokens", type=int, default=64, help="tokens decoded per timed chunk (default 64)")
    s.add_argument("--seed", type=int, default=0, help="request seed of the first repeat (default 0)")
    s.add_argument("--out", help="write the raw JSON here (e.g. bench/results/step-mini.json)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.step import run as bench_step
    from .engines import default_model_dir

    bench_step(args.model or str(default_model_dir()), args.context, args.drafts, args.repeats,
               args.chunk_tokens, args.seed, args.out)
    return 0

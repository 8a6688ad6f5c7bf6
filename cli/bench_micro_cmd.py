"""`iquest bench kernels` and `iquest bench allreduce`: microbenchmarks (registered by cli/bench_cmd.py)."""

from __future__ import annotations

import argparse


def _rows(value: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows must be comma-separated integers, got {value!r}") from None
    if not rows or any(not 1 <= r <= 16 for r in rows):
        raise argparse.ArgumentTypeError(f"--rows must be in 1..16, got {value!r}")
    return rows


def register(bsub) -> None:
    k = bsub.add_parser("kernels", help="our Triton kernels vs torch (_scaled_mm, cuBLAS, SDPA) at TP8 rank shapes",
                        description="FP8 block-scaled linear (q/k/v/o, expert gate/up/down, eh_proj slices of one "
                                    "TP8 rank) and decode attention (4K sliding ring, 32K and 192K full layer): "
                                    "median time in CUDA graphs, bytes, GB/s, ratio to the copy-bandwidth floor, and "
                                    "each output's agreement with the fp32 reference and with torch's variant.")
    k.add_argument("--rows", type=_rows, default=(1, 8), help="comma-separated row counts (default 1,8)")
    k.add_argument("--repeats", type=int, default=20, help="timed graph replays per variant (default 20)")
    k.add_argument("--out", help="write the raw JSON here (e.g. bench/results/kernels-h200.json)")
    k.set_defaults(run=run_kernels)
    a = bsub.add_parser("allreduce", help="bf16 all-reduce: NCCL vs torch symmetric memory, in CUDA graphs",
                        description="Spawns one process per GPU (NVLink multicast off) and times an all-reduce of "
                                    "[rows, hidden] bf16 with NCCL, symmetric-memory one-shot and two-shot, each "
                                    "checked for the exact sum first; prints a per-round collective estimate.")
    a.add_argument("--ranks", type=int, default=2, help="processes, one GPU each (default 2)")
    a.add_argument("--rows", type=_rows, default=(1, 8), help="comma-separated row counts (default 1,8)")
    a.add_argument("--hidden", type=int, default=6144, help="row width (default 6144, the model's hidden size)")
    a.add_argument("--repeats", type=int, default=20, help="timed graph replays per variant (default 20)")
    a.add_argument("--out", help="write the raw JSON here (rank 0)")
    a.set_defaults(run=run_allreduce)


def _need_gpus(what: str, n: int) -> None:
    import torch

    from .main import UserError

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < n:
        raise UserError(f"{what} needs {n} CUDA device{'s' if n > 1 else ''}, found {found}")


def run_kernels(args: argparse.Namespace) -> int:
    from .main import UserError

    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    _need_gpus("iquest bench kernels", 1)
    from ..bench.kernels_micro import run

    run(args.rows, args.repeats, args.out)
    return 0


def run_allreduce(args: argparse.Namespace) -> int:
    from .main import UserError

    if args.ranks < 2:
        raise UserError("--ranks must be >= 2")
    if args.repeats < 1 or args.hidden < 1:
        raise UserError("--repeats and --hidden must be >= 1")
    _need_gpus("iquest bench allreduce", args.ranks)
    from ..bench.allreduce import run

    run(args.ranks, args.rows, args.hidden, args.repeats, args.out)
    return 0

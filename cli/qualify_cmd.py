"""`iquest qualify`: check the fast engine against the float64 reference, with negative controls."""

from __future__ import annotations

import argparse

from .options import add_device, add_json, add_kernels


def register(sub) -> None:
    p = sub.add_parser("qualify", help="qualify the fast engine against the float64 reference",
                       description="Per-position numerics (replayed decode, per position class), append-one/"
                                   "append-eight stability, decode agreement, lossless sampling, and a registry of "
                                   "negative controls that must all be caught. Prints a table (with --json: the "
                                   "JSON report on stdout, the table on stderr) and progress on stderr; exits 1 on any "
                                   "failure.")
    p.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks of the candidate (default 1; on CUDA one GPU a rank, or every rank on "
                        "GPU 0 with --share-gpu)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fast engine compute dtype (default fp32)")
    add_device(p, default="cpu", what="where the candidate runs (cuda: the GPU engine, eagerly, so every block is "
                                      "recorded)")
    add_kernels(p, what="the candidate's kernels (with the MoE kernel the tolerance column is DTYPE+e4m3act: its "
                        "Down input is E4M3)")
    p.add_argument("--share-gpu", action="store_true",
                   help="with --tp N --device cuda: every rank on GPU 0 (testing tensor parallelism on one GPU; run "
                        "under an MPS daemon so the ranks' kernels run side by side: bash ci/gpu.sh mps ...)")
    p.add_argument("--jobs", default="auto",
                   help="worker processes for the independent units (the healthy engine, the lossless test and each "
                        "negative control: 12 now); auto (default) = one per CPU core, at most one per unit; 1 runs "
                        "everything in this process")
    p.add_argument("--quick", action="store_true",
                   help="one request and 600 lossless samples instead of four and 3000: fits CI on fixtures/tiny")
    add_json(p, text_to_stderr=True)
    p.add_argument("--control", action="append", metavar="NAME",
                   help="run only this negative control (repeatable; default: all of them)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    import torch

    from ..qualify.controls import REGISTRY
    from ..reference.config import TP_DEGREES
    from ..qualify.run import qualify
    from .options import engine_target, model_folder, print_json

    known = {c.name for c in REGISTRY}
    for name in args.control or []:
        if name not in known:
            raise ValueError(f"unknown negative control {name!r}; known: {', '.join(sorted(known))}")
    if args.tp not in TP_DEGREES:
        raise ValueError(f"--tp must be one of {TP_DEGREES}, got {args.tp}")
    from ..fast.plan import KernelPlan

    device = engine_target(args.device, args.kernels)
    kernels = KernelPlan.choose(args.kernels, device)
    if args.jobs == "auto":
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        jobs = cores  # qualify() uses no more workers than it has units
    else:
        try:
            jobs = int(args.jobs)
        except ValueError:
            raise ValueError(f"--jobs must be a positive integer or auto, got {args.jobs!r}") from None
        if jobs < 1:
            raise ValueError(f"--jobs must be a positive integer or auto, got {args.jobs!r}")
    torch.set_num_threads(1)
    report = qualify(str(model_folder(args.model)), tp=args.tp, quick=args.quick, dtype=args.dtype,
                     controls=args.control, device=device, kernels=kernels, jobs=jobs, shared_gpu=args.share_gpu,
                     out=sys.stderr if args.json else None)
    if args.json:
        print_json(report)
    return 0 if report["passed"] else 1

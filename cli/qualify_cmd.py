"""`iquest qualify`: check the fast engine against the float64 reference, with negative controls."""

from __future__ import annotations

import argparse

from ..fast.setting_ops import GROUP
from ..fast.stacks import STALL_S
from .options import add_device, add_json, add_kernels, add_router_fold, add_weights

FALSE_ALARM_OUT = "bench/results/qualify-false-alarm-{commit}.json"


def register(sub) -> None:
    p = sub.add_parser("qualify", help="qualify the fast engine against the float64 reference",
                       description="Per-position numerics (replayed decode, per position class), append-one/"
                                   "append-eight stability, decode agreement, lossless sampling, and a registry of "
                                   "negative controls that must all be caught. Prints a table (with --json: the "
                                   "JSON report on stdout, the table on stderr) and progress on stderr; exits 1 on any "
                                   "failure. With --weights fp8 on a BF16 checkpoint the candidate runs the "
                                   "checkpoint quantized at load: it is judged (every check, every control) on the "
                                   "reference with the same quantization, and its fp8w.* rows measure it against the "
                                   "BF16 weights it came from.")
    p.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks of the candidate (default 1; on CUDA one GPU a rank, or every rank on "
                        "GPU 0 with --share-gpu)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fast engine compute dtype (default fp32)")
    add_device(p, default="cpu", what="where the candidate runs (cuda: the GPU engine, eagerly, so every block is "
                                      "recorded)")
    add_kernels(p, what="the candidate's kernels")
    add_weights(p)
    add_router_fold(p)
    p.add_argument("--kernel-setting", action="append", default=[], metavar="OP.FIELD=VALUE",
                   help="the candidate's kernels with this launch setting (fast/kernel_settings.py; ops: "
                        f"{', '.join(GROUP)}; repeatable; e.g. moe.gate_up_split=8, a numerical form, qualified "
                        "so before it becomes a default; needs the Triton kernels)")
    p.add_argument("--share-gpu", action="store_true",
                   help="with --tp N --device cuda: every rank on GPU 0 (testing tensor parallelism on one GPU; run "
                        "under an MPS daemon so the ranks' kernels run side by side: bash ci/gpu.sh mps ...)")
    p.add_argument("--jobs", default="auto",
                   help="worker processes for the independent units (the healthy engine, the lossless test and each "
                        "negative control); auto (default) = one per CPU core, at most one per unit; 1 runs "
                        "everything in this process")
    p.add_argument("--stall-dump", type=float, default=STALL_S, metavar="SECONDS",
                   help=f"when no step has finished for this long (default {STALL_S:g}; 0: never), print which "
                        "units are running, with their steps done and time so far, then the Python stacks of every "
                        "process the run started (its workers and their tensor-parallel ranks), once per stall: a run "
                        "that seems hung shows where each process waits, and one that is only slow goes on (with "
                        "--jobs 2 or more; kill -USR1 PID prints one of these processes' stacks at any time)")
    p.add_argument("--stall-limit", type=float, default=0, metavar="SECONDS",
                   help="when no step has finished for this long, end the run: print the stacks as --stall-dump does, "
                        "stop every worker process and what it started, and exit 2 with one line naming the units "
                        "that did not finish and their steps done (default 0: no limit, a run waits however long; "
                        "with --jobs 2 or more)")
    p.add_argument("--quick", action="store_true",
                   help="two requests and 600 lossless samples instead of six and 3000: fits CI on a tiny fixture")
    p.add_argument("--seed", type=int, default=0,
                   help="picks the requests' prompts and seeds and the lossless test's request seeds (default 0); "
                        "a healthy engine fails a run with probability alpha, the suite's statistical false-alarm "
                        "rate (tolerances.json, \"statistics\")")
    p.add_argument("--false-alarm", type=int, metavar="N",
                   help="measure the healthy engine's false-alarm rate instead: quick runs without controls at seeds "
                        "SEED .. SEED+N-1; writes the raw results to --out and exits 1 if any run failed")
    p.add_argument("--out", metavar="FILE",
                   help=f"with --false-alarm: where the raw results go (default {FALSE_ALARM_OUT} in the repository)")
    add_json(p, text_to_stderr=True)
    p.add_argument("--control", action="append", metavar="NAME",
                   help="run only this negative control (repeatable; default: all of them)")
    p.set_defaults(run=run)


def _jobs(choice: str) -> int:
    if choice == "auto":
        import os

        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        jobs = int(choice)
    except ValueError:
        raise ValueError(f"--jobs must be a positive integer or auto, got {choice!r}") from None
    if jobs < 1:
        raise ValueError(f"--jobs must be a positive integer or auto, got {choice!r}")
    return jobs  # qualify() uses no more workers than it has units


def run(args: argparse.Namespace) -> int:
    import torch

    from ..fast.stacks import dump_stacks_on_signal
    from ..qualify.controls import REGISTRY
    from ..qualify.run import StallError
    from ..reference.config import TP_DEGREES
    from .options import check_weights, engine_target, model_folder

    known = {c.name for c in REGISTRY}
    for name in args.control or []:
        if name not in known:
            raise ValueError(f"unknown negative control {name!r}; known: {', '.join(sorted(known))}")
    if args.tp not in TP_DEGREES:
        raise ValueError(f"--tp must be one of {TP_DEGREES}, got {args.tp}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.false_alarm is not None and args.false_alarm < 1:
        raise ValueError(f"--false-alarm must be >= 1, got {args.false_alarm}")
    if args.out and args.false_alarm is None:
        raise ValueError("--out goes with --false-alarm N")
    for flag, value in (("--stall-dump", args.stall_dump), ("--stall-limit", args.stall_limit)):
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0 seconds (0: never), got {value:g}")
    from ..fast.plan import KernelPlan

    device = engine_target(args.device, args.kernels)
    kernels = KernelPlan.choose(args.kernels, device)
    kernel_settings = _kernel_settings(args.kernel_setting, kernels)
    jobs = _jobs(args.jobs)
    model_dir = model_folder(args.model)
    check_weights(args.weights, model_dir, device)
    torch.set_num_threads(1)
    dump_stacks_on_signal()
    try:
        return _run(args, model_dir, device, kernels, kernel_settings, jobs)
    except StallError as e:  # one line, as main prints a user's error: the units' stacks are above it
        from .main import UserError

        raise UserError(str(e)) from None


def _run(args: argparse.Namespace, model_dir, device: str, kernels, kernel_settings: tuple, jobs: int) -> int:
    import sys

    from ..qualify.run import false_alarms, qualify
    from .options import print_json

    if args.false_alarm is not None:
        from ..provenance import commit

        from pathlib import Path

        out = args.out or str(Path(__file__).resolve().parent.parent / FALSE_ALARM_OUT.format(commit=commit()))
        report = false_alarms(str(model_dir), args.false_alarm, out, first_seed=args.seed, dtype=args.dtype,
                              device=device, kernels=kernels, weights=args.weights, tp=args.tp, jobs=jobs,
                              router_fold=args.router_fold, kernel_settings=kernel_settings,
                              stall_dump=args.stall_dump, stall_limit=args.stall_limit)
        near = report["closest_bound"]
        nearest = f"; nearest bound {near[0]}/{near[1]} at {near[4]:.3g} of its tolerance" if near else ""
        print(f"false alarms: {report['false_alarms']}/{len(report['runs'])} healthy quick runs failed "
              f"(suite alpha {report['suite_alpha']:g}){nearest}; raw results: {out}",
              file=sys.stderr if args.json else None)
        if args.json:
            print_json(report)
        return 0 if report["false_alarms"] == 0 else 1
    report = qualify(str(model_dir), tp=args.tp, quick=args.quick, dtype=args.dtype, controls=args.control,
                     device=device, kernels=kernels, jobs=jobs, shared_gpu=args.share_gpu, weights=args.weights,
                     seed=args.seed, out=sys.stderr if args.json else None, router_fold=args.router_fold,
                     kernel_settings=kernel_settings, stall_dump=args.stall_dump, stall_limit=args.stall_limit)
    if args.json:
        print_json(report)
    return 0 if report["passed"] else 1



def _kernel_settings(texts: list[str], kernels) -> tuple:
    """--kernel-setting's triples, checked as the engine checks them (fast/rank.kernel_settings_of) before any worker
    starts."""
    from ..fast.rank import kernel_setting, kernel_settings_of

    triples = tuple(kernel_setting(t) for t in texts)
    kernel_settings_of(kernels, triples)
    return triples

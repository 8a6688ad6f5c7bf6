"""`iquest bench kernels`, `tune`, `allreduce`, `graph-trace` and `stream-probe`: microbenchmarks and GPU probes;
`iquest bench sass`: the offline compile report (registered by cli/bench_cmd.py)."""

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
    k = bsub.add_parser("kernels", help="our Triton kernels vs torch (_scaled_mm, cuBLAS, SDPA, the engine's torch "
                                        "forms) at TP8 rank shapes",
                        description="FP8 block-scaled linear (q/k/v/o, expert gate/up/down, eh_proj slices of one "
                                    "TP8 rank), decode attention (4K sliding ring, 32K and 192K full layer), and the "
                                    "MoE, router, LM head, local top-k, sampling draw and accept step against the "
                                    "engine's torch forms: median time in CUDA graphs, bytes, GB/s, ratio to the "
                                    "copy-bandwidth floor, and each output's agreement with the fp32 reference and "
                                    "with torch's variant.")
    k.add_argument("--rows", type=_rows, default=(1, 8), help="comma-separated row counts (default 1,8)")
    k.add_argument("--repeats", type=int, default=20, help="timed graph replays per variant (default 20)")
    k.add_argument("--out", help="write the raw JSON here (e.g. bench/results/kernels-h200.json)")
    k.set_defaults(run=run_kernels)
    t = bsub.add_parser("tune", help="sweep our kernels' launch configurations at the decode shapes; best defaults",
                        description="For each op (moe, linear_qkv, linear_o, attention_sliding, attention_full, "
                                    "router, norm) at one TP8 rank's decode shapes (6 rows, 1K context): a few "
                                    "candidate configurations, the current default first, each checked against the "
                                    "default's output and the op's reference, then timed in CUDA graphs rotating over"
                                    " weight/KV copies (MoE: over routings; the norm's activations stay in L2) so "
                                    "weight reads come from HBM. Prints per op the"
                                    " median us per call, the byte floor, the launch floor (an empty Triton kernel), "
                                    "the best configuration and whether it beats the default; never changes a "
                                    "default. About 3 minutes on an H200 for all ops, compilation included.")
    t.add_argument("--ops", default=None,
                   help="comma-separated ops: moe, linear_qkv, linear_o, attention_sliding, attention_full, router, "
                        "norm (default: all)")
    t.add_argument("--repeats", type=int, default=20,
                   help="timed rounds, each replaying every candidate once (default 20)")
    t.add_argument("--budget", type=float, default=240.0,
                   help="seconds after which the remaining non-default candidates are skipped, and reported as "
                        "skipped (default 240)")
    t.add_argument("--rows", type=int, default=6, help="rows of the decode block (default 6: depth 5)")
    t.add_argument("--context", type=int, default=1024, help="history positions before the block (default 1024)")
    t.add_argument("--distinct", type=int, default=None,
                   help="distinct experts each MoE routing chooses (default: bench.tune.TuneShape's 13, the prefilled "
                        "benchmark's 12.9; the design document measured 37.7 in real requests)")
    t.add_argument("--pdl", action="store_true",
                   help="launch every kernel with programmatic dependent launch, as the engine does (each call then "
                        "overlaps the previous call's tail; the weight preload candidates need it)")
    t.add_argument("--hot", action="store_true",
                   help="one weight copy (MoE: one routing) per op instead of rotating over copies, so weights are L2 "
                        "hits after the first call: what each op costs with its bytes already on chip (a diagnostic;"
                        " the byte floors do not apply)")
    t.add_argument("--only", default=None,
                   help="comma-separated strings: time only the default and the candidates whose label or note "
                        "contains one (e.g. 'engine': the MoE as fast/triton_ops.py calls it); default: every "
                        "candidate")
    t.add_argument("--out", help="write the raw JSON here (e.g. bench/results/tune-h200.json)")
    t.set_defaults(run=run_tune)
    a = bsub.add_parser("allreduce", help="bf16 all-reduce: NCCL vs torch symmetric memory, in CUDA graphs",
                        description="Spawns one process per GPU (NVLink multicast off) and times an all-reduce of "
                                    "[rows, hidden] bf16 with NCCL, symmetric-memory one-shot and two-shot, each "
                                    "checked for the exact sum first; prints a per-round collective estimate.")
    a.add_argument("--ranks", type=int, default=2, help="processes, one GPU each (default 2)")
    a.add_argument("--rows", type=_rows, default=(1, 8), help="comma-separated row counts (default 1,8)")
    a.add_argument("--hidden", type=int, default=6144, help="row width (default 6144, the model's hidden size)")
    a.add_argument("--repeats", type=int, default=20, help="timed graph replays per variant (default 20)")
    a.add_argument("--share-gpu", action="store_true",
                   help="every rank on GPU 0 (under an MPS daemon: bash ci/gpu.sh mps ...): the peer kernels only, "
                        "an emulation, not a latency figure")
    a.add_argument("--out", help="write the raw JSON here (rank 0)")
    a.set_defaults(run=run_allreduce)
    c = bsub.add_parser("sass", help="the decode kernels compiled for the H200 here, no GPU: registers, spills, "
                                     "instruction mix",
                        description="Compiles the MoE's Gate/Up and Down and the FP8 linear for sm_90a with their "
                                    "wrappers' defaults at one TP8 rank's decode shapes (Triton's own ptxas, "
                                    "nvdisasm and cuobjdump; no GPU needed) and prints registers per thread, stack "
                                    "bytes (spills), shared memory and the most frequent instructions.")
    c.add_argument("--kernels", default="moe_gate_up_tma,moe_down_tma,fp8_linear",
                   help="comma-separated: moe_gate_up (pointer loads, x rescaled in the kernel), moe_gate_up_prescaled "
                        "(the norm's fp16 tiles), moe_gate_up_tma (the engine's form: those tiles, weights through "
                        "TMA), "
                        "moe_down (pointer loads), moe_down_tma (the engine's form), moe_down_early (with early_down), "
                        "moe_down_fp8 (the plan's fp8_down), fp8_linear (q/k/v as the engine runs it, tiles "
                        "preloaded), fp8_linear_loop, fp8_linear_norm (the plan's fused_input_norm: rows scaled by "
                        "1 / rms), fp8_linear_direct (Gluon, o_proj) (default: moe_gate_up_tma, moe_down_tma, "
                        "fp8_linear: what the engine launches)")
    c.add_argument("--set", action="append", default=[], metavar="KERNEL.NAME=VALUE",
                   help="override one constexpr, e.g. moe_down.F16=False (repeatable)")
    c.add_argument("--top", type=int, default=10, help="instructions listed per kernel (default 10)")
    c.add_argument("--out", help="write the raw JSON report here")
    c.set_defaults(run=run_sass)
    gt = bsub.add_parser("graph-trace", help="what each kernel adds to a captured verification forward (GPU)",
                         description="Builds one TP8 rank's slice of the full-size model (random FP8 weights, "
                                     "collectives as local no-ops), captures one plain CUDA graph of the verification "
                                     "forward over --rows rows plus one draft-layer call, traces its replays with "
                                     "torch.profiler, and prints what each kernel adds to the chain: its end minus the "
                                     "previous kernel's end, grouped by 'previous kernel -> kernel', medians over "
                                     "replays (bench/graph_trace.py).")
    gt.add_argument("--config", default="configs/iquest-q1.json", help="model config (default configs/iquest-q1.json)")
    gt.add_argument("--context", type=int, default=1024, help="positions of synthetic history (default 1024)")
    gt.add_argument("--rows", type=int, default=6, help="rows of the verification block (default 6: depth 5)")
    gt.add_argument("--kernels", default="triton", help="comma-separated engine variants (default triton)")
    gt.add_argument("--replays", type=int, default=5, help="traced replays (default 5)")
    gt.add_argument("--seed", type=int, default=0, help="weights, history and tokens seed (default 0)")
    gt.add_argument("--tokens", choices=("decode", "same", "distinct"), default="decode",
                    help="the block: 'decode' (default: the prompt prefilled for real, then the first round's "
                         "verification block, as bench step decodes, ~13 distinct experts a layer), 'same' (one random "
                         "token a row after synthetic history) or 'distinct' (a random token a row); the last two "
                         "route to ~3x the experts")
    gt.add_argument("--out", help="write the raw JSON here")
    gt.set_defaults(run=run_graph_trace)
    probes = {
        "stream-probe": ("stream_probe", "how fast a layer's Gate/Up tiles and flat reads of each size stream",
                         "Streams one layer's Gate/Up tiles with no MoE arithmetic by decomposition (Gate/Up's grid, "
                         "owners only, K splits, pipeline depths) and flat contiguous reads of 0.5-246 MB, each timed "
                         "back to back in a CUDA graph from HBM; prints the round's bound at those speeds "
                         "(bench/stream_probe.py)."),
    }
    for name, (module, help_text, description) in probes.items():
        pp = bsub.add_parser(name, help=help_text, description=description)
        pp.add_argument("--out", help="write the raw JSON here")
        pp.set_defaults(run=lambda args, name=name, module=module: run_probe(args, name, module))


def run_graph_trace(args: argparse.Namespace) -> int:
    from .main import UserError

    if not 1 <= args.rows <= 16:
        raise UserError(f"--rows must be in 1..16, got {args.rows}")
    if args.context < 1 or args.replays < 1:
        raise UserError("--context and --replays must be >= 1")
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    if not kernels:
        raise UserError("--kernels: give at least one engine variant, e.g. triton")
    _need_gpus("iquest bench graph-trace", 1)
    from ..bench.graph_trace import run

    run(args.config, args.context, args.rows, kernels, args.replays, args.seed, args.out, args.tokens)
    return 0


def run_probe(args: argparse.Namespace, name: str, module: str) -> int:
    """A GPU probe of bench/ (`module`.main takes the JSON path, if any)."""
    import importlib

    _need_gpus(f"iquest bench {name}", 1)
    importlib.import_module(f"..bench.{module}", __package__).main([args.out] if args.out else [])
    return 0


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


def run_tune(args: argparse.Namespace) -> int:
    from .main import UserError

    from ..bench.tune import OPS

    ops = OPS if args.ops is None else tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if not ops or unknown:
        raise UserError(f"--ops: unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(OPS)}")
    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    if args.budget <= 0:
        raise UserError("--budget must be > 0 seconds")
    if not 1 <= args.rows <= 16:
        raise UserError(f"--rows must be in 1..16, got {args.rows}")
    if args.context < 1:
        raise UserError(f"--context must be >= 1, got {args.context}")
    if args.distinct is not None and not 1 <= args.distinct <= 256:
        raise UserError(f"--distinct must be in 1..256, got {args.distinct}")
    _need_gpus("iquest bench tune", 1)
    from ..bench.tune import run

    run(tuple(dict.fromkeys(ops)), args.repeats, args.out, budget_s=args.budget, rows=args.rows, context=args.context,
        pdl=args.pdl, hot=args.hot, only=tuple(o.strip() for o in (args.only or "").split(",") if o.strip()),
        distinct=args.distinct)
    return 0


def run_allreduce(args: argparse.Namespace) -> int:
    from .main import UserError

    if args.ranks < 2:
        raise UserError("--ranks must be >= 2")
    if args.repeats < 1 or args.hidden < 1:
        raise UserError("--repeats and --hidden must be >= 1")
    _need_gpus("iquest bench allreduce", 1 if args.share_gpu else args.ranks)
    from ..bench.allreduce import run

    run(args.ranks, args.rows, args.hidden, args.repeats, args.out, shared_gpu=args.share_gpu)
    return 0


def _constexpr(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def run_sass(args: argparse.Namespace) -> int:
    import json

    from .main import UserError

    from ..bench.sass import run, specs

    known = tuple(specs())
    names = tuple(dict.fromkeys(n.strip() for n in args.kernels.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise UserError(f"--kernels: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    overrides: dict[str, dict] = {}
    for item in args.set:
        target, eq, value = item.partition("=")
        kernel, dot, name = target.partition(".")
        if not (eq and dot and name) or kernel not in known:
            raise UserError(f"--set {item!r}: expected KERNEL.NAME=VALUE with KERNEL one of {', '.join(known)}")
        overrides.setdefault(kernel, {})[name] = _constexpr(value)
    try:
        out = run(names, overrides, args.top)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": "sm_90a", "overrides": overrides, "kernels": out}, f, indent=1)
    return 0

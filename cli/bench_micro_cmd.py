"""`iquest bench kernels`, `tune`, `allreduce` and `graph-trace`: microbenchmarks and GPU probes; `iquest bench sass`:
the offline compile report (registered by cli/bench_cmd.py). `tune` times each published-model kernel at its default
launch settings and a small grid of others (bench/tune.py). `stream-probe` measured the kernels of the retired,
guessed architecture at its shapes: it answers with a one-line error until the GPU issue re-bases it (docs/PERF.md,
"Retired with the guessed architecture")."""

from __future__ import annotations

import argparse

RETIRED = {  # subcommand -> what it measured
    "stream-probe": "streamed the retired MoE kernel's Gate/Up tiles and the retired round's weight streams",
}


class _Retired(argparse.ArgumentParser):
    """A retired subcommand's parser: takes any arguments (its old ones included), so that running it gives its
    one-line error rather than a usage message."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(args or [])
        if "-h" in args or "--help" in args:
            self.print_help()
            self.exit()
        namespace = namespace if namespace is not None else argparse.Namespace()
        for key, value in self._defaults.items():
            setattr(namespace, key, value)
        return namespace, []


def _run_retired(args: argparse.Namespace, name: str) -> int:
    from .main import UserError

    raise UserError(f"bench {name} {RETIRED[name]}; it is re-based in the GPU issue (docs/PERF.md, \"Retired with the "
                    "guessed architecture\")")


def _rows(value: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows must be comma-separated integers, got {value!r}") from None
    if not rows or any(not 1 <= r <= 16 for r in rows):
        raise argparse.ArgumentTypeError(f"--rows must be in 1..16, got {value!r}")
    return rows


def register(bsub) -> None:
    k = bsub.add_parser("kernels", help="our Triton kernels on the product path vs torch (_scaled_mm, cuBLAS, the "
                                        "engine's torch forms) at TP8 rank shapes",
                        description="The FP8 block-scaled linear at the linears the engine runs as it (q/k/v as one "
                                    "weight, o_proj, the dense MLP, eh_proj: slices of one TP8 rank of "
                                    "configs/iquest-q1.json), and the local top-k, sampling draw and accept step "
                                    "against the engine's torch forms: median time in CUDA graphs, bytes, GB/s, ratio "
                                    "to the copy-bandwidth floor, and each output's agreement with the fp32 reference "
                                    "and with torch's variant. The kernels written for the retired architecture "
                                    "(attention, MoE, router, LM head) are not on the product path and not measured.")
    k.add_argument("--rows", type=_rows, default=(1, 8), help="comma-separated row counts (default 1,8)")
    k.add_argument("--repeats", type=int, default=20, help="timed graph replays per variant (default 20)")
    k.add_argument("--out", help="write the raw JSON here (e.g. bench/results/kernels-h200.json)")
    k.set_defaults(run=run_kernels)
    _register_tune(bsub)
    for name, what in RETIRED.items():
        r = bsub.add_parser(name, help=f"retired with the guessed architecture (it {what.split(' (')[0]})",
                            description=f"Retired: it {what}. It is re-based in the GPU issue.")
        r.__class__ = _Retired
        r.add_argument("--out", help="ignored: the command is retired (every argument is taken and ignored)")
        r.set_defaults(run=lambda args, name=name: _run_retired(args, name))
    a = bsub.add_parser("allreduce", help="bf16 all-reduce: NCCL vs torch symmetric memory, in CUDA graphs",
                        description="Spawns one process per GPU (NVLink multicast off) and times an all-reduce of "
                                    "[rows, hidden] bf16 with NCCL, symmetric-memory one-shot and two-shot, each "
                                    "checked for the exact sum first; prints a per-round collective estimate.")
    a.add_argument("--ranks", type=int, default=2, help="processes, one GPU each (default 2)")
    a.add_argument("--rows", type=_rows, default=(1, 8), help="comma-separated row counts (default 1,8)")
    a.add_argument("--hidden", type=int, default=3072, help="row width (default 3072, the model's hidden size)")
    a.add_argument("--repeats", type=int, default=20, help="timed graph replays per variant (default 20)")
    a.add_argument("--share-gpu", action="store_true",
                   help="every rank on GPU 0 (under an MPS daemon: bash ci/gpu.sh mps ...): the peer kernels only, "
                        "an emulation, not a latency figure")
    a.add_argument("--out", help="write the raw JSON here (rank 0)")
    a.set_defaults(run=run_allreduce)
    c = bsub.add_parser("sass", help="the decode round's kernels compiled for the H200 here, no GPU: registers, "
                                     "spills, instruction mix",
                        description="Compiles the decode round's kernels for sm_90a with their wrappers' default "
                                    "settings at one TP8 rank's decode shapes of configs/iquest-q1.json (Triton's own "
                                    "ptxas, nvdisasm and cuobjdump; no GPU needed) and prints registers per thread, "
                                    "stack bytes (spills), shared memory and the most frequent instructions, and for a "
                                    "kernel with a tensor-core K loop what one warp issues a K step: the FP8 "
                                    "linears (and q/k/v ending in the q/k norm + RoPE + KV write), qk_rope_kv, "
                                    "attention's split and combine kernels, the norms and sandwich tails, the "
                                    "router's two kernels, the router fold's two (o_proj with the partial logits, the "
                                    "tail that selects), the MoE's Gate/Up and Down at both expert offsets a rank can "
                                    "have (0 and 64 rows into a scale block) and its combine (alone, in the tail, in "
                                    "the peer all-reduce), the LM head's forms, the logprobs' rank part, the depth "
                                    "controller's rule.")
    c.add_argument("--kernels", default="all",
                   help="comma-separated spec names, or all (default all): e.g. fp8_linear (q/k/v as the engine runs "
                        "it, tiles preloaded), fp8_linear_loop (the pipelined K loop), o_proj_router, add_norm_route; "
                        "an unknown name is refused with the full list")
    c.add_argument("--set", action="append", default=[], metavar="KERNEL.NAME=VALUE",
                   help="override one constexpr, or the launch's num_warps, num_stages or maxnreg (its register "
                        "cap, 0 for none), e.g. fp8_linear.PRELOAD=0, moe_gate_up.num_warps=8 or moe_down.maxnreg=0 "
                        "(repeatable)")
    c.add_argument("--top", type=int, default=10, help="instructions listed per kernel (default 10)")
    c.add_argument("--out", help="write the raw JSON report here")
    c.set_defaults(run=run_sass)
    gt = bsub.add_parser("graph-trace", help="what each kernel adds to a captured verification forward (GPU)",
                         description="Builds one TP8 rank's slice of the full-size model (random weights shaped as "
                                     "loaded, collectives as local no-ops), captures one plain CUDA graph of the "
                                     "verification "
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
                         "verification block, as bench step decodes), 'same' (one random "
                         "token a row after synthetic history) or 'distinct' (a random token a row); the last two "
                         "route to more experts")
    gt.add_argument("--out", help="write the raw JSON here")
    gt.set_defaults(run=run_graph_trace)


def _register_tune(bsub) -> None:
    t = bsub.add_parser("tune", help="each published-model kernel at its default launch settings and a small grid of "
                                     "others, at one TP8 rank's decode shapes (GPU)",
                        description="For each op (the FP8 linears at q/k/v and o_proj, attention on full, sliding "
                                    "and draft layers, qk_rope_kv, qkv_rope_kv (the q/k/v projection ending in "
                                    "qk_rope_kv, one launch), rmsnorm, add_norm, the router, the MoE, the LM "
                                    "head, the sampling's top-k, the expert prefetch's side branch, the router fold's "
                                    "o-projection) builds its inputs at one TP8 rank's shapes of "
                                    "configs/iquest-q1.json, "
                                    "then times the default settings and each candidate of bench/tune.py's grid "
                                    "(dataclasses.replace on the default) in CUDA graphs launched with PDL as the "
                                    "engine launches them, the graphs replayed in turns in one process. Prints one "
                                    "line a candidate: median us a call, ratio to the default, and whether its "
                                    "output has the default's bits (a candidate changing a field that sets an fp32 "
                                    "sum's order is flagged as a numerical change).")
    t.add_argument("--ops", default="all", help="comma-separated ops, or all (default all: linear_qkv, linear_o, "
                                                "attention_full, attention_sliding, attention_draft, qk_rope_kv, "
                                                "qkv_rope_kv, rmsnorm, add_norm, router, moe, lm_head, topk, "
                                                "expert_prefetch, o_proj_router, add_norm_route)")
    t.add_argument("--only", metavar="NAME[,NAME]",
                   help="time only these candidates (besides each op's default), named as printed, e.g. "
                        "num_warps=8,block_n=32")
    t.add_argument("--rank", type=int, default=0,
                   help="the TP8 rank whose shapes are used (default 0; an odd rank's expert shard starts 64 rows into "
                        "its 128-row scale block)")
    t.add_argument("--rows", type=int, default=6, help="rows of the decode block, 1..8 (default 6: depth 5)")
    t.add_argument("--context", type=int, default=1024, help="positions of history for attention (default 1024)")
    t.add_argument("--distinct", type=int, default=13,
                   help="distinct experts the MoE's block routes to, top_k..min(rows x top_k, experts) (default 13)")
    t.add_argument("--repeats", type=int, default=20, help="timed replays per candidate (default 20)")
    t.add_argument("--budget", type=float, metavar="SECONDS",
                   help="stop starting ops, candidates and rounds after this many seconds (default: no cap)")
    t.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                   help="launch with programmatic dependent launch, as the engine does (default True; --no-pdl: plain "
                        "launches)")
    t.add_argument("--seed", type=int, default=0, help="inputs seed (default 0)")
    t.add_argument("--out", help="write the raw JSON here (e.g. bench/results/tune-h200.json)")
    t.set_defaults(run=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    from .main import UserError

    from ..bench import tune

    try:
        ops = tune.parse_ops(args.ops)
        only = tune.parse_only(args.only, ops)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not 0 <= args.rank < tune.TP:
        raise UserError(f"--rank must be in 0..{tune.TP - 1}, got {args.rank}")
    if not 1 <= args.rows <= 8:
        raise UserError(f"--rows must be in 1..8 (a decode block), got {args.rows}")
    if args.context < 1 or args.repeats < 1:
        raise UserError("--context and --repeats must be >= 1")
    if args.budget is not None and not args.budget > 0:
        raise UserError(f"--budget must be > 0 seconds, got {args.budget}")
    shapes = tune.rank_shapes(args.rank)
    top_k, experts = shapes.top_k, shapes.experts
    if not top_k <= args.distinct <= min(args.rows * top_k, experts):
        raise UserError(f"--distinct must be in {top_k}..{min(args.rows * top_k, experts)} at {args.rows} rows, "
                        f"got {args.distinct}")
    _need_gpus("iquest bench tune", 1)
    tune.run(ops, only, args.rank, args.rows, args.context, args.distinct, args.repeats, args.budget, args.out,
             pdl=args.pdl, seed=args.seed)
    return 0


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
    if names == ("all",):
        names = known
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise UserError(f"--kernels: unknown {', '.join(unknown) or '(none given)'}; choose from all, "
                        f"{', '.join(known)}")
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

"""`iquest bench`: performance measurements (benchmarks, never timed tests)."""

from __future__ import annotations

import argparse

from . import bench_micro_cmd
from .generate_cmd import _drafts
from .options import add_device


# Seven lengths from 1K to 192K less one chunk's room (the sweep of record's lengths; the published context is 512K)
SWEEP_CONTEXTS = (1024, 4096, 16384, 65536, 131072, 262144, 524160)  # to the published 512K, less a round's rows


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (need a CUDA device)",
                       description="Performance benchmarks. Each prints a table and can write its raw JSON with --out "
                                   "FILE: a file of record (bench/results/), which is why the benchmarks take --out "
                                   "where the other commands' --json prints on stdout.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    s = bsub.add_parser("step", help="median latency of one speculative round: CUDA graphs vs eager",
                        description="Prefill a prompt of --context tokens, then time decode chunks with the "
                                    "captured decode-loop graph and with an eager loop, alternating in one process. "
                                    "With --config and --tp-slice: one rank's shard of that model at full dimensions "
                                    "(random weights shaped as loaded, collectives replaced by local no-ops), with bytes per round, "
                                    "the byte floor and a per-stage profile, and each variant's captured graph "
                                    "compared with the first's, launch by compiled Triton kernel (bench/launches.py: "
                                    "an arm whose setting changed no kernel is flagged).")
    s.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    s.add_argument("--config", help="config.json of a model to run as one synthetic rank slice (no checkpoint), with its "
                                    "draft's config beside it (mtp/config.json, or NAME-mtp.json as "
                                    "configs/iquest-q1-mtp.json), or a model folder")
    s.add_argument("--tp-slice", type=int, default=8, help="with --config: TP degree whose rank 0 runs (default 8)")
    s.add_argument("--tp", type=int, default=None,
                   help="with --config: real tensor parallelism over TP processes (one GPU each; gloo on CPU), every "
                        "rank holding its slice of the TP layout; eager rounds (instead of --tp-slice)")
    s.add_argument("--ranks", type=int, default=None,
                   help="with --config --tp-slice N: run ranks 0..RANKS-1 of the TP-N layout as RANKS processes with "
                        "real collectives among them (e.g. --tp-slice 8 --ranks 2 on two H200s)")
    s.add_argument("--layers", type=int, default=None,
                   help="with --config: only the model's first LAYERS main layers (default all); e.g. so that more "
                        "ranks of the TP8 layout fit one GPU together with --share-gpu (each holds ~41 GB at 88)")
    s.add_argument("--share-gpu", action="store_true",
                   help="with --tp or --ranks on GPUs: every rank on GPU 0 (under an MPS daemon: bash ci/gpu.sh mps "
                        "...), a correctness and lockstep run whose times are emulation")
    s.add_argument("--history", choices=["auto", "synthetic", "prefill"], default="auto",
                   help="with --config: how the context's KV gets there: prefill it, or synthetic (random K/V with "
                        "correct position labels, only the last prompt block prefilled); auto = synthetic above "
                        "8192 tokens (a full-size 192K prefill takes longer than a benchmark call; default auto)")
    s.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="with --config: auto (cuda when a GPU is visible), cuda or cpu (default auto); without "
                        "--config bench step needs a CUDA device")
    s.add_argument("--context", type=int, default=1024, help="prompt length in tokens (default 1024)")
    s.add_argument("--drafts", type=_drafts, default=5, help="fixed draft depth 3..7 or auto (default 5)")
    s.add_argument("--repeats", type=int, default=10, help="measurements per variant (default 10)")
    s.add_argument("--chunk-tokens", type=int, default=None,
                   help="tokens decoded per timed chunk (default 64; 16 with --config)")
    s.add_argument("--seed", type=int, default=0, help="request seed of the first repeat (default 0)")
    s.add_argument("--out", help="write the raw JSON here (e.g. bench/results/step-mini.json)")
    s.add_argument("--kernels", default="torch",
                   help="comma-separated variants compared side by side: torch (fallback) or triton (kernels/), "
                        "each optionally with ops removed for timing (lab/ablation.py: triton~moe) or the routing "
                        "pinned to D distinct experts a block (triton~route:38, the real-request routing; with "
                        "--config each variant is held to the byte floor of its own routing), or a fold undone as "
                        "its control (lab/unfold.py: triton^moe_combine, triton^qkv_rope, triton^peer_tail), or a "
                        "product option turned on (triton+router_fold, a numerical change; triton+expert_prefetch and "
                        "triton+routed_prefetch, cache hints; triton+down_tail, Down ending in the tail), or kernel "
                        "launch settings other than the defaults (fast/kernel_settings.py: "
                        "triton@moe.gate_up_split=1@linear.num_stages=2); "
                        "e.g. torch,triton, triton,triton~route:38 or triton,triton^moe_combine (default torch). A "
                        "trailing prime repeats a variant as an A' arm of its own engine (triton,triton+down_tail,"
                        "triton'): every arm is printed against the first, paired by repeat, and the A' arm's spread "
                        "is the noise a difference must clear. The speedup line compares the first variant's graph "
                        "round with torch's eager round, so include torch to get it")
    s.set_defaults(run=run)
    c = bsub.add_parser("context", help="the round across context lengths 1K-512K against the added-KV floor",
                        description="One TP rank's slice of --config at full dimensions (as bench step --config), "
                                    "the same five-draft round at each --contexts length with synthetic history: the "
                                    "median captured round at each, its growth from the first length against the "
                                    "growth of the byte floor (the added KV's bytes), as a table, JSON and a PNG.")
    c.add_argument("--config", default="configs/iquest-q1.json", help="model config.json (default configs/iquest-q1.json, the full model)")
    c.add_argument("--tp-slice", type=int, default=8, help="TP degree whose rank 0 runs (default 8)")
    c.add_argument("--contexts", default=",".join(str(n) for n in SWEEP_CONTEXTS),
                   help=f"comma-separated prompt lengths (default {','.join(str(n) for n in SWEEP_CONTEXTS)})")
    c.add_argument("--drafts", type=int, default=5, help="fixed draft depth 3..7 (default 5)")
    c.add_argument("--repeats", type=int, default=5, help="timed chunks per length (default 5)")
    c.add_argument("--chunk-tokens", type=int, default=16, help="tokens decoded per timed chunk (default 16)")
    c.add_argument("--kernels", default="triton", help="one variant, as bench step's (default triton)")
    c.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default auto")
    c.add_argument("--seed", type=int, default=0, help="request seed (default 0)")
    c.add_argument("--out", help="write the raw JSON here")
    c.add_argument("--plot", help="write the PNG here (default: beside --out)")
    c.add_argument("--rescore", metavar="FILE",
                   help="measure nothing: print a saved sweep's JSON under the current floor rule (one bandwidth for "
                        "every row, the fastest measured); with --out, write the rescored JSON and PNG")
    c.set_defaults(run=run_context)
    g = bsub.add_parser("agent", help="a coding agent's session against iquest serve: TTFT and decode a turn",
                        description="Replay a coding agent's session against iquest serve through the openai client "
                                    "(streamed chat completions): each turn sends the conversation so far, the "
                                    "model's last reply and a read_file result holding a source file of this "
                                    "repository, so the prompt grows a file a turn on a fixed head. Per turn: prompt "
                                    "and cached tokens, time to first token, decode tokens/s, total time; JSON and a "
                                    "PNG of TTFT against prompt tokens. Against --url, or a server it starts and "
                                    "stops (--model, --device); --compare runs it twice, prefix reuse on then off.")
    g.add_argument("--url", help="base URL of a running iquest serve (e.g. http://127.0.0.1:8000); default: start one")
    g.add_argument("--model", help="checkpoint folder of the server it starts (default: the shipped mini model)")
    add_device(g, what="where the server it starts runs")
    g.add_argument("--prefix-reuse", choices=["on", "off"],
                   help="pass iquest serve --prefix-reuse on|off to the server it starts (default: not passed, the "
                        "server's own default)")
    g.add_argument("--compare", action="store_true",
                   help="run the session twice, each against its own server: --prefix-reuse on, then off")
    g.add_argument("--turns", type=int, default=6, help="turns of the session (default 6)")
    g.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each turn (default 32)")
    g.add_argument("--file-bytes", type=int, default=2000,
                   help="each tool result: the first this many bytes of its file (default 2000)")
    g.add_argument("--thinking", choices=["on", "off"], default="on",
                   help="chat_template_kwargs.enable_thinking of every turn (default on, the model's default)")
    g.add_argument("--max-context", type=int, default=8192,
                   help="--max-context of the server it starts (default 8192, capped by the model)")
    g.add_argument("--seed", type=int, default=0, help="request seed (default 0; replies are greedy)")
    g.add_argument("--api-key", help="the key of a --url server started with --api-key")
    g.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="run the session once untimed on each server first, so that no timed turn compiles a "
                        "kernel (default auto: on where the server runs on cuda)")
    g.add_argument("--out", help="the JSON (default bench/results/agent-MODEL-DEVICE.json); the PNG goes beside it")
    g.set_defaults(run=run_agent)
    register_depth(bsub)
    register_prefetch(bsub)
    bench_micro_cmd.register(bsub)  # kernels, allreduce
    # the command's example of record, shown in its --help as every command's is
    from .main import EXAMPLES

    EXAMPLES.setdefault("bench agent", "iquest bench agent --device cpu --turns 6 --compare")
    EXAMPLES.setdefault("bench prefetch", "iquest bench prefetch --device cpu --prompts 16 --widths 4,5")
    EXAMPLES.setdefault("bench depth", "iquest bench depth --device cuda --prompts 16 --tokens 64 --repeats 5")


def run(args: argparse.Namespace) -> int:
    from .main import UserError

    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    if not args.config and args.layers is not None:
        raise UserError("--layers needs --config (it cuts a model run from synthetic rank slices)")
    if not args.config and (args.tp is not None or args.ranks is not None):
        raise UserError("--tp and --ranks need --config (a model run from synthetic rank slices)")
    if args.config:
        from ..bench.full_step import run as full_step
        from .options import resolve_device

        resolve_device(args.device)  # --device cuda without a GPU: one line

        if args.model:
            raise UserError("--model and --config are exclusive")
        if args.drafts == "auto" or not args.drafts:
            raise UserError("--config needs a fixed draft depth (--drafts 3..7)")
        if args.tp is not None or args.ranks is not None:
            from ..bench.tp_step import run as tp_step

            if args.tp is not None and args.tp < 2:
                raise UserError("--tp needs at least 2 ranks (one rank is --tp-slice 1)")
            if args.tp is not None and args.ranks is not None:
                raise UserError("--tp and --ranks are exclusive (--ranks goes with --tp-slice)")
            if args.ranks is not None and not 2 <= args.ranks <= args.tp_slice:
                raise UserError(f"--ranks must be in 2..{args.tp_slice} (the --tp-slice layout)")
            if "," in args.kernels:
                raise UserError("real-collective runs take one kernel variant at a time (e.g. --kernels triton)")
            layout = args.tp if args.tp is not None else args.tp_slice
            tp_step(args.config, layout, args.context, int(args.drafts), args.repeats, args.chunk_tokens or 16,
                    args.seed, args.device, args.out, kernels=args.kernels, processes=args.ranks,
                    history=args.history, shared_gpu=args.share_gpu, layers=args.layers)
            return 0
        full_step(args.config, args.tp_slice, args.context, int(args.drafts), args.repeats, args.chunk_tokens or 16,
                  args.seed, args.device, args.out, kernels=tuple(args.kernels.split(",")),
                  history=args.history, layers=args.layers)
        return 0
    bench_micro_cmd._need_gpus("iquest bench step (without --config)", 1)
    from ..bench.step import run as bench_step
    from .engines import default_model_dir

    bench_step(args.model or str(default_model_dir()), args.context, args.drafts, args.repeats,
               args.chunk_tokens or 64, args.seed, args.out, tuple(args.kernels.split(",")))
    return 0


def run_context(args: argparse.Namespace) -> int:
    from ..bench.context_sweep import rescore, run as sweep
    from ..bench.full_step import load_config
    from .main import UserError

    if args.rescore:
        try:
            rescore(args.rescore, args.out)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--rescore {args.rescore}: not a saved bench context JSON ({type(e).__name__}: {e})") \
                from None
        return 0
    try:
        contexts = tuple(int(n) for n in args.contexts.split(","))
    except ValueError:
        raise UserError(f"--contexts takes comma-separated integers, got {args.contexts!r}") from None
    if len(contexts) < 2 or any(n < 1 for n in contexts) or list(contexts) != sorted(set(contexts)):
        raise UserError("--contexts needs two or more increasing positive lengths")
    if "," in args.kernels:
        raise UserError("bench context takes one kernel variant (e.g. --kernels triton)")
    if not 3 <= args.drafts <= 7:
        raise UserError("--drafts must be in 3..7")
    load_config(args.config)  # a bad --config is one line before the first length's progress, not after it
    sweep(args.config, args.tp_slice, contexts, args.drafts, args.repeats, args.chunk_tokens, args.seed, args.device,
          args.kernels, args.out, args.plot)
    return 0


def run_agent(args: argparse.Namespace) -> int:
    from ..bench.agent import run as agent, serve_has_flag
    from .main import UserError
    from .options import model_folder, resolve_device

    for flag, value, low in (("--turns", args.turns, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--file-bytes", args.file_bytes, 1), ("--max-context", args.max_context, 2)):
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if args.url:
        given = [f for f, v in (("--model", args.model), ("--prefix-reuse", args.prefix_reuse),
                                ("--compare", args.compare)) if v]
        if given:
            raise UserError(f"{', '.join(given)}: these set up the server bench agent starts; with --url the "
                            f"running server's own settings hold")
        if not args.url.startswith(("http://", "https://")):
            raise UserError(f"--url takes an http(s) base URL, got {args.url!r}")
        device = "remote" if args.device == "auto" else args.device
    else:
        if args.compare and args.prefix_reuse:
            raise UserError("--compare runs prefix reuse on and off itself; leave out --prefix-reuse")
        if args.api_key:
            raise UserError("--api-key is for a --url server (a server bench agent starts has none)")
        if args.model:
            model_folder(args.model)  # a missing folder: one line here, not a server that fails to start
        device = resolve_device(args.device)
        if (args.compare or args.prefix_reuse) and not serve_has_flag("--prefix-reuse"):
            raise UserError("this iquest serve has no --prefix-reuse flag yet (iquest serve --help); run without "
                            "--compare / --prefix-reuse")
    agent(url=args.url, model=args.model, device=device, prefix_reuse=args.prefix_reuse, compare=args.compare,
          turns=args.turns, max_tokens=args.max_tokens, file_bytes=args.file_bytes, thinking=args.thinking == "on",
          max_context=args.max_context, seed=args.seed, api_key=args.api_key, out=args.out,
          warmup=args.warmup == "on" or (args.warmup == "auto" and device == "cuda"))
    return 0


def register_prefetch(bsub) -> None:
    f = bsub.add_parser("prefetch", help="the expert prefetch's coverage: predicted against chosen experts a block",
                        description="Run held-out real-code prompts through the fast engine's target in blocks of R "
                                    "rows with the expert prefetch on (EngineOptions.expert_prefetch) and report, a "
                                    "sliding MoE layer and a width, the share of the experts the block's rows chose "
                                    "that the prefetch's prediction warms (per row, and of the block's distinct "
                                    "experts), and the experts warmed and needed a block. Runs on any device; the "
                                    "timing is iquest bench step with the variant triton+expert_prefetch.")
    f.add_argument("--model", help="checkpoint folder with its held-out corpus (default: the shipped mini model)")
    add_device(f)
    f.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    f.add_argument("--widths", default="4,5", help="comma-separated block widths in live rows, 1..8 (default 4,5: "
                                                   "where the prefetch runs)")
    f.add_argument("--out", help="the raw JSON (default: none)")
    f.set_defaults(run=run_prefetch)


def run_prefetch(args: argparse.Namespace) -> int:
    from .main import UserError
    from .options import model_folder, resolve_device

    try:
        widths = tuple(int(w) for w in args.widths.split(","))
    except ValueError:
        raise UserError(f"--widths must be comma-separated integers, got {args.widths!r}") from None
    if not widths or not all(1 <= w <= 8 for w in widths):
        raise UserError(f"--widths must be in 1..8, got {args.widths!r}")
    if args.prompts < 1:
        raise UserError(f"--prompts must be at least 1, got {args.prompts}")
    from ..bench import prefetch

    prefetch.run(model_folder(args.model), resolve_device(args.device), args.prompts, widths, args.out)
    return 0


def register_depth(bsub) -> None:
    d = bsub.add_parser("depth", help="the depth controller's gain over a fixed depth: paired TPOT, with an A/A' arm",
                        description="Decode held-out real-code prompts (the model's held-out corpus files, less the "
                                    "prompts iquest fit-depth fitted the controller on) with a "
                                    "fixed depth (A), the fitted depth controller (auto) and the fixed depth again "
                                    "(A'), in one process, each prompt with the same seed in every arm and the arms "
                                    "alternating in an order rotated per prompt. Per arm: decode time per output "
                                    "token (TPOT, prefill excluded), tokens and drafts per round; the paired ratio "
                                    "auto/A with a bootstrap interval and a sign test, and A'/A, the noise floor it "
                                    "must exceed. A table, and the raw JSON (--out).")
    d.add_argument("--model", help="checkpoint folder with its held-out corpus (default: the shipped mini model)")
    add_device(d)
    d.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    d.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt and arm (default 64)")
    d.add_argument("--repeats", type=int, default=3,
                   help="passes over the prompts, each with new seeds (default 3)")
    d.add_argument("--fixed", type=int, default=None,
                   help="the fixed depth 3..7 of arms A and A' (default: the best fixed depth iquest fit-depth "
                        "recorded in the model's depth_controller.json, 3 for the mini model; 3 without one)")
    d.add_argument("--seed", type=int, default=0,
                   help="request seed of the first prompt; unit u (repeat r, prompt i) uses seed + u (default 0)")
    d.add_argument("--out", help="the raw JSON (default bench/results/depth-MODEL-DEVICE-COMMIT.json)")
    d.set_defaults(run=run_depth)


def run_depth(args: argparse.Namespace) -> int:
    from .main import UserError
    from .options import model_folder, resolve_device

    for flag, value, low in (("--prompts", args.prompts, 1), ("--tokens", args.tokens, 1),
                             ("--repeats", args.repeats, 1), ("--seed", args.seed, 0)):
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if args.fixed is not None and not 3 <= args.fixed <= 7:
        raise UserError(f"--fixed must be in 3..7, got {args.fixed}")
    model_dir = model_folder(args.model)
    if not (model_dir / "corpus.json").exists():
        raise UserError(f"model folder {model_dir} has no corpus.json: bench depth needs its held-out files")
    device = resolve_device(args.device)
    from ..bench.depth import run as depth

    depth(model_dir=model_dir, device=device, prompts=args.prompts, tokens=args.tokens, repeats=args.repeats,
          fixed=args.fixed, seed=args.seed, out=args.out)
    return 0

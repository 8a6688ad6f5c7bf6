"""`iquest debug`: debugging tools. `debug diff`: both engines' activation taps side by side; `debug chain`:
each recursive draft depth's error split into what it carried in and what it added."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("debug", help="debugging tools (debug diff: taps side by side; debug chain: draft depths)",
                       description="Debugging tools for the fast engine against the float64 reference.")
    dsub = p.add_subparsers(dest="debug", required=True, metavar="TOOL")
    d = dsub.add_parser("diff", help="per layer and stage: fast vs reference activations at one position",
                        description="Run a prompt through both engines with activation taps, print each layer's "
                                    "stages side by side with their relative error at --position, name the first "
                                    "layer and stage over its tolerance, and plot error by layer (PNG).")
    d.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="def fibonacci(n):\n", help="prompt text (tokenized with tokenizer.json)")
    src.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    d.add_argument("--position", type=int, default=-1, help="absolute position to compare (default: the last)")
    d.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fast engine compute dtype")
    d.add_argument("--control", metavar="NAME",
                   help="build the fast engine as this negative control of iquest qualify does (its broken piece "
                        "substituted), to see where its defect shows; default: the healthy engine")
    d.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto",
                   help="fast engine kernels: auto (default: triton on cuda, torch on cpu), torch or triton")
    d.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the fast engine runs")
    d.add_argument("--plot", default="debug-diff.png", help="PNG path for the error-by-layer plot")
    d.add_argument("--json", metavar="OUT", help="also write the per-stage table as JSON")
    d.set_defaults(run=run)

    c = dsub.add_parser("chain", help="per draft depth: error carried along the chain vs error the depth adds",
                        description="Decode the qualification cases (as iquest qualify) and, for every draft "
                                    "row, compare the fast engine with the reference recursing on its own outputs "
                                    "(chain), with the reference recursing on the engine's outputs (step: what "
                                    "each depth adds), and with what iquest qualify scores (an expert swap the "
                                    "engine's own input explains compared under the engine's experts), with the "
                                    "MTP router's top-k margin and expert choices. Prints a table per depth and "
                                    "the worst chain.")
    c.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="fast engine compute dtype")
    c.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto",
                   help="fast engine kernels: auto (default: triton on cuda, torch on cpu), torch or triton")
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the fast engine runs")
    c.add_argument("--jobs", type=int, default=1, help="worker processes (one per case)")
    c.add_argument("--json", metavar="OUT", help="also write every row as JSON")
    c.set_defaults(run=run_chain)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from ..fast.rank import EngineParts
    from ..qualify.controls import control
    from ..qualify.diff import diff, print_diff
    from .engines import default_model_dir

    torch.set_num_threads(1)
    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.prompt_ids:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    else:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json: pass --prompt-ids")
        ids = Tokenizer.from_file(str(path)).encode(args.prompt).ids
    parts = EngineParts() if args.control is None else control(args.control).parts  # an unknown name: one line
    result = diff(model_dir, ids, args.position, args.dtype, parts, args.plot, args.json,
                  device=args.device, kernels=args.kernels)
    print_diff(result)
    return 0


def run_chain(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..qualify.chain import chain_report, print_chain, write_json
    from .engines import default_model_dir

    model_dir = str(Path(args.model) if args.model else default_model_dir())
    rows = chain_report(model_dir, args.dtype, args.kernels, args.device, args.jobs)
    print_chain(rows)
    if args.json:
        write_json(rows, args.json)
    return 0

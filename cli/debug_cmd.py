"""`iquest debug`: debugging tools. `debug diff`: both engines' activation taps side by side."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("debug", help="debugging tools (debug diff: taps of both engines side by side)",
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
    d.add_argument("--defect", action="append", default=[], metavar="NAME",
                   help="switch on a negative-control defect in the fast engine (repeatable)")
    d.add_argument("--kernels", default="auto",
                   help="fast engine stages: auto (default: triton on cuda, torch on cpu), torch, triton or a "
                        "'+'-joined subset (see iquest qualify)")
    d.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the fast engine runs")
    d.add_argument("--plot", default="debug-diff.png", help="PNG path for the error-by-layer plot")
    d.add_argument("--json", metavar="OUT", help="also write the per-stage table as JSON")
    d.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

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
    result = diff(model_dir, ids, args.position, args.dtype, frozenset(args.defect), args.plot, args.json,
                  device=args.device, kernels=args.kernels)
    print_diff(result)
    return 0

"""`iquest debug`: debugging tools. `debug diff`: both engines' activation taps side by side; `debug chain`:
each recursive draft depth's error split into what it carried in and what it added."""

from __future__ import annotations

import argparse

from .options import add_device, add_json, add_kernels, add_prompt

DEFAULT_PROMPT = "def fibonacci(n):\n"


def register(sub) -> None:
    p = sub.add_parser("debug", help="debugging tools (debug diff: taps side by side; debug chain: draft depths)",
                       description="Debugging tools for the fast engine against the float64 reference.")
    dsub = p.add_subparsers(dest="debug", required=True, metavar="TOOL")
    d = dsub.add_parser("diff", help="per layer and stage: fast vs reference activations at one position",
                        description="Run a prompt through both engines with activation taps, print each layer's "
                                    "stages side by side with their relative error at --position, name the first "
                                    "layer and stage over its tolerance, and plot error by layer (PNG).")
    d.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    add_prompt(d, DEFAULT_PROMPT)
    d.add_argument("--position", type=int, default=-1, help="absolute position to compare (default -1: the last)")
    d.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fast engine compute dtype (default fp32)")
    d.add_argument("--control", metavar="NAME",
                   help="build the fast engine as this negative control of iquest qualify does (its broken piece "
                        "substituted), to see where its defect shows (default: the healthy engine)")
    add_kernels(d)
    add_device(d, default="cpu")
    d.add_argument("--plot", default="debug-diff.png", help="PNG path for the error-by-layer plot (default "
                                                           "debug-diff.png)")
    add_json(d, text_to_stderr=True)
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
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="fast engine compute dtype (default bf16)")
    add_kernels(c)
    add_device(c, default="cpu")
    c.add_argument("--jobs", type=int, default=1, help="worker processes, one per case (default 1)")
    c.add_argument("--quick", action="store_true",
                   help="decode the two requests of iquest qualify --quick instead of its six (fits CI on a tiny fixture)")
    add_json(c, text_to_stderr=True)
    c.set_defaults(run=run_chain)


def run(args: argparse.Namespace) -> int:
    import contextlib
    import sys

    import torch

    from ..fast.rank import EngineParts
    from ..qualify.controls import control
    from ..qualify.diff import diff, print_diff
    from .options import engine_target, load_tokenizer, model_folder, print_json_file, prompt_ids

    parts = EngineParts() if args.control is None else control(args.control).parts  # an unknown name: one line
    model_dir = model_folder(args.model)
    ids = prompt_ids(args, load_tokenizer(model_dir), model_dir)
    device = engine_target(args.device, args.kernels)
    torch.set_num_threads(1)

    def diff_to(json_path):
        return diff(model_dir, ids, args.position, args.dtype, parts, args.plot, json_path, device=device,
                    kernels=args.kernels)
    if not args.json:
        print_diff(diff_to(None))
        return 0
    result = print_json_file(diff_to)
    with contextlib.redirect_stdout(sys.stderr):
        print_diff(result)
    return 0


def run_chain(args: argparse.Namespace) -> int:
    import sys

    from ..qualify.chain import chain_report, print_chain, write_json
    from .options import engine_target, model_folder, print_json_file

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    model_dir = str(model_folder(args.model))
    rows = chain_report(model_dir, args.dtype, args.kernels, engine_target(args.device, args.kernels), args.jobs,
                        args.quick)
    print_chain(rows, sys.stderr if args.json else sys.stdout)
    if args.json:
        print_json_file(lambda path: write_json(rows, path))
    return 0

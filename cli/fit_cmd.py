"""`iquest fit-depth`: fit the depth controller (`depth_controller.json`) from replay data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("fit-depth", help="fit the depth controller from depth-7 replays of held-out prompts",
                       description="Decode held-out prompts at fixed depth 7 with the float64 reference engine, fit "
                                   "the logistic depth rule (P(one more draft accepted) from the drafts' served "
                                   "probabilities, entropy, running product and depth), choose its threshold to "
                                   "minimize expected time per output token under the round-time cost model of "
                                   "docs/PERF.md, compare it with fixed depths 3..7 and the default rule "
                                   "(cross-validated by prompt) and write depth_controller.json.")
    p.add_argument("--model", help="checkpoint folder with corpus.json (default: the shipped mini model)")
    p.add_argument("--prompts", type=int, default=96, help="held-out prompts to replay (default 96)")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per prompt (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first prompt; prompt i uses seed + i (default 0)")
    p.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the non-bias weights (default 1.0)")
    p.add_argument("--folds", type=int, default=4, help="cross-validation folds over prompts (default 4)")
    p.add_argument("--out", help="where to write the controller (default: MODEL/depth_controller.json)")
    p.add_argument("--no-write", action="store_true", help="print only; write no file")
    p.add_argument("--round-costs", choices=["cpu", "cuda"], metavar="DEVICE",
                   help="instead of fitting: measure decode time per output token on DEVICE (cpu or cuda), plain "
                        "and with the controller, over 10 held-out prompts of 64 tokens, and record it in "
                        "MODEL/round_costs.json, from which --drafts auto picks plain sampling where drafting loses")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..fixtures.fit_depth import fit_depth, render_table
    from ..reference.depth import CONTROLLER_FILE
    from .engines import default_model_dir

    if args.prompts < 2 or args.tokens < 1 or args.folds < 2:
        raise ValueError("--prompts must be >= 2, --tokens >= 1 and --folds >= 2")
    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.round_costs:
        return _round_costs(model_dir, args.round_costs, args.no_write)
    if not (model_dir / "corpus.json").exists():
        raise FileNotFoundError(f"{model_dir} has no corpus.json (held-out files to replay)")
    command = f"iquest fit-depth --model {args.model or 'fixtures/iquest-q1-mini'} --prompts {args.prompts} " \
              f"--tokens {args.tokens} --seed {args.seed} --l2 {args.l2:g} --folds {args.folds}"
    record = fit_depth(model_dir, args.prompts, args.tokens, args.seed, args.l2, args.folds, command=command)
    print(render_table(record))
    if not args.no_write:
        out = Path(args.out) if args.out else model_dir / CONTROLLER_FILE
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


def _round_costs(model_dir: Path, device: str, no_write: bool) -> int:
    import torch

    from ..fixtures import round_costs

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--round-costs cuda needs a CUDA device")
    if not (model_dir / "corpus.json").exists():
        raise FileNotFoundError(f"{model_dir} has no corpus.json (held-out files to decode)")
    entry = round_costs.measure(model_dir, device)
    print(f"{device}: {entry['plain'] / 1000:.2f} ms a token plain, {entry['auto'] / 1000:.2f} ms with the controller "
          f"({entry['prompts']} prompts x {entry['tokens_per_prompt']} tokens, decode only)")
    if not no_write:
        print(f"wrote {round_costs.write(model_dir, device, entry)}")
    return 0

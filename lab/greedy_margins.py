"""How near a tie the float64 reference's greedy decode comes, position by position, on qualification's greedy request:
the measure by which decode.tokens and decode.acceptance judge a greedy divergence (qualify/agreement.py
`greedy_gap`, against the bound 2 e that logits each within e = tol_rel * scale of the reference's allow).

For each position of the reference's own greedy continuation: its two largest logits, their gap, the row's scale
(largest |logit|) and gap / (2 tol_rel scale). A fast engine may pick the runner-up where that ratio is at most 1; a
pick further below the maximum is a defect.

    python -m iquest.lab.greedy_margins --model fixtures/iquest-q1-mini --tokens 40 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def margins(model_dir: str, tokens: int, seed: int = 0, tol_rel: float | None = None) -> dict:
    from ..qualify import tolerances
    from ..qualify.agreement import divergence_bound, greedy_gap
    from ..qualify.checks import RefSpec
    from ..qualify.run import qualify_cases

    ref = RefSpec(model_dir).model()
    cases, _, _ = qualify_cases(ref.config.vocab_size, False, 0, seed)
    case = next(c for c in cases if c.params is not None and c.params[0] == 0)
    tol = tolerances.value("numerics.logits", "bf16") if tol_rel is None else tol_rel
    seq, rows = list(case.prompt), []
    for _ in range(tokens):
        logits, _ = ref.forward(torch.tensor(seq), torch.arange(len(seq)), ref.new_cache())
        x = logits[-1]
        top = torch.topk(x, 2)
        first, second = (int(i) for i in top.indices)
        scale = float(x.abs().max())
        gap = greedy_gap(x, second)
        rows.append({"position": len(seq), "argmax": first, "runner_up": second, "gap": gap, "scale": scale,
                     "ratio": gap / divergence_bound(tol, scale, 0.0)})
        seq.append(first)
    return {"model": model_dir, "seed": case.seed, "prompt_tokens": len(case.prompt), "tol_rel": tol,
            "rows": rows, "flips_explained_at": [r["position"] for r in rows if r["ratio"] <= 1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m iquest.lab.greedy_margins", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="fixtures/iquest-q1-mini", help="model folder (default: the mini model)")
    p.add_argument("--tokens", type=int, default=40, help="positions of the greedy continuation (default 40)")
    p.add_argument("--seed", type=int, default=0, help="qualify's --seed, which picks the requests (default 0)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    if a.tokens < 1:
        p.error("--tokens must be at least 1")
    r = margins(a.model, a.tokens, a.seed)
    print(f"greedy request seed {r['seed']}, prompt {r['prompt_tokens']} tokens, tol_rel {r['tol_rel']}")
    print("position  argmax  runner-up     gap    scale  gap/(2 tol scale)")
    for row in r["rows"]:
        print(f"{row['position']:8d}  {row['argmax']:6d}  {row['runner_up']:9d}  {row['gap']:6.3f}  "
              f"{row['scale']:7.3f}  {row['ratio']:8.3f}")
    print(f"a flip to the runner-up is within the logits' tolerance at {len(r['flips_explained_at'])} of "
          f"{len(r['rows'])} positions: {r['flips_explained_at']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far each of Gate/Up's scale forms (kernels/moe.py `MoESettings.gate_up_scale`) puts the MoE's output from the
exact one, on the mini model's own MoE inputs: a preview of what qualification will judge, on the CPU.

For held-out real-code prompts the float64 reference runs with its taps, and at every MoE layer its input b (the
`mlp_in` tap) and its routing (`experts`, and the weights renormalized from `router_scores`) are taken. Each layer's
output is then computed three ways from b rounded to bf16 and the checkpoint's E4M3 experts:
- exact: float64 throughout, the weights exactly dequantized (the reference's arithmetic on bf16 b);
- "weight": each weight element rounded to bf16 after its scale (the default form's torch arithmetic, `moe_torch`);
- "product": each K step's fp32 product of the exact E4M3 tile times the row's scale (`moe_torch(settings=...)`).
Reported per form and layer: the largest difference from the exact output over its largest magnitude (worst over the
prompts), and the root-mean-square difference over the exact output's (over all prompts' rows).

    python -m iquest.lab.moe_scale_forms --model fixtures/iquest-q1-mini --prompts 8 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FORMS = ("weight", "product")


def exact_moe(b: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate, up, down) -> torch.Tensor:
    """The MoE in float64 from b's values and the exactly dequantized E4M3 experts (kernels.moe.ExpertWeights)."""
    from ..reference.fp8 import dequantize
    from ..reference.layers import expert_mlp

    def dense(w, e: int) -> torch.Tensor:  # expert e's [rows, cols], float64
        return dequantize(w.q[e], w.scale[e], w.block, offset=w.offset)

    x = b.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[r, j])
            out[r] += weights[r, j].double() * expert_mlp(x[r], dense(gate, e), dense(up, e), dense(down, e))
    return out


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-300)


def squares(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(sum of squared differences, sum of squared exact values)."""
    return ((got.double() - ref) ** 2).sum().item(), (ref ** 2).sum().item()


def run(model_dir: Path, n_prompts: int, progress=None) -> dict:
    from tokenizers import Tokenizer

    from ..fast.parallel import Parallel
    from ..fast.weights import MoE, load_weights
    from ..fixtures.fit_depth import replay_prompts
    from ..kernels import moe as mk
    from ..provenance import commit
    from ..reference.model import ReferenceModel

    say = progress or (lambda msg: None)
    model = ReferenceModel.load(model_dir)
    c = model.config
    w = load_weights(model_dir, c, Parallel.single("cpu"), torch.bfloat16, progress=False, fmt="fp8")
    experts_of = {i: [mk.ExpertWeights(p.q, p.scale, p.block, p.offset) for p in (lw.mlp.gate, lw.mlp.up, lw.mlp.down)]
                  for i, lw in enumerate(w.layers) if isinstance(lw.mlp, MoE)}
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    worst = {f: {} for f in FORMS}
    sums = {f: {} for f in FORMS}  # layer -> [squared differences, squared exact values]
    for j, (_, _, ids) in enumerate(replay_prompts(Path(model_dir), tok, n_prompts)):
        taps: dict = {}
        model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(), taps)
        for i, (gate, up, down) in experts_of.items():
            b = taps[f"layer{i}.mlp_in"].to(torch.bfloat16)
            experts = taps[f"layer{i}.experts"]
            chosen = taps[f"layer{i}.router_scores"].gather(1, experts)
            weights = (chosen / chosen.sum(-1, keepdim=True)).float()
            ref = exact_moe(b, experts, weights, gate, up, down)
            for f in FORMS:
                got = mk.moe_torch(b, experts, weights, gate, up, down, mk.MoESettings(gate_up_scale=f))
                worst[f][i] = max(worst[f].get(i, 0.0), rel(got, ref))
                acc = sums[f].setdefault(i, [0.0, 0.0])
                for k, v in enumerate(squares(got, ref)):
                    acc[k] += v
        say(f"prompt {j + 1}: {len(ids)} positions")
    return {"lab": "moe_scale_forms", "commit": commit(), "model": str(model_dir), "prompts": n_prompts,
            "split": mk.MoESettings().gate_up_split,
            "worst_rel": {f: {str(i): v for i, v in worst[f].items()} for f in FORMS},
            "worst_rel_all": {f: max(worst[f].values()) for f in FORMS},
            "rms_rel": {f: {str(i): (d / r) ** 0.5 for i, (d, r) in sums[f].items()} for f in FORMS},
            "rms_rel_all": {f: (sum(d for d, _ in sums[f].values()) / sum(r for _, r in sums[f].values())) ** 0.5
                            for f in FORMS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m iquest.lab.moe_scale_forms", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(__file__).resolve().parents[1] / "fixtures" / "iquest-q1-mini")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report = run(args.model, args.prompts, progress=lambda m: print(m, file=sys.stderr))
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fused rule against the torch form (RoundRunner.more's ops, its score kept): bits of score and entropy and the
decisions over random draft distributions shaped like the sampler's (20 candidates, top-p 0.95 zeros)."""
import math
import sys

import torch

from iquest.reference.depth import FEATURES, load_controller
from iquest.lab.depth_probe.mend import decide
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "iquest-q1-mini"


def torch_form(c, depth, served, probs, product):
    plogp = torch.where(probs > 0, probs * torch.log(probs.clamp(min=1e-30)), torch.zeros_like(probs))
    feats = {"bias": torch.ones_like(served), "log_running_product": torch.log(product.clamp(min=1e-30)),
             "log_served_prob": torch.log(served.clamp(min=1e-30)), "entropy": -plogp.sum(),
             "depth": torch.full_like(served, float(depth))}
    score = sum(w * feats[name] for name, w in c.weights.items())
    thr = math.log(c.threshold / (1 - c.threshold))
    return score, feats["entropy"], (score > thr).to(torch.int32)


def main(n=2000, device="cuda"):
    c = load_controller(MODEL)
    names = list(c.weights)
    codes = tuple(FEATURES.index(x) for x in names) + (0,) * (5 - len(names))
    ws = tuple(float(c.weights[x]) for x in names) + (0.0,) * (5 - len(names))
    thr = math.log(c.threshold / (1 - c.threshold))
    g = torch.Generator().manual_seed(0)
    more = torch.zeros(1, dtype=torch.int32, device=device)
    dbg = torch.zeros(2, dtype=torch.float32, device=device)
    score_diff = ent_diff = dec_diff = near = 0
    worst = 0.0
    for i in range(n):
        logits = torch.randn(20, generator=g) * (0.5 + 4 * torch.rand(1, generator=g))
        p = torch.softmax(logits, 0).sort(descending=True).values
        keep = (p.cumsum(0) - p) < 0.95
        p = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
        probs = p.float().to(device)
        served = probs[torch.randint(0, int(keep.sum()), (1,), generator=g)].clone()
        product = (served * torch.rand(1, generator=g).to(device) ** 2).view(())
        depth = 3 + i % 4
        s_t, e_t, d_t = torch_form(c, depth, served, probs, product)
        decide(probs, served, product, more, depth, codes, ws, thr, score_out=dbg)
        s_f, e_f = dbg[0], dbg[1]
        score_diff += int(not torch.equal(s_t.view(1).float(), s_f.view(1)))
        ent_diff += int(not torch.equal(e_t.view(1), e_f.view(1)))
        dec_diff += int(int(d_t) != int(more))
        worst = max(worst, abs(float(s_t) - float(s_f)))
        near += int(abs(float(s_t) - thr) < 1e-5)
    print(f"fused vs torch form over {n} draws ({device}): score bits differ {score_diff}, entropy bits differ "
          f"{ent_diff}, decisions differ {dec_diff}, max |score diff| {worst:.3g}, "
          f"scores within 1e-5 of the threshold {near}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000, sys.argv[2] if len(sys.argv) > 2 else "cuda")

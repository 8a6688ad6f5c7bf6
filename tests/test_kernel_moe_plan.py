"""kernels/moe_route.py's routing plan (`moe_plan`) against plain torch (`moe_plan_ref`).

The MoE's weight-streaming kernels read their expert and rows from the plan, so the plan decides which expert weights
are read at all: every distinct expert of the live rows exactly once (the first live pair in row-major order owns it),
the rows that chose it with their pair index, padding rows never. The interpreter worker checks the written entries
bit for bit on a seeded sweep over shapes (R 1..16, k 1..8, E from k to 300), live forms (all, mask, count, none),
routing patterns (random, every row the same experts, one shared expert) and the dedup switch; the negative control
(dedup off) must list repeated experts, and does on the cases that have any. On the GPU the same sweep runs again.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import moe_route as mr
from iquest.kernels.testing import interpreted_tests

PATTERNS = ("random", "same", "shared")
LIVE = ("all", "mask", "count", "none")


def sweep(n: int = 48, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(1, 9, (1,), generator=gen))
        R = int(torch.randint(1, min(16, mr.MAX_PAIRS // k) + 1, (1,), generator=gen))
        E = int(torch.randint(k, 301, (1,), generator=gen))
        out.append(dict(name=f"sweep{i}", R=R, k=k, E=E, pattern=PATTERNS[i % 3], live=LIVE[i % 4], seed=i,
                        dedup=i % 5 != 4))
    return out


CASES = sweep() + [dict(name="max_pairs_k4", R=32, k=4, E=6, pattern="random", live="mask", seed=1, dedup=True),
                   dict(name="full_size_6rows", R=6, k=8, E=256, pattern="random", live="all", seed=2, dedup=True)]


def build(c: dict, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(c["seed"])
    R, k, E = c["R"], c["k"], c["E"]
    if c["pattern"] == "same":
        rows = [torch.randperm(E, generator=gen)[:k]] * R
        rows = [r[torch.randperm(k, generator=gen)] for r in rows]
    elif c["pattern"] == "shared":  # expert 0 in every row, in varying slots (a row's experts stay distinct)
        rows = [torch.randperm(E - 1, generator=gen)[:k - 1] + 1 for _ in range(R)]
        rows = [torch.cat([r[:j], torch.tensor([0]), r[j:]])
                for r, j in zip(rows, torch.randint(0, k, (R,), generator=gen).tolist())]
    else:
        rows = [torch.randperm(E, generator=gen)[:k] for _ in range(R)]
    experts = torch.stack(rows).to(torch.int64)
    assert all(len(set(r)) == k for r in experts.tolist()), "a row's experts must be distinct"
    live = {"all": torch.ones(R, dtype=torch.bool), "mask": torch.rand(R, generator=gen) > 0.3,
            "count": torch.tensor([int(torch.randint(0, R + 1, (1,), generator=gen))]),
            "none": torch.zeros(R, dtype=torch.bool)}[c["live"]]
    return experts.to(device), live.to(device)


def run_case(c: dict, device: str) -> dict:
    experts, live = build(c, device)
    R, k = experts.shape
    plan = mr.moe_plan(experts, live, dedup=c["dedup"])
    got = mr.plan_entries(plan, R, R * k)
    want = mr.moe_plan_ref(experts.cpu(), live.cpu(), c["dedup"])
    deduped = mr.moe_plan_ref(experts.cpu(), live.cpu(), True)
    return {"equal": bool(torch.equal(got, want)), "count": int(got[0]), "distinct": int(deduped[0])}


def _check(c: dict, r: dict) -> None:
    assert r["equal"], f"{c['name']}: the plan differs from moe_plan_ref"
    if not c["dedup"]:
        assert r["count"] >= r["distinct"]


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check)


def test_sweep_covers_the_forms(interpreted):
    """The sweep reaches repeated experts with dedup off (the negative control lists them: more entries than
    distinct experts), every live form and empty plans."""
    rs = [(c, interpreted[c["name"]]) for c in CASES]
    assert any(not c["dedup"] and r["count"] > r["distinct"] for c, r in rs)
    assert any(r["count"] == 0 for _, r in rs) and {c["live"] for c, _ in rs} == set(LIVE)


def test_rejects_a_short_plan_buffer():
    with pytest.raises(ValueError, match="plan must be contiguous int32"):
        mr.moe_plan(torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, dtype=torch.bool),
                    plan=torch.zeros(3, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])

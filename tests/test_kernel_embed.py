"""kernels/embed.py against the torch sequence it replaces (fast/torch_ops.embed: the engine's embedding before the
all-reduce), bit for bit, zero signs included (NaN as NaN, whatever its payload).

Each case draws a rank's slice of a vocabulary ([V, H] rows, V = vocab / tp, offset = rank * V) with a NaN row and
negative values (so a masked row's zeros carry signs), tokens inside and outside the slice (below, above, at both
edges), and a NaN-prefilled output. The interpreter worker runs the cases on CPU; the GPU runs them at real sizes.
A negative control embeds with the slice's offset dropped, which the comparison must catch on a case whose tokens
lie outside rank 0's slice. The interpreter runs every case: all of them together cost it well under a second.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.fast import torch_ops
from iquest.kernels import embed as ek
from iquest.kernels.testing import interpreted_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BASE = dict(R=8, V=50, H=96, rank=1, dtype="fp32", seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_rank0", R=1, rank=0),
    case("8rows_rank1_fp32"),
    case("8rows_rank1_bf16", dtype="bf16"),
    case("6rows_rank3_partial_block_bf16", R=6, H=1500, rank=3, dtype="bf16"),  # two column blocks, the last partial
    case("tp1_all_inside", rank=0, V=400, tp=1),
]
GPU_CASES = [case("gpu_tp8_rank5_bf16", R=8, V=20000, H=3072, rank=5, dtype="bf16"),
             case("gpu_tp1_mini_fp32", R=8, V=4096, H=256, rank=0, dtype="fp32", tp=1)]


def build(c: dict, device: str):
    gen = torch.Generator().manual_seed(c["seed"])
    R, V, H, rank = c["R"], c["V"], c["H"], c["rank"]
    table = torch.randn(V, H, generator=gen).to(DTYPES[c["dtype"]])
    table[V // 2] = float("nan")
    offset = rank * V
    tp = c.get("tp", 8)
    vocab = V * tp
    edges = [offset - 1, offset, offset + V - 1, offset + V, offset + V // 2, 0, vocab - 1]
    tokens = torch.tensor([t for t in edges if 0 <= t < vocab] + torch.randint(0, vocab, (R,), generator=gen).tolist())
    return table.to(device), tokens[:R].contiguous().to(device), offset


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def run_case(c: dict, device: str, offset_delta: int = 0) -> dict:
    table, tokens, offset = build(c, device)
    out = torch.full((c["R"], c["H"]), float("nan"), dtype=table.dtype, device=device)
    got = ek.embed(tokens, table, offset + offset_delta, out=out)
    want = torch_ops.embed(tokens, table, offset)
    local = tokens - offset
    inside = ((local >= 0) & (local < c["V"])).cpu()
    # NaN rows compare as NaN (payload bits are not a value: the interpreter's casts give other NaN codes)
    nan = got.isnan() & want.isnan()
    return {"bits": bool(torch.equal(bits(got)[~nan], bits(want)[~nan]) and torch.equal(got.isnan(), want.isnan())),
            "same_tensor": got is out,
            "inside": int(inside.sum()), "outside": int((~inside).sum()),
            "negative_zeros": int(((got == 0) & torch.signbit(got)).sum()), "nan_rows": int(got.isnan().all(1).sum())}


def _check(c: dict, r: dict) -> None:
    assert r["same_tensor"]
    assert r["bits"], f"{c['name']}: differs from the torch sequence"
    assert r["inside"] >= 1
    if c.get("tp", 8) > 1 and c["R"] > 1:
        assert r["outside"] >= 1 and r["negative_zeros"] > 0, "no masked row with signed zeros: the case tests less"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check)


def test_interpreted_negative_control(interpreted):
    """The slice's offset dropped: rows of other ranks' tokens are taken, and the comparison fails."""
    r = interpreted["negative_control"]
    assert "error" not in r, r.get("error")
    assert r["outside"] >= 1 and not r["bits"]


@pytest.mark.parametrize("over, message", [
    (dict(tokens=torch.zeros(2, dtype=torch.int32)), "tokens"),
    (dict(tokens=torch.zeros(2, 1, dtype=torch.int64)), "tokens"),
    (dict(table=torch.zeros(4, 8, dtype=torch.int64)), "table"),
    (dict(table=torch.zeros(8, 4).t()), "table"),
    (dict(offset=-1), "offset"),
    (dict(out=torch.zeros(2, 7)), "out"),
])
def test_rejects_bad_inputs(over, message):
    a = dict(tokens=torch.zeros(2, dtype=torch.int64), table=torch.zeros(4, 8), offset=0)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        ek.embed(**a)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [("negative_control", lambda: run_case(CASES[1], "cpu", offset_delta=-CASES[1]["V"]))])

"""kernels/f16_operands.py: bf16 rows scaled by powers of two into exact fp16 tensor-core operands (no kernel of the
published model's path reads them today: docs/PERF.md, "fp16 operands").

CPU (the interpreter worker, and plain torch):
- the kernel's conversion is bit-identical to `f16_rows_tiles_ref` on rows of every magnitude class: ordinary
  rows, zero rows, tiny rows (below the 2^-112 cap), huge rows near bf16's largest, inf/NaN, subnormal bf16;
- property (hypothesis): a bf16 row tile whose elements are zero or within 2^31 of its largest converts exactly,
  and the scaled fp32 product (x16 @ W^T) * 2^-s equals x @ W^T bit for bit: the identity the kernels rely on;
- the boundary: an element 2^-40 below its row's largest does not survive (the documented exception), and the
  check sees it.
The interpreter runs every case (~2 s): the operand roundings are exact bits, which is what it checks.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from iquest.kernels import f16_operands as fo
from iquest.kernels.testing import interpreted_tests


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits, NaN payloads aside (NaN where the other has NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(0.0, float("inf"), float("-inf")), b.nan_to_num(0.0, float("inf"), float("-inf"))
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.view(view), b.view(view)))


def rows(kind: str, gen: torch.Generator, M: int = 5, K: int = 256) -> torch.Tensor:
    x = torch.randn(M, K, generator=gen)
    if kind == "zero":
        x[1] = 0
    elif kind == "tiny":
        x = x * 2.0 ** -118
    elif kind == "huge":
        x = x * 2.0 ** 125
    elif kind == "special":
        x[0, 3], x[1, 7], x[2, 9] = float("inf"), float("nan"), float("-inf")
    elif kind == "subnormal_bf16":
        x[3] = x[3] * 2.0 ** -130
    return x.to(torch.bfloat16)


CASES = [{"name": k, "kind": k, "dtype": d} for k in ("ordinary", "zero", "tiny", "huge", "special", "subnormal_bf16")
         for d in ("bf16", "fp32")]
def run_case(c: dict, device: str) -> dict:
    x = rows(c["kind"], torch.Generator().manual_seed(len(c["name"])))
    x = (x if c["dtype"] == "bf16" else x.float()).to(device)
    y, d = fo.f16_rows_tiles(x)
    ry, rd = fo.f16_rows_tiles_ref(x.cpu())
    return {"y_bits": _equal_bits(y.cpu(), ry), "down_bits": _equal_bits(d.cpu(), rd),
            "exact_tiles": int(fo.exact_in_f16(x.cpu()).sum()), "tiles": d.numel()}


def _check(c: dict, r: dict) -> None:
    assert r["y_bits"] and r["down_bits"], f"{c['name']}: kernel conversion differs from f16_rows_tiles_ref"
    if c["kind"] in ("ordinary", "zero", "huge"):
        assert r["exact_tiles"] == r["tiles"]


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check)


def bf16_row(draw_exps, signs, mants) -> torch.Tensor:
    vals = [s * (1 + m / 128) * 2.0 ** e for e, s, m in zip(draw_exps, signs, mants)]
    return torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(top=st.integers(-110, 120), data=st.data())
def test_rows_within_2_31_are_exact_and_scale_out_of_the_product(top, data):
    """Elements 0 or within 2^31 of the row's largest: exact in fp16, and (x16 @ W^T) * 2^-s == x @ W^T bitwise
    (fp32 products of exact values, scaled by a power of two: the kernels' argument, on torch's matmul)."""
    K = 128
    exps = data.draw(st.lists(st.integers(top - 30, top), min_size=K, max_size=K))
    signs = data.draw(st.lists(st.sampled_from([-1, 1]), min_size=K, max_size=K))
    mants = data.draw(st.lists(st.integers(0, 127), min_size=K, max_size=K))
    zeros = data.draw(st.lists(st.integers(0, K - 1), max_size=8))
    x = bf16_row(exps, signs, mants)[None]
    x[0, zeros] = 0
    assert bool(fo.exact_in_f16(x).all())
    y, d = fo.f16_rows_tiles_ref(x)
    w = torch.randn(16, K, generator=torch.Generator().manual_seed(top + 200)).to(torch.float8_e4m3fn).float()
    want = x.float() @ w.T
    got = (y.float() @ w.T) * d[:, :1]
    assert torch.equal(got, want) or not bool(torch.isfinite(want).all())


def test_the_boundary_element_is_lost():
    """An element 2^-40 below its row tile's largest is not an fp16 value after the scaling: the one documented
    exception, and exact_in_f16 reports it."""
    x = torch.ones(2, 128, dtype=torch.bfloat16)
    x[1, 5] = 2.0 ** -40
    assert fo.exact_in_f16(x).tolist() == [[True], [False]]
    y, d = fo.f16_rows_tiles_ref(x)
    assert float(y[1, 5]) * float(d[1, 0]) != 2.0 ** -40


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="contiguous float"):
        fo.f16_rows_tiles(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="dividing N"):
        fo.f16_rows_tiles(torch.ones(4, 100))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])

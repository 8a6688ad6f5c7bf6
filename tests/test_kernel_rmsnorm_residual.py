"""kernels/rmsnorm_residual.py against reference rms_norm of the rounded residual sum.

Small shapes (1 and 8 rows, hidden sizes that are not powers of two, in-place residual update,
strided rows, fp32 output for routing) under Triton's CPU interpreter in one worker subprocess;
`@pytest.mark.gpu` cases at H = 6144. Outputs are pre-filled with NaN. The interpreter runs every case: one row
program each, well under a second together.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import rmsnorm_residual as rn
from iquest.kernels.testing import interpreted_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-6, "bf16": 1.6e-2}  # on y relative to max |y|: fp32 summation order; bf16 roundings
# Triton's interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so there a
# bf16 residual may differ from torch's rounded sum by one unit in the last place (2^-7 relative).
INTERPRETED_BF16_ULP = 2.0 ** -7

BASE = dict(R=8, H=100, dtype="bf16", out=None, inplace=False, stride=None, residual=True, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_bf16", R=1),
    case("8rows_bf16"),
    case("8rows_fp32", dtype="fp32", H=48),
    case("bf16_residual_fp32_out", out="fp32"),
    case("inplace_residual", inplace=True),
    case("strided_rows", stride=3, H=37),
    case("norm_only_1row_bf16", R=1, residual=False),
    case("norm_only_8rows_fp32", dtype="fp32", H=48, residual=False),
    case("norm_only_strided_fp32_out", stride=3, H=37, out="fp32", residual=False),
]
GPU_CASES = [case("gpu_1row", R=1, H=6144), case("gpu_8rows", H=6144), case("gpu_8rows_fp32_out", H=6144, out="fp32"),
             case("gpu_inplace", H=6144, inplace=True), case("gpu_norm_only_8rows", H=6144, residual=False)]


def run_case(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, H, dt = c["R"], c["H"], DTYPES[c["dtype"]]
    x = (torch.randn(R, H * (c["stride"] or 1), generator=gen) * 3).to(dt)[:, :H].to(device)
    r = (torch.randn(R, H, generator=gen) * 3).to(dt).to(device)
    w = (1 + 0.5 * torch.randn(H, generator=gen)).to(dt).to(device)
    eps = 1e-6
    if not c["residual"]:  # the input norm: the same kernel without the residual sum
        y_ref = rn.rmsnorm_ref(x, w, eps, DTYPES[c["out"]] if c["out"] else None)
        y = rn.rmsnorm(x, w, eps, DTYPES[c["out"]] if c["out"] else None, out=torch.full_like(y_ref, float("nan")))
        pre, bad = (rn.rmsnorm(x, wp, eps, DTYPES[c["out"]] if c["out"] else None, preload=True, pdl=x.is_cuda,
                               out=torch.full_like(y_ref, float("nan"))) for wp in (w, _off_by_one(w)))
        return {"y_err": (y.float() - y_ref.float()).abs().max().item() / y_ref.float().abs().max().item(),
                "h_err": 0.0, "finite": bool(torch.isfinite(y).all()), "preload_bits": bool(torch.equal(pre, y)),
                "control_bits": bool(torch.equal(bad, y))}
    y_ref, h_ref = rn.rmsnorm_residual_ref(x, r, w, eps, DTYPES[c["out"]] if c["out"] else None)
    out = torch.full_like(y_ref, float("nan"))
    h_out = r if c["inplace"] else torch.full_like(r, float("nan"))
    r0 = r.clone()  # in place: the preloaded call below starts from the same residual
    y, h = rn.rmsnorm_residual(x, r, w, eps, DTYPES[c["out"]] if c["out"] else None, out=out, residual_out=h_out)
    assert y is out and h is h_out
    y2, h2 = rn.rmsnorm_residual(x, r0, w, eps, DTYPES[c["out"]] if c["out"] else None, preload=True, pdl=x.is_cuda)
    preload_bits = bool(torch.equal(y2, y) and torch.equal(h2, h))
    bad, _ = rn.rmsnorm_residual(x, r0, _off_by_one(w), eps, DTYPES[c["out"]] if c["out"] else None, preload=True,
                                 pdl=x.is_cuda)
    return {"y_err": (y.float() - y_ref.float()).abs().max().item() / y_ref.float().abs().max().item(),
            "h_err": ((h.float() - h_ref.float()).abs() / h_ref.float().abs().clamp(min=1e-30)).max().item(),
            "finite": bool(torch.isfinite(y).all() and torch.isfinite(h).all()), "preload_bits": preload_bits,
            "control_bits": bool(torch.equal(bad, y))}


def _off_by_one(w: torch.Tensor) -> torch.Tensor:
    """Negative control of the preload's bit check: the weight with its last element doubled (the last, so a
    preload that dropped the row's tail would show too)."""
    bad = w.clone()
    bad[-1] *= 2
    return bad


def _check(c: dict, r: dict, interpreted: bool = False) -> None:
    assert r["finite"], "NaN left in an output"
    assert r["preload_bits"], "the weight read before the wait changed an output"
    assert not r["control_bits"], "a changed weight gave the same bits: the preload's bit check proves nothing"
    h_tol = INTERPRETED_BF16_ULP if interpreted and c["dtype"] == "bf16" else 0.0
    assert r["h_err"] <= h_tol, f"the new residual differs from the rounded sum by {r['h_err']:.2e} (relative)"
    tol = max(TOL[c["out"] or c["dtype"]], h_tol)
    assert r["y_err"] <= tol, f"{c['name']}: max |y - ref| / max |ref| = {r['y_err']:.2e} > {tol:.1e}"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, lambda c, r: _check(c, r, interpreted=True))


@pytest.mark.parametrize("over, message", [
    (dict(residual=torch.randn(2, 9)), "same"),
    (dict(weight=torch.randn(9)), "weight"),
    (dict(x=torch.randn(2, 8).int()), "dtypes"),
    (dict(x=torch.randn(8, 2).T), "unit stride"),
    (dict(eps=0), "eps"),
    (dict(out=torch.empty(2, 8, dtype=torch.bfloat16)), "out must be"),
])
def test_rejects_bad_inputs(over, message):
    a = dict(x=torch.randn(2, 8), residual=torch.randn(2, 8), weight=torch.randn(8), eps=1e-6)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        rn.rmsnorm_residual(**a)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])

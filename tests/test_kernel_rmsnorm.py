"""kernels/rmsnorm.py (`rmsnorm`, the sandwich tail `add_norm`) against their torch forms (`rmsnorm_torch`,
`add_norm_torch`), under Triton's CPU interpreter in one worker subprocess; `@pytest.mark.gpu` cases at H = 3072.

Cases cover both uses of `add_norm` in the published layer (after attention: the branch normalized, scale 1; after
a later layer's MLP: no branch norm, scale 0.5388...), the draft's fp32 residual stream beside the target's bf16 one,
1 and 8 rows, hidden sizes that are not powers of two, strided rows, outputs as column views and the residual updated
in place. Outputs are pre-filled with NaN.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.kernels import rmsnorm as rn
from iquest.kernels.rmsnorm import _on_grid
from iquest.kernels.testing import interpreted_tests, substitute, substituted

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
C_F = 0.53881590608  # ffn_out_scale of layers >= 1 (docs/model.md, "Config")

# Agreement with the torch form. max_rel: max |kernel - torch| / max |torch| over a tensor; mismatch: the fraction of
# elements allowed to differ at all (one more element is always allowed). "fp32": every rounding on the way is fp32;
# "bf16": some value on the way is a norm rounded to bf16. A sum with no norm before it must match bit for bit.
TOL = {
    "fp32": dict(max_rel=2.0 ** -20, mismatch=1.0,
                 why="a row's sum of squares is added in Triton's tree order, not torch's, so 1/rms and every value "
                     "scaled by it may differ by a few fp32 ulps; measured on the interpreter at H 3072, 512 rows: "
                     "up to 2^-22.5 of the tensor's largest value, in ~25% of the values"),
    "bf16": dict(max_rel=2.0 ** -6, mismatch=1e-3,
                 why="those few fp32 ulps change a bf16 rounding only for a value within them of a rounding midpoint; "
                     "a changed rounding is one bf16 ulp, and one in the branch moves the sum h by at most that; "
                     "measured on the interpreter at H 3072, 512 rows, bf16 and fp32 residuals, scale 1 and c_f: at "
                     "most 16 of 1,572,864 values of b and 8 of h differ, by at most 2^-8.8 of the largest value"),
}

BASE = dict(op="add_norm", R=8, H=100, residual="bf16", y="bf16", dtype="bf16", scale=1.0, y_norm=True,
            strided=False, inplace=False, out_view=False, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("norm_1row_bf16", op="rmsnorm", R=1, residual=None),
    case("norm_8rows_fp32", op="rmsnorm", y="fp32", dtype="fp32", H=48),
    case("norm_bf16_in_fp32_out", op="rmsnorm", dtype="fp32", strided=True),
    case("norm_fp32_in_bf16_out_column_view", op="rmsnorm", y="fp32", out_view=True, H=37),  # half of z's row
    case("norm_full_width_8rows_bf16", op="rmsnorm", H=3072),
    case("attn_tail_1row_bf16", R=1),                                     # h, b = add_norm(a, attn_out, 1, ...)
    case("attn_tail_8rows_bf16"),
    case("attn_tail_full_width_bf16", H=3072),
    case("mlp_tail_bf16", scale=C_F, y_norm=False),                       # x' = add_norm(h, mlp_out, c_f, None, ...)
    case("mlp_tail_full_width_bf16", H=3072, scale=C_F, y_norm=False),
    case("scaled_normed_branch_bf16", scale=C_F),
    case("draft_attn_tail_fp32_residual", residual="fp32"),                # the draft's fp32 stream, bf16 branch
    case("draft_scaled_fp32_residual", residual="fp32", scale=C_F, H=3072),
    case("draft_unnormed_fp32_residual", residual="fp32", scale=C_F, y_norm=False),
    case("in_place_strided_bf16", inplace=True, strided=True, scale=C_F, H=37),
    case("all_fp32", residual="fp32", y="fp32", dtype="fp32", scale=C_F, H=48),
    case("fp32_branch_into_bf16_residual", y="fp32", y_norm=False, scale=C_F),
]
GPU_CASES = [
    case("gpu_norm_8rows", op="rmsnorm", H=3072),
    case("gpu_norm_128rows_column_view", op="rmsnorm", R=128, H=3072, out_view=True),
    case("gpu_attn_tail_1row", R=1, H=3072),
    case("gpu_attn_tail_8rows", H=3072),
    case("gpu_mlp_tail_8rows", H=3072, scale=C_F, y_norm=False),
    case("gpu_draft_tail_fp32_residual", H=3072, residual="fp32"),
    case("gpu_in_place_128rows", R=128, H=3072, inplace=True, scale=C_F, y_norm=False),
]


def _agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float().cpu(), want.float().cpu()
    return {"mismatch": int((got != want).sum()), "n": got.numel(),
            "max_rel": float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))}


def _rows(gen, R: int, H: int, dtype: torch.dtype, scale: float, strided: bool, device: str) -> torch.Tensor:
    x = (torch.randn(R, 3 * H if strided else H, generator=gen) * scale).to(dtype).to(device)
    return x[:, H:2 * H] if strided else x


def run_case(c: dict, device: str, pdl: bool = False, bits: bool = False) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, H, dt = c["R"], c["H"], DTYPES[c["dtype"]]
    y = _rows(gen, R, H, DTYPES[c["y"]], 5.0, c["strided"], device)
    w1, w2 = ((1 + 0.3 * torch.randn(H, generator=gen)).to(torch.bfloat16).to(device) for _ in range(2))
    if c["op"] == "rmsnorm":
        want = rn.rmsnorm_torch(y, w1, 1e-6, dt)
        if c["out_view"]:  # the norm written into one half of a wider row (the draft's concat(e, g))
            z = torch.full((R, 2 * H), float("nan"), dtype=dt, device=device)
            out = z[:, H:]
        else:
            out = torch.full((R, H), float("nan"), dtype=dt, device=device)
        got = rn.rmsnorm(y, w1, 1e-6, dt, out=out, pdl=pdl)
        assert got is out
        if bits:
            return [got]
        return {"b": _agreement(got, want), "finite": bool(torch.isfinite(got).all()),
                "left_half_untouched": not c["out_view"] or bool(z[:, :H].isnan().all())}
    res = _rows(gen, R, H, DTYPES[c["residual"]], 3.0, c["strided"], device)
    y_norm_w = w1 if c["y_norm"] else None
    want_h, want_b = rn.add_norm_torch(res, y, c["scale"], y_norm_w, w2, 1e-6, dt)
    kept = res.clone()
    h_out = res if c["inplace"] else torch.full_like(want_h, float("nan"))
    h, b = rn.add_norm(res, y, c["scale"], y_norm_w, w2, 1e-6, dt, h_out=h_out,
                       b_out=torch.full_like(want_b, float("nan")), pdl=pdl)
    assert h is h_out and h.dtype == res.dtype and b.dtype == dt
    if bits:
        return [h, b]
    return {"h": _agreement(h, want_h), "b": _agreement(b, want_b),
            "finite": bool(torch.isfinite(h).all() and torch.isfinite(b).all()),
            "residual_kept": c["inplace"] or bool(torch.equal(res, kept))}


def _within(a: dict, tol: dict) -> bool:
    return a["max_rel"] <= tol["max_rel"] and a["mismatch"] <= 1 + tol["mismatch"] * a["n"]


def _check(c: dict, r: dict) -> None:
    tol = TOL[c["dtype"]]
    assert r["finite"], "NaN left in an output"
    if c["op"] == "rmsnorm":
        assert r["left_half_untouched"], "the norm wrote outside its column view"
        assert _within(r["b"], tol), f"{c['name']}: {r['b']} outside {tol}"
        return
    assert r["residual_kept"], "the residual changed without h_out = residual"
    if c["y_norm"]:
        assert _within(r["h"], tol), f"{c['name']}: h {r['h']} outside {tol}"
    else:  # no reduction before the sum: torch's roundings exactly
        assert r["h"]["mismatch"] == 0, f"{c['name']}: h is not torch's rounded sum ({r['h']})"
    assert _within(r["b"], tol), f"{c['name']}: b {r['b']} outside {tol}"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check,
                                                  lambda c, r: f"{c['name']}: {r.get('h', '')} {r['b']}")


# ---- negative controls: broken pieces put into copies of the kernels (kernels.testing.substituted) -----------------


@triton.jit
def _branch_before_norm(y, yw, eps, H, Y_NORM: tl.constexpr, DT: tl.constexpr):
    """The residual takes the branch output before its norm (attn_out_norm / ffn_out_norm forgotten)."""
    return y


@triton.jit
def _sum_unrounded(res, t, scale, SCALED: tl.constexpr, RDT: tl.constexpr):
    """bf16(res + t * scale): the scaled branch not rounded before the add (torch rounds it: bf16(x + bf16(n c)))."""
    t = _on_grid(t, RDT)
    if SCALED:
        t = t * scale
    return _on_grid(res + t, RDT)


@triton.jit
def _mean_over_block(x, w, eps, H):
    """The mean of squares over the padded block instead of the row's H values."""
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / x.shape[0] + eps)
    return x * rstd * w


CONTROLS = {  # name: (case, kernel, its broken pieces)
    "control_branch_before_norm": ("attn_tail_8rows_bf16", "_add_norm_kernel", {"_branch": _branch_before_norm}),
    "control_sum_unrounded": ("mlp_tail_full_width_bf16", "_add_norm_kernel", {"_residual_add": _sum_unrounded}),
    "control_mean_over_block": ("norm_1row_bf16", "_rmsnorm_kernel", {"_norm_row": _mean_over_block}),
}


def _control(name: str) -> dict:
    case_name, kernel, pieces = CONTROLS[name]
    if kernel == "_add_norm_kernel":  # the tail's pieces are called by sandwich_tail, which the kernel calls
        pieces = {"sandwich_tail": substitute(rn.sandwich_tail, **pieces)}
    with substituted(rn, {kernel: pieces}):
        return run_case(next(c for c in CASES if c["name"] == case_name), "cpu")


@pytest.mark.parametrize("name", list(CONTROLS))
def test_interpreted_negative_control(interpreted, name):
    """Each broken kernel fails the same comparison its case passes."""
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    with pytest.raises(AssertionError):
        _check(next(c for c in CASES if c["name"] == CONTROLS[name][0]), r)


# ---- the wrappers' checks (no launch) ----------------------------------------------------------------------------


@pytest.mark.parametrize("over, message", [
    (dict(y=torch.randn(2, 9)), "y"),
    (dict(y_norm_w=torch.ones(9)), "y_norm_w"),
    (dict(next_norm_w=torch.ones(8, dtype=torch.int32)), "next_norm_w"),
    (dict(residual=torch.randn(8, 2).T, y=torch.randn(2, 8)), "unit column stride"),
    (dict(eps=-1.0), "eps"),
    (dict(scale=float("inf")), "scale"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(h_out=torch.empty(2, 8, dtype=torch.bfloat16)), "h_out must be"),
    (dict(b_out=torch.empty(2, 8)), "b_out must be"),
    (dict(residual=torch.randn(2, rn.MAX_HIDDEN + 1), y=torch.randn(2, rn.MAX_HIDDEN + 1), y_norm_w=None,
          next_norm_w=torch.ones(rn.MAX_HIDDEN + 1)), "rmsnorm_fits"),
])
def test_add_norm_rejects_bad_inputs(over, message):
    a = dict(residual=torch.randn(2, 8), y=torch.randn(2, 8), scale=C_F, y_norm_w=torch.ones(8),
             next_norm_w=torch.ones(8), eps=1e-6, dtype=torch.bfloat16)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        rn.add_norm(**a)


@pytest.mark.parametrize("over, message", [
    (dict(w=torch.ones(9)), "w must be"),
    (dict(x=torch.randn(2, 3, 8)), "x must be"),
    (dict(out_dtype=torch.int32), "out_dtype"),
    (dict(out=torch.empty(2, 8)), "out must be"),
    (dict(out=torch.empty(8, 2, dtype=torch.bfloat16).T), "unit column stride"),
])
def test_rmsnorm_rejects_bad_inputs(over, message):
    a = dict(x=torch.randn(2, 8), w=torch.ones(8), eps=1e-6, out_dtype=torch.bfloat16)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        rn.rmsnorm(**a)


def test_fits_and_settings():
    assert rn.rmsnorm_fits(3072) and rn.rmsnorm_fits(1) and not rn.rmsnorm_fits(rn.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="num_warps"):
        rn.RmsNormSettings(num_warps=6)
    with pytest.raises(Exception):
        rn.RmsNormSettings().num_warps = 4  # frozen


# ---- the GPU (run later on the lent machine) -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=[c["name"] for c in GPU_CASES])
def test_gpu_pdl_same_bits(c):
    """PDL changes when the programs start, never what they compute."""
    plain, with_pdl = run_case(c, "cuda", bits=True), run_case(c, "cuda", pdl=True, bits=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_pdl))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [(name, lambda name=name: _control(name)) for name in CONTROLS])

"""kernels/route_tail.py (`add_norm_route`: the attention's sandwich tail that also selects the experts from the
o-projection's partial logits) against kernels/rmsnorm.py's `add_norm` (h, b: bit for bit) and its own torch form
`add_norm_route_torch` (the routing: to rounding), under Triton's CPU interpreter in one worker subprocess;
`@pytest.mark.gpu` cases at the published decode shapes (H 3072, E 256, T 96, k 8, 1 and 6 rows).

The parts are made here as the o-projection makes them: W' = router * w_ffn, T tiles of the columns, [t, 0] the
fp32 product of W' with the widened residual, [t, 1] with w_out * y. Tolerances (TOL below, with reasons): kernel and
torch sum the same fp32 terms in different orders (the parts over T, each row's squares over H), so a logit may be
off by at most L = (2 T + 2 H + 16) u M, M = max_e rstd_h (sum_t |A_te| + |s| rstd_o sum_t |B_te|) (each side within
gamma_T of the exact parts sum and within about gamma_H of each inverse norm's exact value); a row's log-scores then
by 2 L + u (2 max|l - max l| + E + 9) (the shift, the sum of E exponentials, the division: kernels/router.py's
reasoning). Experts: exactly the stable top k of the kernel's own scores (equal scores: the lower index), and torch's
except in a near-tie row (two of torch's top k + 1 logits within 2 L). Outputs come from NaN-filled (experts: -7)
allocations, so an element the kernel leaves unwritten shows.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.kernels import rmsnorm as rn, route_tail as rt
from iquest.kernels.testing import interpreted_tests, substituted

U = 2.0 ** -24
C_F = 0.53881590608  # a scale that is not 1 (docs/model.md, "Config": ffn_out_scale)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {
    "scores": (1.0, "kernel against torch: |ln s| apart by at most 2 L + u (2 max|l - max l| + E + 9)"),
    "weights": (2.0, "rows choosing the same experts: each weight's log within 2 of the scores' bound + 2 (k + 1) u"),
    "near_tie": (2.0, "two orders of the same fp32 terms can swap two logits within 2 L of each other"),
}

BASE = dict(R=6, H=96, E=16, T=3, k=4, residual="bf16", scale=1.0, data="randn", chunk=None, broken=None, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_T1_k1_E8", R=1, H=64, E=8, T=1, k=1),
    case("6rows_T3_k4"),
    case("6rows_T7_scaled_fp32_residual_H200", T=7, H=200, residual="fp32", scale=C_F, seed=1),
    case("6rows_T7_chunked_scaled", T=7, H=128, scale=C_F, chunk=32, seed=2),  # 2 tiles a step, 4 steps, last half
    case("6rows_ties_at_boundary", data="ties", seed=3),
    case("6rows_all_experts_equal", E=8, data="equal", seed=4),
    case("1row_E16_k_is_E_fp32_residual", R=1, k=16, residual="fp32", scale=C_F, seed=5),
]
GPU_CASES = [
    case("gpu_1row_model", R=1, H=3072, E=256, T=96, k=8, seed=100),
    case("gpu_6rows_model", R=6, H=3072, E=256, T=96, k=8, seed=101),
    case("gpu_6rows_model_scaled_fp32_residual", R=6, H=3072, E=256, T=96, k=8, residual="fp32", scale=C_F,
         seed=102),
    case("gpu_6rows_model_ties", R=6, H=3072, E=256, T=96, k=8, data="ties", seed=103),
]


# ---- negative controls: broken jit pieces put into a copy of the kernel --------------------------------------------
@triton.jit
def fold_without_rstd_o(a, b, rstd_h, rstd_o, scale):
    """The o half not divided by o's rms: W' (w_out * o) taken for W' t."""
    return rstd_h * (a + scale * b)


_SUM_PARTS = rt._sum_parts  # the product's, called by the control below with one tile fewer


@triton.jit
def sum_parts_dropping_last(parts_ptr, row, R, E, T, E_PAD: tl.constexpr, T_BLOCK: tl.constexpr):
    """The last column tile's partials left out of both sums."""
    return _SUM_PARTS(parts_ptr, row, R, E, T - 1, E_PAD, T_BLOCK)


CONTROLS = {  # name: (case, broken pieces of _add_norm_route_kernel)
    "control_fold_without_rstd_o": ("6rows_T3_k4", {"_fold_logits": fold_without_rstd_o}),
    "control_drops_last_tile": ("6rows_T7_chunked_scaled", {"_sum_parts": sum_parts_dropping_last}),
}


# ---- inputs ----------------------------------------------------------------------------------------------------
def make_parts(r: torch.Tensor, y: torch.Tensor, w_out: torch.Tensor, wp: torch.Tensor, T: int) -> torch.Tensor:
    """parts [T, 2, R, E] as the o-projection writes them: per tile of cdiv(H, T) columns, fp32 products of W' with
    the widened residual and with w_out * y."""
    H = r.shape[1]
    cols = triton.cdiv(H, T)
    r32, o32 = r.float(), y.float() * w_out.float()
    out = torch.zeros(T, 2, r.shape[0], wp.shape[0])
    for t in range(T):
        s = slice(t * cols, min(H, (t + 1) * cols))
        out[t, 0] = r32[:, s] @ wp[:, s].T
        out[t, 1] = o32[:, s] @ wp[:, s].T
    return out


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, H, E, T, k = c["R"], c["H"], c["E"], c["T"], c["k"]
    res = (torch.randn(R, H, generator=gen) * 3).to(DTYPES[c["residual"]])
    y = (torch.randn(R, H, generator=gen) * 5).to(torch.bfloat16)
    w_out, w_ffn = ((1 + 0.3 * torch.randn(H, generator=gen)).to(torch.bfloat16) for _ in range(2))
    router = torch.randn(E, H, generator=gen) * (2 / H ** 0.5)  # logits of std ~2, like a trained router's
    parts = make_parts(res, y, w_out, router * w_ffn.float(), T)
    if c["data"] == "equal":  # every expert's partials the same: every logit ties
        parts[...] = parts[..., :1]
    if c["data"] == "ties":  # the row-0 expert at rank k - 1 copied over another: bit-equal logits in every row
        logits = rt.fold_logits_torch(res, y, c["scale"], w_out, 1e-6, parts)
        a = int(torch.sort(logits[0], descending=True, stable=True).indices[k - 1])
        parts[..., (a + 1 + int(torch.randint(0, E - 1, (1,), generator=gen))) % E] = parts[..., a]
    return {n: v.to(device) for n, v in dict(res=res, y=y, w_out=w_out, w_ffn=w_ffn, parts=parts).items()}


@contextlib.contextmanager
def poisoned_outputs():
    """torch.empty returns NaN-filled floats and -7-filled integers: an output element left unwritten shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def run_case(c: dict, device: str, pdl: bool = False, raw: bool = False, broken: dict | None = None):
    t = build(c, device)
    settings = rt.RouteTailSettings() if c["chunk"] is None else rt.RouteTailSettings(part_chunk=c["chunk"])
    args = (t["res"], t["y"], c["scale"], t["w_out"], t["w_ffn"], 1e-6, torch.bfloat16, t["parts"], c["k"])
    with substituted(rt, {"_add_norm_route_kernel": broken} if broken else {}), poisoned_outputs():
        got = rt.add_norm_route(*args, pdl=pdl, settings=settings)
    if raw:
        return got
    h_ref, b_ref = rn.add_norm(*args[:7])
    want = rt.add_norm_route_torch(*args)
    logits = rt.fold_logits_torch(t["res"], t["y"], c["scale"], t["w_out"], 1e-6, t["parts"]).double().cpu()
    return dict(measure(c, t, got[2:], want[2:], logits),
                h_bits=bool(torch.equal(_bits(got[0]), _bits(h_ref))), b_bits=bool(torch.equal(_bits(got[1]),
                                                                                              _bits(b_ref))),
                h_finite=bool(torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()),
                dtypes=[str(x.dtype) for x in got], shapes=[list(x.shape) for x in got])


def measure(c: dict, t: dict, got: tuple, want: tuple, logits: torch.Tensor) -> dict:
    """The checks' quantities: the kernel's (weights, experts, scores) `got` against the torch form's `want`."""
    wk, ek, sk = (x.cpu() for x in got)
    wt, et, st = (x.cpu() for x in want)
    R, E = sk.shape
    k, H, T = c["k"], c["H"], c["T"]
    # M: the magnitude the logits' rounding errors scale with, from float64 norms of the same inputs
    y, res, w_out = (t[n].double().cpu() for n in ("y", "res", "w_out"))
    parts = t["parts"].double().cpu()
    rstd_o = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    h = res + c["scale"] * y * rstd_o * w_out
    rstd_h = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    mag = rstd_h * (parts[:, 0].abs().sum(0) + abs(c["scale"]) * rstd_o * parts[:, 1].abs().sum(0))
    L = (2 * T + 2 * H + 16) * U * mag.max(-1, keepdim=True).values  # [R, 1]
    spread = (logits - logits.max(-1, keepdim=True).values).abs().max(-1, keepdim=True).values
    S = TOL["scores"][0] * (2 * L + U * (2 * spread + E + 9))
    finite = bool(torch.isfinite(wk).all() and torch.isfinite(sk).all())
    ln_s = ((sk.double().log() - st.double().log()).abs() / S).nan_to_num(nan=float("inf"))
    own = torch.sort(sk, dim=-1, descending=True, stable=True).indices[:, :k]
    top = torch.sort(logits, dim=-1, descending=True).values[:, :k + 1]
    gaps = top[:, :-1] - top[:, 1:]
    near_tie = (gaps <= TOL["near_tie"][0] * L).any(-1) if gaps.numel() else torch.zeros(R, dtype=torch.bool)
    differs = (ek != et).any(-1)
    w_bound = TOL["weights"][0] * S + 2 * (k + 1) * U
    w_ratio = ((wk.double().log() - wt.double().log()).abs() / w_bound)[~differs]
    sel = sk.gather(1, ek.clamp(0, E - 1))
    rivals = (sk.unsqueeze(1) == sel.unsqueeze(2)).sum(-1) - 1
    return {
        "finite": finite,
        "experts_in_range": bool(((ek >= 0) & (ek < E)).all()),
        "own_topk": bool(torch.equal(ek, own)),
        "score_ratio": float(ln_s.max()),
        "weight_ratio": float(w_ratio.nan_to_num(nan=float("inf")).max()) if w_ratio.numel() else 0.0,
        "own_weight_err": float((wk.double() - sel.double() / sel.double().sum(-1, keepdim=True)).abs().max()
                                / U) if finite else float("inf"),
        "differ_rows": int(differs.sum()),
        "unexplained_rows": int((differs & ~near_tie).sum()),
        "tie_slots": int((rivals > 0).sum()),
        "experts": ek.tolist(),
        "weights": wk.tolist(),
    }


def check_values(c: dict, r: dict) -> None:
    R, E, k = c["R"], c["E"], c["k"]
    assert r["shapes"] == [[R, c["H"]], [R, c["H"]], [R, k], [R, k], [R, E]], r["shapes"]
    assert r["dtypes"] == [str(DTYPES[c["residual"]]), "torch.bfloat16", "torch.float32", "torch.int64",
                           "torch.float32"], r["dtypes"]
    assert r["h_finite"] and r["finite"] and r["experts_in_range"], "an output element left unwritten"
    assert r["h_bits"] and r["b_bits"], f"{c['name']}: h or b differ from rmsnorm.add_norm's bits"
    assert r["own_topk"], f"{c['name']}: experts differ from the top k of the kernel's own scores (lower index on ties)"
    assert r["own_weight_err"] <= k + 2, f"{c['name']}: weights are not the chosen scores renormalized"
    assert r["score_ratio"] <= 1, f"{c['name']}: scores off the torch form's by {r['score_ratio']:.2e} of the bound"
    assert r["unexplained_rows"] == 0, f"{c['name']}: experts differ from torch's in {r['unexplained_rows']} rows " \
                                       "without a near-tie"
    assert r["weight_ratio"] <= 1, f"{c['name']}: weights off the torch form's by {r['weight_ratio']:.2e} of the bound"
    if c["data"] in ("ties", "equal"):
        assert r["tie_slots"] > 0, f"{c['name']}: no chosen expert had a bit-equal rival (ties not exercised)"
    if c["data"] == "equal":
        assert all(row == list(range(k)) for row in r["experts"]), f"{c['name']}: {r['experts']}, not the lowest"
        assert all(abs(x - 1 / k) <= 2 * U for row in r["weights"] for x in row), r["weights"]


def _summary(c: dict, r: dict) -> str:
    return (f"{c['name']}: of the bounds: scores {r['score_ratio']:.1e}, weights {r['weight_ratio']:.1e}; rows "
            f"differing from torch {r['differ_rows']}, tie slots {r['tie_slots']}")


interpreted, test_interpreted = interpreted_tests(__file__, CASES, check_values, _summary)


def _control(name: str) -> dict:
    case_name, pieces = CONTROLS[name]
    return run_case(next(c for c in CASES if c["name"] == case_name), "cpu", broken=pieces)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_interpreted_negative_control(interpreted, name):
    """Each broken kernel ran, and fails the comparison its case passes on the folded logits."""
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    assert r["h_bits"] and r["b_bits"], "the control broke the tail, not the fold"
    with pytest.raises(AssertionError, match="scores off"):
        check_values(next(c for c in CASES if c["name"] == CONTROLS[name][0]), r)


def test_cases_cover_the_boundaries():
    assert {1, 6} == {c["R"] for c in CASES} and {1, 3, 7} <= {c["T"] for c in CASES}
    assert {1, 4} <= {c["k"] for c in CASES} and {"bf16", "fp32"} == {c["residual"] for c in CASES}
    assert any(c["scale"] != 1 for c in CASES) and {"ties", "equal"} <= {c["data"] for c in CASES}


# ---- the wrapper's checks (no launch) -------------------------------------------------------------------------
def _args(**over) -> dict:
    a = dict(residual=torch.randn(2, 8).bfloat16(), y=torch.randn(2, 8).bfloat16(), scale=C_F,
             y_norm_w=torch.ones(8), next_norm_w=torch.ones(8), eps=1e-6, dtype=torch.bfloat16,
             parts=torch.zeros(3, 2, 2, 16), top_k=4)
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(y_norm_w=None), "y_norm_w"),
    (dict(y=torch.randn(2, 9)), "y "),
    (dict(eps=-1.0), "eps"),
    (dict(scale=float("nan")), "scale"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(parts=torch.zeros(3, 2, 2, 16).bfloat16()), "parts must be an fp32"),
    (dict(parts=torch.zeros(2, 2, 16)), "parts must be an fp32"),
    (dict(parts=torch.zeros(3, 3, 2, 16)), r"parts \(3, 3, 2, 16\)"),
    (dict(parts=torch.zeros(3, 2, 5, 16)), r"must be \[T >= 1, 2, 2, E >= 1\]"),
    (dict(parts=torch.zeros(0, 2, 2, 16)), "T >= 1"),
    (dict(parts=torch.zeros(16, 2, 2, 3).permute(3, 1, 2, 0)), "contiguous"),
    (dict(parts=torch.zeros(1, 2, 2, rt.router.MAX_EXPERTS + 1), top_k=1), "MAX_EXPERTS"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=17), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(residual=torch.randn(2, rn.MAX_HIDDEN + 1), y=torch.randn(2, rn.MAX_HIDDEN + 1),
          y_norm_w=torch.ones(rn.MAX_HIDDEN + 1), next_norm_w=torch.ones(rn.MAX_HIDDEN + 1)), "rmsnorm_fits"),
    (dict(residual=torch.randn(0, 8), y=torch.randn(0, 8), parts=torch.zeros(3, 2, 0, 16)), "fits"),
])
def test_rejects_bad_inputs(over, message):
    a = _args(**over)
    kept = a["residual"].clone()
    with pytest.raises(ValueError, match=f"route_tail: .*{message}"):
        rt.add_norm_route(**a)
    assert torch.equal(a["residual"], kept)


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="route_tail: settings"):
        rt.add_norm_route(**_args(), settings=rn.RmsNormSettings())
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="part_chunk"):
            rt.RouteTailSettings(part_chunk=bad)
    with pytest.raises(AttributeError):
        rt.RouteTailSettings().part_chunk = 16  # frozen


def test_fits():
    assert rt.fits(1, 3072, 256, 96, 8) and rt.fits(6, 3072, 256, 96, 8) and rt.fits(1, 1, 1, 1, 1)
    assert not rt.fits(0, 3072, 256, 96, 8) and not rt.fits(6, rn.MAX_HIDDEN + 1, 256, 96, 8)
    assert not rt.fits(6, 3072, rt.router.MAX_EXPERTS + 1, 96, 8) and not rt.fits(6, 3072, 256, 0, 8)
    assert not rt.fits(6, 3072, 256, 96, 257) and not rt.fits(6, 3072, 256, 96, 0)


def test_torch_form_is_the_tail_and_the_reference_routing():
    t = build(case("torch_form", seed=7), "cpu")
    args = (t["res"], t["y"], C_F, t["w_out"], t["w_ffn"], 1e-6, torch.bfloat16)
    got = rt.add_norm_route_torch(*args, t["parts"], 4)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], rn.add_norm_torch(*args)))
    # the logits are the float64 fold's to fp32 rounding: router @ (w_ffn * h * rstd_h), nothing rounded
    exact = rt.fold_logits_torch(*(x.double() for x in (t["res"], t["y"])), C_F, t["w_out"].double(), 1e-6,
                                 t["parts"].double())
    want = torch.softmax(exact, -1)
    assert torch.allclose(got[4].double(), want, rtol=1e-5, atol=1e-7)


# ---- the GPU (run later on the lent machine) -------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    check_values(c, r)
    print(_summary(c, r))


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES[:2], ids=[c["name"] for c in GPU_CASES[:2]])
def test_gpu_pdl_same_bits(c):
    """PDL changes when the programs start, never what they compute."""
    plain, with_pdl = run_case(c, "cuda", raw=True), run_case(c, "cuda", pdl=True, raw=True)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(plain, with_pdl))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [(name, lambda name=name: _control(name)) for name in CONTROLS])

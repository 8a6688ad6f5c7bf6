"""kernels/router.py against its own reference (`route_logits_ref`, the retired routing with norm_topk_prob and
scaling; docs/model.md's is its norm_topk_prob, scaling 1 case) on the kernel's own logits, and the logits against
float64. The kernel is not on the product path until re-based to docs/model.md (kernels/router.py).

Small shapes run under Triton's CPU interpreter in one worker subprocess: 1, 3, 8 and 11 rows (two row
blocks), E = 16, 48 (not a power of two), 64, 256, k = 1, 2, 5, 8 and k = E, H not a multiple of the
tile (partial tiles), split 1 and > 1 (an uneven split request too), norm_topk_prob off, scaling != 1, a
strided x, the default [4, 512] tile, and exact ties: router rows duplicated so that two experts have
bit-equal logits at the top, across the top-k boundary and inside the top-k (the lower index must
win), plus integer-valued data (logits exact multiples of 1/16, ties everywhere). Inputs are fresh
random values, never zeros.

Checks, per case:
  logits   |kernel - x @ w.T (float64)| <= LOGIT_TOL * (|x| @ |w|.T), elementwise (fp32 sums of H terms)
  experts  EXACTLY route_logits_ref(kernel logits)'s (a stable sort: ties to the lower index)
  scores   within SCORE_TOL (relative, elementwise) of the reference's fp32 scores and of a float64 softmax
           of the same logits (exp and sum orders differ from torch's by a few ulps)
  weights  within WEIGHT_TOL (relative) of the reference's
  ties     tie cases must actually put a bit-equal logit next to a selected expert (counted)

Bit identity ("twins" cases): a router held in bf16 (as the engine holds it) gives exactly the outputs of its
values held in fp32, and the packed-key top-k exactly those of the two-reduction form (`packed_topk=False`).

Negative controls (same checks, must FAIL, and their broken branch is counted as taken): the row
program with ties going to the HIGHER index (both top-k forms), and the row program summing one split fewer.
Two hypothesis property tests run in the worker too: random small shapes, splits, tiles, ties against the
reference (6 examples there, ~0.5 s each interpreted; 60 on the GPU); and the select launch alone, packed vs
two-reduction top-k bit for bit on partials made to tie. The interpreter leaves out two cases whose properties other
cases there have (INTERPRETED_CASES); the GPU runs them all.
`@pytest.mark.gpu`: the same cases plus the retired model's shape (R = 6, 8; H = 6144; E = 256; k = 8), graph
replay bit-identical to eager, agreement with the torch path (`route_ref`), bf16 vs fp32 router and packed vs
two-reduction top-k bit for bit at the model's shape.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import router as rt
from iquest.kernels.testing import interpreted_tests, substituted
from iquest.tests.kernel_controls import ROUTER as ROUTER_CONTROLS

reference_route = rt.route_logits_ref  # the kernel's own reference (not on the product path: kernels/router.py)

# fp32 sums of H products: error ~ sqrt(H) * 2^-24 of sum |x_h w_h| typically (n * 2^-24 worst), measured
# <= ~1e-7 at H <= 600; a dropped split (1/4 of the terms) is ~1e-1.
LOGIT_TOL = 1e-5
SCORE_TOL = 2e-6  # exp (NumPy / libdevice vs torch), sum order and division: a few ulps; measured <= ~4e-7
WEIGHT_TOL = 3e-6  # one more sum and division
TORCH_PATH_TOL = 5e-5  # GPU only: against torch's own logits (another summation order), see test_gpu_matches_torch_path

BASE = dict(R=8, E=64, H=200, k=8, norm=True, scaling=2.5, split=None, block_e=16, block_h=32, ties=True,
            data="randn", x_stride=None, broken=None, seed=0, wdtype="fp32", twins=False, preloads=False)
# wdtype "bf16": the router held as the engine holds it (the values rounded to bf16 first). twins: also run the same
# values held in fp32 (bf16 cases), the other top-k form (packed_topk flipped) and with `preload` (the weight tile
# loaded before the PDL wait); all outputs must be bit-equal. preloads: the preload must be taken (one tile a split).


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_E16_k1_split1", R=1, E=16, k=1, H=70, split=1),
    case("1row_E16_k2_split3", R=1, E=16, k=2, H=70, split=3, seed=1),
    case("3rows_E64_k2", R=3, k=2, H=150, split=2, seed=2),
    case("3rows_E64_k8_split1_no_norm", R=3, H=150, split=1, norm=False, scaling=0.37, seed=3),
    case("8rows_E64_k8_split4", split=4, seed=4),
    case("8rows_E64_k1_split5_uneven", k=1, H=210, split=5, seed=5),
    case("8rows_E256_k8_split3", E=256, H=130, split=3, seed=6),
    case("8rows_E256_k2_no_norm", E=256, k=2, H=100, norm=False, scaling=1.7, seed=7),
    case("8rows_E16_k8_auto_split", E=16, H=250, seed=8),
    case("8rows_no_ties_scaling1", ties=False, scaling=1.0, split=3, seed=9),
    case("6rows_default_tile_2splits", R=6, E=64, H=600, block_e=None, block_h=None, seed=10),
    case("11rows_two_row_blocks", R=11, H=90, split=2, seed=11),
    case("E48_not_power_of_two_k5", R=3, E=48, k=5, H=120, split=2, seed=12),
    case("k_equals_E16", R=3, E=16, k=16, H=60, split=2, seed=13),
    case("strided_x", R=5, H=140, split=3, x_stride=2, seed=14),
    case("select_2_warps", R=6, E=64, H=150, split=2, select_warps=2, seed=18),  # warps: GPU only
    case("integer_data_ties", R=8, E=64, H=96, data="int", split=3, seed=15),
    case("integer_data_k1", R=3, E=16, k=1, H=40, data="int", split=2, seed=16),
    case("integer_data_no_norm", R=3, E=256, k=8, H=64, data="int", norm=False, scaling=2.5, seed=17),
    case("bf16_router_ties", R=8, E=64, H=150, split=3, wdtype="bf16", twins=True, seed=22),
    case("bf16_router_E17_k5_two_row_blocks", R=11, E=17, k=5, H=90, split=2, wdtype="bf16", twins=True, seed=23),
    case("bf16_router_integer_data", R=3, E=48, k=8, H=64, data="int", wdtype="bf16", twins=True, seed=24),
    case("bf16_router_default_tile", R=6, E=64, H=600, block_e=None, block_h=None, wdtype="bf16", twins=True, seed=25),
    case("two_reduction_topk_ties", R=8, E=64, H=120, split=2, packed_topk=False, twins=True, seed=26),
    case("preload_one_tile_splits_partial_last", R=8, E=64, H=150, split=5, wdtype="bf16", twins=True, preloads=True,
         seed=28),
    # negative controls: must fail the checks above
    case("broken_ties_to_higher_index", R=8, E=64, H=120, split=2, broken="ties_high", seed=20),
    case("broken_ties_to_higher_index_two_reductions", R=8, E=64, H=120, split=2, broken="ties_high",
         packed_topk=False, seed=27),
    case("broken_dropped_split", R=3, E=64, H=200, split=4, broken="drop_split", seed=21),
]

# The interpreter leaves out cases whose properties others there have (E = 256 once, two row blocks once, the twins
# of a bf16 router at the default tile and with ties); the GPU runs every case.
INTERPRETED_CASES = [c for c in CASES
                     if c["name"] not in ("8rows_E256_k2_no_norm", "bf16_router_E17_k5_two_row_blocks")]

GPU_CASES = [  # the retired model's: H = 6144, E = 256, k = 8, norm_topk_prob, routed_scaling_factor 1.0
    case("gpu_8rows_model", R=8, E=256, H=6144, block_e=None, block_h=None, scaling=1.0, seed=100),
    case("gpu_6rows_model", R=6, E=256, H=6144, block_e=None, block_h=None, scaling=1.0, seed=101),
    case("gpu_8rows_model_no_ties", R=8, E=256, H=6144, block_e=None, block_h=None, ties=False, seed=102),
    case("gpu_6rows_scaling_no_norm", R=6, E=256, H=6144, block_e=None, block_h=None, norm=False, seed=103),
    case("gpu_1row_model", R=1, E=256, H=6144, block_e=None, block_h=None, seed=104),
    case("gpu_8rows_split1", R=8, E=256, H=6144, block_e=None, block_h=None, split=1, seed=105),
    case("gpu_8rows_split7_uneven", R=8, E=256, H=6144, block_e=None, block_h=None, split=7, seed=106),
    case("gpu_8rows_tile_8x256", R=8, E=256, H=6144, block_e=8, block_h=256, seed=107),
    *[case(f"gpu_6rows_select_{w}_warps", R=6, E=256, H=6144, block_e=None, block_h=None, select_warps=w, seed=111 + w)
      for w in (1, 2, 8)],  # bench tune's candidates for the select launch
    case("gpu_8rows_integer_ties", R=8, E=256, H=6144, block_e=None, block_h=None, data="int", seed=108),
    # the router as the engine holds it (bf16), each checked bit-equal to its fp32-held values and the other top-k form
    case("gpu_6rows_model_bf16", R=6, E=256, H=6144, block_e=None, block_h=None, scaling=1.0, wdtype="bf16",
         twins=True, preloads=True, seed=120),
    case("gpu_8rows_integer_ties_bf16", R=8, E=256, H=6144, block_e=None, block_h=None, data="int", wdtype="bf16",
         twins=True, seed=121),
    case("gpu_6rows_select_1_warp_bf16", R=6, E=256, H=6144, block_e=None, block_h=None, select_warps=1,
         wdtype="bf16", twins=True, seed=122),
    case("gpu_broken_ties_high", R=8, E=256, H=6144, block_e=None, block_h=None, broken="ties_high", seed=109),
    case("gpu_broken_ties_high_two_reductions", R=8, E=256, H=6144, block_e=None, block_h=None, broken="ties_high",
         packed_topk=False, seed=123),
    case("gpu_broken_dropped_split", R=8, E=256, H=6144, block_e=None, block_h=None, broken="drop_split", seed=110),
]


# ---- inputs -------------------------------------------------------------------------------------------
def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, E, H, k = c["R"], c["E"], c["H"], c["k"]
    cols = H * (c["x_stride"] or 1)
    if c["data"] == "int":  # +-1, +-2 (never 0): every logit an exact multiple of 1/16, many equal
        vals = torch.tensor([-2.0, -1.0, 1.0, 2.0])
        wide = vals[torch.randint(0, 4, (R, cols), generator=gen)]
        w = vals[torch.randint(0, 4, (E, H), generator=gen)] / 16
    else:  # logits of std ~2, like a trained router's
        wide = torch.randn(R, cols, generator=gen)
        w = torch.randn(E, H, generator=gen) * (2 / H ** 0.5)
    x = wide[:, :H]  # unit stride along H, row stride H * x_stride
    if c["ties"]:  # copy a chosen expert's router row over another's: bit-equal logits for every row
        for r, rank in zip(range(R), (0, k - 1, k // 2)):
            order = torch.sort(x[r].double() @ w.double().T, descending=True, stable=True).indices
            a = int(order[min(rank, E - 1)])
            b = (a + 1 + int(torch.randint(0, E - 1, (1,), generator=gen))) % E  # any other expert
            w[b] = w[a]
    if c["wdtype"] == "bf16":
        w = w.bfloat16()
    return dict(x=x.to(device), w=w.contiguous().to(device))


# ---- one case -----------------------------------------------------------------------------------------
def measure(c: dict, t: dict, weights, experts, scores, seen: dict) -> dict:
    R, E, k = c["R"], c["E"], c["k"]
    logits = seen["logits"]
    x64, w64 = t["x"].double().cpu(), t["w"].double().cpu()
    bound = (x64.abs() @ w64.abs().T).clamp_min(1e-300)
    logit_err = ((logits.double().cpu() - x64 @ w64.T).abs() / bound).max().item()
    rw, re, rs = reference_route(logits.clone(), k, c["norm"], c["scaling"])  # the kernel's logits, same device
    s64 = torch.softmax(logits.double(), dim=-1)
    tiny = 1e-30
    # ties that decide something: selected slots with another expert of bit-equal logit
    sel_logit = logits.gather(1, experts)
    others_equal = (logits.unsqueeze(1) == sel_logit.unsqueeze(2)).sum(-1) - 1  # [R, k]
    unselected = torch.ones(R, E, dtype=torch.bool, device=logits.device).scatter(1, experts, False)
    boundary = ((logits == sel_logit[:, -1:]) & unselected).any(dim=1)
    return {
        "shapes": [list(weights.shape), list(experts.shape), list(scores.shape)],
        "dtypes": [str(weights.dtype), str(experts.dtype), str(scores.dtype)],
        "finite": bool(torch.isfinite(weights).all() and torch.isfinite(scores).all() and torch.isfinite(logits).all()),
        "split": seen["split"],
        "logit_err": logit_err,
        "experts_equal": bool(torch.equal(experts, re)),
        "experts_differ_rows": int((experts != re).any(dim=1).sum()),
        "score_err": ((scores.double() - rs.double()).abs() / (rs.double() + tiny)).max().item(),
        "score_err64": ((scores.double() - s64).abs() / (s64 + tiny)).max().item(),
        "score_bits_equal": float((scores.view(torch.int32) == rs.view(torch.int32)).float().mean()),
        "weight_err": ((weights.double() - rw.double()).abs() / (rw.double().abs() + tiny)).max().item(),
        "tie_slots": int((others_equal > 0).sum()),
        "boundary_tie_rows": int(boundary.sum()),
    }


class _Observed:
    """A kernel whose launches record their grid's split count, h_per_split and PRELOAD into `seen`, then run."""

    def __init__(self, kernel, seen: dict):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.seen.update(split=grid[1], h_per_split=args[7], preloaded=bool(kw["PRELOAD"]))
            return launch(*args, **kw)
        return run


def observed_route(x, w, k, norm, scaling, broken=None, **kw) -> tuple[tuple[torch.Tensor, ...], dict]:
    """rt.route(...)'s (weights, experts, scores) and what its launches did: "logits" (the summed logits the
    selection used: the select launch given a buffer for them), "split", "h_per_split" and "preloaded" (launch 1's),
    and "broken_splits" (the splits the select launch was given, when a negative control's defect `broken` ran:
    "ties_high" (ties to the higher index) or "drop_split" (one split fewer summed))."""
    seen, original, kernel = {}, rt._select, rt._router_logits_kernel

    def select(part, splits, weights, experts, scores, logits, *args, **skw):
        seen["logits"] = torch.empty_like(scores)
        if broken is not None:
            seen["broken_splits"] = splits
        if broken == "drop_split":
            splits -= 1
        return original(part, splits, weights, experts, scores, seen["logits"], *args, **skw)

    rt._select, rt._router_logits_kernel = select, _Observed(kernel, seen)
    try:
        with substituted(rt, ROUTER_CONTROLS if broken == "ties_high" else {}):
            out = rt.route(x, w, k, norm, scaling, **kw)
    finally:
        rt._select, rt._router_logits_kernel = original, kernel
    return out, seen


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    blocks = {b: c[b] for b in ("block_e", "block_h", "select_warps", "packed_topk") if c.get(b) is not None}
    (weights, experts, scores), seen = observed_route(t["x"], t["w"], c["k"], c["norm"], c["scaling"],
                                                      broken=c["broken"], split=c["split"], **blocks)
    r = dict(measure(c, t, weights, experts, scores, seen), broken_calls=int("broken_splits" in seen),
             broken_splits=seen.get("broken_splits", 0))
    if c["twins"]:
        got = (weights, experts, scores, seen["logits"])
        twins = {"other_topk": (t["w"], dict(blocks, packed_topk=not blocks.get("packed_topk", True))),
                 "preload": (t["w"], dict(blocks, preload=True))}
        if t["w"].dtype == torch.bfloat16:
            twins["fp32_held"] = (t["w"].float(), blocks)
        for name, (w, kw) in twins.items():
            out, d = observed_route(t["x"], w, c["k"], c["norm"], c["scaling"], split=c["split"], **kw)
            r[f"{name}_bit_equal"] = all(torch.equal(a, b) for a, b in zip((*out, d["logits"]), got))
            r[f"{name}_preloaded"] = d["preloaded"]
    return r


def check_values(c: dict, r: dict) -> None:
    R, E, k = c["R"], c["E"], c["k"]
    assert r["shapes"] == [[R, k], [R, k], [R, E]], r["shapes"]
    assert r["dtypes"] == ["torch.float32", "torch.int64", "torch.float32"], r["dtypes"]
    assert r["finite"], "non-finite output"
    assert r["logit_err"] <= LOGIT_TOL, f"{c['name']}: logits off float64 x @ w.T by {r['logit_err']:.2e} of |x|@|w|"
    assert r["experts_equal"], f"{c['name']}: experts differ from reference route in {r['experts_differ_rows']} rows"
    assert r["score_err"] <= SCORE_TOL, f"{c['name']}: scores off the reference's by {r['score_err']:.2e}"
    assert r["score_err64"] <= SCORE_TOL, f"{c['name']}: scores off float64 softmax by {r['score_err64']:.2e}"
    assert r["weight_err"] <= WEIGHT_TOL, f"{c['name']}: weights off the reference's by {r['weight_err']:.2e}"
    if c["ties"] or c["data"] == "int":
        assert r["tie_slots"] > 0, f"{c['name']}: no selected expert had a bit-equal rival (ties not exercised)"
    if c["split"] is not None and c["split"] > 1:
        assert r["split"] > 1, f"{c['name']}: asked for {c['split']} splits, ran {r['split']}"
    if c["twins"]:
        assert r["other_topk_bit_equal"], f"{c['name']}: packed and two-reduction top-k differ"
        assert r["preload_bit_equal"], f"{c['name']}: the weight preloaded before the wait changes the outputs"
    if c["preloads"]:
        assert r["preload_preloaded"], f"{c['name']}: the preload was not taken"
        if c["wdtype"] == "bf16":
            assert r["fp32_held_bit_equal"], f"{c['name']}: the bf16 router differs from its values held in fp32"


def _check(c: dict, r: dict) -> None:
    if not c["broken"]:
        check_values(c, r)
        return
    assert r["broken_calls"] == 1, "the broken row program did not run"
    if c["broken"] == "ties_high":
        assert r["tie_slots"] > 0, "no tie for the broken tie-break to get wrong"
        caught_by = "experts differ"
    else:
        assert r["broken_splits"] >= 2, "only one split: nothing to drop"
        caught_by = "logits off"
    with pytest.raises(AssertionError, match=caught_by):
        check_values(c, r)


def _summary(c: dict, r: dict) -> str:
    return (f"{c['name']}: split {r['split']}, logit err {r['logit_err']:.1e}, score err {r['score_err']:.1e} "
            f"(f64 {r['score_err64']:.1e}, bit-equal {r['score_bits_equal']:.0%}), weight err {r['weight_err']:.1e}, "
            f"tie slots {r['tie_slots']}, boundary ties {r['boundary_tie_rows']}")


# ---- property test (runs in the interpreter worker) ----------------------------------------------------
PROPERTY_EXAMPLES = 6  # under the interpreter (~0.5 s an example); the GPU test runs GPU_PROPERTY_EXAMPLES
GPU_PROPERTY_EXAMPLES = 60


def property_job(device: str = "cpu", examples: int = PROPERTY_EXAMPLES) -> dict:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seen = {"examples": 0, "split_gt1": 0, "tie_slots": 0, "multi_row_block": 0}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(R=st.integers(1, 10), E=st.sampled_from([16, 24, 64]), H=st.integers(1, 130), k=st.integers(1, 8),
           split=st.integers(1, 5), norm=st.booleans(), scaling=st.floats(0.1, 4.0),
           block_e=st.sampled_from([2, 8, 16]), block_h=st.sampled_from([16, 32]), ties=st.booleans(),
           data=st.sampled_from(["randn", "int"]), seed=st.integers(0, 2**20))
    def prop(R, E, H, k, split, norm, scaling, block_e, block_h, ties, data, seed):
        c = case("property", R=R, E=E, H=H, k=min(k, E), split=split, norm=norm, scaling=scaling, block_e=block_e,
                 block_h=block_h, ties=ties, data=data, seed=seed)
        r = run_case(c, device)
        check_values(dict(c, ties=False, data="randn", split=None), r)  # ties and splits are counted below
        seen["examples"] += 1
        seen["split_gt1"] += r["split"] > 1
        seen["tie_slots"] += r["tie_slots"] > 0
        seen["multi_row_block"] += R > rt.MAX_ROWS

    prop()
    return seen


def _check_property(c: dict, r: dict, examples: int = PROPERTY_EXAMPLES) -> None:
    assert r["examples"] >= examples
    assert r["split_gt1"] > 0 and r["tie_slots"] > 0 and r["multi_row_block"] > 0, r


SELECT_EXAMPLES = 12


def select(part: torch.Tensor, k: int, norm: bool, scaling: float, ties_high: bool = False,
           **kw) -> tuple[torch.Tensor, ...]:
    """(weights, experts, scores, logits) of launch 2 alone on the partials part [S, R, E] (with the negative
    control's ties to the higher index if `ties_high`)."""
    S, R, E = part.shape
    out = (torch.empty(R, k), torch.empty(R, k, dtype=torch.int64), torch.empty(R, E), torch.empty(R, E))
    with substituted(rt, ROUTER_CONTROLS if ties_high else {}):
        rt._select(part, S, *out[:3], out[3], k, norm, scaling, **kw)
    return out


def select_property_job() -> dict:
    """Packed keys and two reductions per round choose the same experts with the same bits, on partials made to
    tie: columns copied over others (bit-equal logits), small integers, and logits so spread that most scores are
    exactly 0. Launch 2 alone (no H to sum), so many examples stay cheap under the interpreter."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seen = {"examples": 0, "tie_slots": 0, "zero_ties": 0, "not_pow2": 0, "k_is_E": 0, "ties_high": 0}

    @settings(max_examples=SELECT_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(R=st.integers(1, 8), E=st.sampled_from([1, 3, 5, 16, 17, 48, 100]), k=st.integers(1, 20),
           splits=st.integers(1, 3), norm=st.booleans(), scaling=st.floats(0.1, 4.0),
           data=st.sampled_from(["randn", "dup", "int", "underflow"]), lower_ties=st.booleans(),
           seed=st.integers(0, 2**20))
    def prop(R, E, k, splits, norm, scaling, data, lower_ties, seed):
        k = min(k, E)
        gen = torch.Generator().manual_seed(seed)
        if data == "int":
            part = torch.randint(-3, 4, (splits, R, E), generator=gen).float()
        else:  # "underflow": exp(l - max) is exactly 0 below -104, so most scores are 0 (ties at 0)
            part = torch.randn(splits, R, E, generator=gen) * (100.0 if data == "underflow" else 2.0)
        if data == "dup":  # the same partials in the same order: bit-equal logits
            src, dst = torch.randint(0, E, (2, max(1, E // 3)), generator=gen)
            part[:, :, dst] = part[:, :, src]
        packed = select(part, k, norm, scaling, ties_high=not lower_ties)
        unpacked = select(part, k, norm, scaling, ties_high=not lower_ties, packed_topk=False)
        for name, a, b in zip(("weights", "experts", "scores", "logits"), packed, unpacked):
            assert torch.equal(a, b), f"{name} differ: R={R} E={E} k={k} {data} lower_ties={lower_ties}"
        weights, experts, scores, logits = packed
        if lower_ties:
            assert torch.equal(experts, reference_route(logits.clone(), k, norm, scaling)[1])
        sel = scores.gather(1, experts)
        rivals = (scores.unsqueeze(1) == sel.unsqueeze(2)).sum(-1) > 1  # [R, k]: another expert has this score
        seen["examples"] += 1
        seen["tie_slots"] += bool(rivals.any())
        seen["zero_ties"] += bool((rivals & (sel == 0)).any())
        seen["not_pow2"] += E & (E - 1) != 0
        seen["k_is_E"] += k == E > 1
        seen["ties_high"] += not lower_ties and bool(rivals.any())

    prop()
    return seen


def _check_select_property(c: dict, r: dict) -> None:
    assert r["examples"] >= SELECT_EXAMPLES
    assert all(v > 0 for v in r.values()), r


# ---- interpreter tests ---------------------------------------------------------------------------------
PROPERTY = dict(name="hypothesis_property")
SELECT_PROPERTY = dict(name="packed_topk_property")
_JOB_CHECKS = {PROPERTY["name"]: _check_property, SELECT_PROPERTY["name"]: _check_select_property}
interpreted, test_interpreted = interpreted_tests(
    __file__, INTERPRETED_CASES + [PROPERTY, SELECT_PROPERTY], lambda c, r: _JOB_CHECKS.get(c["name"], _check)(c, r),
    lambda c, r: f"{c['name']}: {r}" if c["name"] in _JOB_CHECKS else _summary(c, r))


def test_split_heuristic():
    cpu = torch.device("cpu")  # 8 "SMs" off the GPU: 64 programs wanted
    assert rt.choose_split(256, 6144, 4, 512, cpu) == 1  # 64 expert tiles fill it
    assert rt.choose_split(64, 6144, 4, 512, cpu) == 4
    assert rt.choose_split(16, 100, 16, 32, cpu) == 4  # at most one split per H tile
    assert rt._split_plan(6144, 12, 512) == (12, 512)
    assert rt._split_plan(6144, 7, 512) == (6, 1024)  # whole tiles per split: 6 run, none empty
    assert rt._split_plan(70, 3, 32) == (3, 32)


def _args(**over):
    a = dict(x=torch.randn(3, 40), router_w=torch.randn(16, 40), top_k=2, norm_topk_prob=True, scaling=1.0)
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.randn(3, 41)), "H="),
    (dict(x=torch.randn(40)), "2-D"),
    (dict(x=torch.randn(3, 40).double()), "x torch.float64 must be float32"),
    (dict(x=torch.randn(3, 40).bfloat16()), "x torch.bfloat16 must be float32"),
    (dict(router_w=torch.randn(16, 40).half()), r"router_w torch.float16 must be bfloat16 \(as the checkpoint"),
    (dict(router_w=torch.randn(16, 40).double()), "router_w torch.float64 must be bfloat16"),
    (dict(x=torch.randn(40, 3).T), "unit stride"),
    (dict(router_w=torch.randn(40, 16).T), "contiguous"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=17), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(norm_topk_prob=1), "norm_topk_prob"),
    (dict(scaling=float("inf")), "scaling"),
    (dict(split=0), "split"),
    (dict(block_e=3), "powers of two"),
    (dict(block_h=8), "powers of two"),
    (dict(select_warps=3), "select_warps"),
    (dict(packed_topk=1), "packed_topk must be a bool"),
    (dict(router_w=torch.randn(rt.MAX_EXPERTS + 1, 40)), "experts"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=f"router: .*{message}"):
        rt.route(**_args(**over))


def test_route_ref_is_the_torch_sequence():
    x, w = torch.randn(4, 40), torch.randn(16, 40)
    for got, want in zip(rt.route_ref(x, w, 3, True, 2.5), reference_route(x @ w.T, 3, True, 2.5)):
        assert torch.equal(got, want)
    wb = w.bfloat16()  # held as the engine holds it: widened exactly, the fp32 GEMM of the same values
    for got, want in zip(rt.route_ref(x, wb, 3, True, 2.5), rt.route_ref(x, wb.float(), 3, True, 2.5)):
        assert torch.equal(got, want)


# ---- GPU tests -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    _check(c, r)
    print(_summary(c, r))


@pytest.mark.gpu
def test_gpu_property():
    _check_property(PROPERTY, property_job("cuda", GPU_PROPERTY_EXAMPLES), GPU_PROPERTY_EXAMPLES)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [6, 8])
def test_gpu_graph_replay_bit_identical(R):
    """Captured in a CUDA graph (no host sync), replays equal eager bit for bit, also after new inputs."""
    c = case("graph", R=R, E=256, H=6144, block_e=None, block_h=None, scaling=1.0, seed=200)
    t = build(c, "cuda")
    x = t["x"].clone()

    def step():
        return rt.route(x, t["w"], 8, True, 1.0)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        eager = step()
        again = step()
        for a, b, d in zip(captured, eager, again):
            assert torch.equal(a, b) and torch.equal(b, d)
            if a.dtype == torch.float32:
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 6, 8])
def test_gpu_matches_torch_path(R):
    """Against fast/model.py's torch sequence on torch's own (cuBLAS fp32) logits: experts equal except in
    rows whose reference scores have a near-tie at the top-k boundary or inside it (logit rounding)."""
    c = case("torch_path", R=R, E=256, H=6144, block_e=None, block_h=None, ties=False, seed=300 + R)
    t = build(c, "cuda")
    check_torch_path(t, rt.route(t["x"], t["w"], 8, True, 1.0), f"R={R}")


def check_torch_path(t: dict, got: tuple, label: str) -> None:
    """`got` (weights, experts, scores) against route_ref on torch's fp32 GEMM of t's x and router (k = 8, norm,
    scaling 1)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        rw, re, rs = rt.route_ref(t["x"], t["w"], 8, True, 1.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    w, e, s = got
    # Two fp32 summation orders of H = 6144 products give logits ~3e-6 apart (|logit| ~ 2), so scores
    # ~3e-6 apart (relative; measured on the CPU with torch): TORCH_PATH_TOL leaves a margin.
    top = torch.sort(rs, dim=-1, descending=True).values[:, :9]
    near_tie = ((top[:, :-1] - top[:, 1:]) <= TORCH_PATH_TOL * top[:, :-1]).any(dim=1)
    differs = (e != re).any(dim=1)
    assert not (differs & ~near_tie).any(), f"experts differ without a near-tie in rows {differs.nonzero().tolist()}"
    same = ~differs
    assert ((s - rs).abs() <= TORCH_PATH_TOL * rs + 1e-30).all()
    assert ((w[same] - rw[same]).abs() <= TORCH_PATH_TOL * rw[same].abs()).all()
    print(f"{label}: {int(differs.sum())} rows differ from the torch path (near-ties: {int(near_tie.sum())})")


@pytest.mark.gpu
@pytest.mark.parametrize("data, ties", [("randn", False), ("randn", True), ("int", True)])
def test_gpu_bf16_router_and_packed_topk_bit_identical(data, ties):
    """At the model's decode shape (R = 6, E = 256, H = 6144, k = 8): the router held in bf16 gives the bits of
    its values held in fp32, the packed top-k the bits of the two-reduction one, and all four within the torch
    path's tolerance."""
    c = case("bf16_packed", R=6, E=256, H=6144, block_e=None, block_h=None, scaling=1.0, data=data, ties=ties,
             wdtype="bf16", seed=500 + ties)
    t = build(c, "cuda")
    assert t["w"].dtype == torch.bfloat16
    outs = {}
    for held in ("bf16", "fp32"):
        for packed in (True, False):
            w = t["w"] if held == "bf16" else t["w"].float()
            out, seen = observed_route(t["x"], w, 8, True, 1.0, packed_topk=packed)
            outs[held, packed] = (*out, seen["logits"])
    want = outs["bf16", True]  # the engine's: bf16 router, packed keys
    for key, got in outs.items():
        for name, a, b in zip(("weights", "experts", "scores", "logits"), got, want):
            assert torch.equal(a, b), f"{key}: {name} differ from the bf16/packed outputs"
        check_torch_path(t, got[:3], f"{data} ties={ties} {key}")


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in INTERPRETED_CASES]
                + [(PROPERTY["name"], property_job), (SELECT_PROPERTY["name"], select_property_job)])

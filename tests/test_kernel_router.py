"""kernels/router.py against the torch form it replaces, TorchOps.route_on(b, router, k) =
reference.layers.route(b.float() @ router.T, k) (docs/model.md, "Mixture of experts"), and against the exact (float64)
routing of the same inputs.

Tolerances, as data (TOLERANCES below, with their reasons). Each fp32 logit is within g sum_h |b_h w_eh| of the exact
one, whatever the summation order: g = gamma_H = H u / (1 - H u), u = 2^-24, always (Higham, Thm 3.1;
kernels/device.logit_tolerance is twice that: kernel against torch), and g = 8 sqrt(H) u (when smaller) except with
probability < 2 H e^-32 a logit, rounding errors taken as independent (Higham and Mary's probabilistic bound, lambda =
8). A row's log-scores then move by at most B(g) = 2 g max_e sum_h |b_h w_eh| + u (2 max_e |l_e - max l| + E + 9)
(qualify/router.scores_error: the shift, a sum of E terms, exp within 2 ulps, the division), so:
  exact    |ln s_kernel - ln s_exact| <= B(gamma_H)         (catches a dropped H split: ~1/splits of the terms)
  scores   |ln s_kernel - ln s_torch| <= 2 B(g)             (each side within B(g) of the exact log-scores)
  weights  |ln w_kernel - ln w_torch| <= 4 B(g) + 2 (k + 1) u  (rows choosing the same experts: s_e / sum of k)
  experts  EXACTLY the stable top k of the kernel's own scores (equal scores: the lower index), and torch's except
           in a near-tie row: two of the exact top k + 1 logits within 2 B(g), the most the two orders can swap them
           by. Integer data (logits exact multiples of 1/16 in any order, so ties everywhere): torch's, exactly.
The measured ratios are printed with -s.

Under Triton's CPU interpreter, in one worker subprocess: 1 and 8 rows (and 3, 5), E = 8, 16, 48 (not a power of two),
64 and 256, H = 3072 and small H (partial tiles), k = 1, 2, 5, 8 and k = E, bf16 and fp32 inputs, a strided b, H
split 1, 2, 3 and 6 (one tile a split: the preloaded weight), router rows copied so experts tie bit for bit at and
across the top-k boundary, integer data, and an all-equal router (experts 0..k-1, weights 1/k: the tie rule itself).
Negative controls, jit pieces substituted from here (`kernels.testing.substituted`), must fail the same checks: ties
to the higher index, and a split sum that drops the last H split. `@pytest.mark.gpu`: every case, the published
decode shapes (E = 256, H = 3072, R = 1, 6, 8, bf16 b), settings variants, PDL and CUDA-graph replay bit-identical to
a plain launch.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.fast.torch_ops import TorchOps
from iquest.kernels import router as rt
from iquest.kernels.device import logit_tolerance
from iquest.kernels.testing import interpreted_tests, substituted

U = 2.0 ** -24
LAMBDA = 8.0  # the probabilistic bound's lambda: it fails with probability < 2 H exp(-LAMBDA^2 / 2) a logit
TOLERANCES = {  # name: (multiple of B, which g, why); B per row as in the module docstring
    "exact": (1.0, "always", "the kernel's fp32 logits within gamma_H sum|b w| of float64's, then its fp32 softmax"),
    "scores": (2.0, "probable", "kernel and torch each within B of the exact log-scores"),
    "weights": (4.0, "probable", "each side's renormalized weight within 2 B + (k + 1) u of the exact one"),
    "near_tie": (2.0, "probable", "the most two fp32 orders can move the gap between two log-scores"),
}


# ---- negative controls: broken jit pieces put into copies of the kernels ---------------------------------
@triton.jit
def ranked_high(idx, E_PAD: tl.constexpr):
    return E_PAD - 1 - idx


@triton.jit
def sum_splits_dropping_last(part_ptr, row, R, E, splits, E_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    idx = tl.arange(0, E_PAD)
    s_in = tl.arange(0, SPLIT_BLOCK)
    logits = tl.zeros([E_PAD], tl.float32)
    for s0 in range(0, splits, SPLIT_BLOCK):
        s = s0 + s_in
        part = tl.load(part_ptr + ((s[:, None] * R + row) * E + idx[None, :]),
                       mask=(s[:, None] < splits - 1) & (idx < E)[None, :], other=0.0)
        logits += tl.sum(part, axis=0)
    return logits


CONTROLS = {"ties_high": {"_router_select_kernel": {"_tie_rank": ranked_high}},
            "drop_split": {"_router_select_kernel": {"_sum_splits": sum_splits_dropping_last}}}

BASE = dict(R=8, E=64, H=200, k=8, dtype="bf16", data="randn", b_stride=None, broken=None, twin=None, seed=0,
            settings=dict(block_e=16, block_h=32), warm=None)
# warm: the I_r rows of Gate and Up codes passed as `route(warm=...)`; the results must be the plain call's bit for bit
# (the L2 requests exist only on the GPU: under the interpreter this checks the plumbing and the refusals)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


MODEL = dict(E=256, H=3072, k=8, settings={})  # the published router, default settings

CASES = [
    case("1row_E8_k_is_E_fp32", R=1, E=8, k=8, H=70, dtype="fp32", settings=dict(block_e=4, block_h=32, split=3)),
    case("1row_E16_k2_H3072", R=1, E=16, k=2, H=3072, seed=1, settings=dict(block_e=16, block_h=512)),
    case("8rows_E16_H3072_auto_split_preload", R=8, E=16, H=3072, seed=2, settings={}),
    case("8rows_model_default_settings", R=8, **MODEL, seed=3),
    case("8rows_model_split6_preload_twin", R=8, **dict(MODEL, settings=dict(block_e=16, split=6)), seed=4,
         twin=dict(block_e=16, split=6, preload=False)),
    case("3rows_E256_ties_fp32", R=3, E=256, H=200, dtype="fp32", data="ties", seed=5,
         settings=dict(block_e=32, block_h=64, split=2)),
    case("8rows_E64_ties_bf16", R=8, data="ties", seed=6, settings=dict(block_e=16, block_h=32, split=3)),
    case("8rows_E64_integer", R=8, H=96, data="int", seed=7, settings=dict(block_e=16, block_h=32, split=2)),
    case("3rows_E16_integer_k1", R=3, E=16, k=1, H=40, data="int", seed=18),
    case("5rows_E48_k5_strided_fp32", R=5, E=48, k=5, H=120, dtype="fp32", b_stride=2, seed=9,
         settings=dict(block_e=16, block_h=32, split=2)),
    case("8rows_all_equal_router", R=8, E=16, k=5, H=64, data="equal", seed=10),
    case("6rows_E16_warm", R=6, E=16, k=4, H=64, seed=11, warm=16),
    # negative controls: must fail the checks the cases above pass
    case("broken_ties_to_higher_index", R=8, H=96, data="int", broken="ties_high", seed=20,
         settings=dict(block_e=16, block_h=32, split=2)),
    case("broken_all_equal_ties_to_higher_index", R=2, E=16, k=5, H=64, data="equal", broken="ties_high", seed=21),
    case("broken_dropped_split", R=3, H=200, broken="drop_split", seed=22, settings=dict(block_e=16, block_h=32,
                                                                                       split=4)),
]

GPU_CASES = [  # the published decode shapes
    case("gpu_1row_model", R=1, **MODEL, seed=100),
    case("gpu_6rows_model", R=6, **MODEL, seed=101),
    case("gpu_8rows_model", R=8, **MODEL, seed=102, twin=dict(preload=False)),
    case("gpu_8rows_model_fp32", R=8, **dict(MODEL, dtype="fp32"), seed=103),
    case("gpu_8rows_model_ties", R=8, **dict(MODEL, data="ties"), seed=104),
    case("gpu_8rows_model_integer", R=8, **dict(MODEL, data="int"), seed=105),
    case("gpu_8rows_model_split1", R=8, **dict(MODEL, settings=dict(split=1)), seed=106),
    case("gpu_8rows_model_split5_uneven", R=8, **dict(MODEL, settings=dict(split=5)), seed=107),
    case("gpu_8rows_model_tile_8x256", R=8, **dict(MODEL, settings=dict(block_e=8, block_h=256)), seed=108),
    case("gpu_6rows_model_warm", R=6, **MODEL, seed=109, warm=192),  # a TP8 rank's 192-row expert slabs
    *[case(f"gpu_6rows_model_select_{w}_warps", R=6, **dict(MODEL, settings=dict(select_warps=w)), seed=110 + w)
      for w in (1, 2, 8)],
    case("gpu_broken_ties_high", R=8, **dict(MODEL, data="int"), broken="ties_high", seed=120),
    case("gpu_broken_dropped_split", R=8, **dict(MODEL, settings=dict(split=6)), broken="drop_split", seed=121),
]


# ---- inputs ---------------------------------------------------------------------------------------------
def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, E, H, k = c["R"], c["E"], c["H"], c["k"]
    cols = H * (c["b_stride"] or 1)
    if c["data"] in ("int", "equal"):  # +-1, +-2 and +-1/16, +-2/16: every logit an exact multiple of 1/16, many equal
        vals = torch.tensor([-2.0, -1.0, 1.0, 2.0])
        wide = vals[torch.randint(0, 4, (R, cols), generator=gen)]
        w = vals[torch.randint(0, 4, (E, H), generator=gen)] / 16
    else:  # b like a normalized row, logits of std ~2 like a trained router's
        wide = torch.randn(R, cols, generator=gen)
        w = torch.randn(E, H, generator=gen) * (2 / H ** 0.5)
    b = wide.to(torch.bfloat16 if c["dtype"] == "bf16" else torch.float32)[:, :H]
    if c["data"] == "equal":
        w = w[:1].expand(E, H).clone()
    if c["data"] == "ties":  # a chosen expert's router row copied over another's: bit-equal logits in every row
        for r, rank in zip(range(R), (0, k - 1, k // 2)):
            order = torch.sort(b[r].double() @ w.double().T, descending=True, stable=True).indices
            a = int(order[min(rank, E - 1)])
            w[(a + 1 + int(torch.randint(0, E - 1, (1,), generator=gen))) % E] = w[a]
    return dict(b=b.to(device), w=w.contiguous().to(device))


def settings_of(kw: dict) -> rt.RouterSettings:
    return rt.RouterSettings(**kw)


def run_route(t: dict, k: int, settings: rt.RouterSettings, broken: str | None = None, **kw):
    with substituted(rt, CONTROLS[broken] if broken else {}):
        return rt.route(t["b"], t["w"], k, settings=settings, **kw)


# ---- one case -------------------------------------------------------------------------------------------
def measure(b: torch.Tensor, w: torch.Tensor, k: int, got: tuple, want: tuple) -> dict:
    """The checks' quantities for the kernel's (weights, experts, scores) `got` against torch's `want`."""
    wk, ek, sk = (x.cpu() for x in got)
    wt, et, st = (x.cpu() for x in want)
    b64, w64 = b.double().cpu(), w.double().cpu()
    R, E = sk.shape
    H = b.shape[1]
    g = {"always": H * U / (1 - H * U)}
    g["probable"] = min(g["always"], LAMBDA * H ** 0.5 * U)
    logits = b64 @ w64.T
    exact = torch.softmax(logits, -1)
    t = (logits - logits.max(-1, keepdim=True).values).abs()
    mags = (b64.abs() @ w64.abs().T).max(-1, keepdim=True).values
    B = {name: 2 * v * mags + U * (2 * t.max(-1, keepdim=True).values + E + 9) for name, v in g.items()}  # [R, 1]

    def bound(name):
        return TOLERANCES[name][0] * B[TOLERANCES[name][1]]
    big = exact > 1e-30

    def ln_ratio(x, y, bound):  # max |ln x - ln y| / bound over entries whose exact value does not underflow
        d = (x.double().log() - y.double().log()).abs() / bound
        return float(torch.where(big, d, 0.0).nan_to_num(nan=float("inf")).max())

    own = torch.sort(sk, dim=-1, descending=True, stable=True).indices[:, :k]
    top = torch.sort(logits, dim=-1, descending=True).values[:, :k + 1]
    gaps = top[:, :-1] - top[:, 1:]
    near_tie = (gaps <= bound("near_tie")).any(-1) if gaps.numel() else torch.zeros(R, dtype=torch.bool)
    differs = (ek != et).any(-1)
    same = ~differs
    w_bound = bound("weights") + 2 * (k + 1) * U
    w_ratio = ((wk.double().log() - wt.double().log()).abs() / w_bound)[same]
    sel = sk.gather(1, ek)
    rivals = (sk.unsqueeze(1) == sel.unsqueeze(2)).sum(-1) - 1  # [R, k]: other experts with a bit-equal score
    unselected = torch.ones(R, E, dtype=torch.bool).scatter(1, ek, False)
    return {
        "shapes": [list(wk.shape), list(ek.shape), list(sk.shape)],
        "dtypes": [str(wk.dtype), str(ek.dtype), str(sk.dtype)],
        "finite": bool(torch.isfinite(wk).all() and torch.isfinite(sk).all()),
        "own_topk": bool(torch.equal(ek, own)),
        "exact_ratio": ln_ratio(sk, exact, bound("exact")),
        "torch_score_ratio": ln_ratio(sk, st, bound("scores")),
        "weight_ratio": float(w_ratio.max()) if w_ratio.numel() else 0.0,
        "experts_equal_torch": bool(torch.equal(ek, et)),
        "differ_rows": int(differs.sum()),
        "near_tie_rows": int(near_tie.sum()),
        "unexplained_rows": int((differs & ~near_tie).sum()),
        "tie_slots": int((rivals > 0).sum()),
        "boundary_tie_rows": int(((sk == sel[:, -1:]) & unselected).any(-1).sum()),
        "experts": ek.tolist(),
        "weights": wk.tolist(),
    }


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    s = settings_of(c["settings"])
    got = run_route(t, c["k"], s, c["broken"])
    want = TorchOps.route_on(t["b"], t["w"], c["k"])
    split = s.split if s.split is not None else rt.choose_split(c["E"], c["H"], s, t["b"].device)
    splits, h_per_split = rt.split_plan(c["H"], split, s.block_h)
    r = dict(measure(t["b"], t["w"], c["k"], got, want), splits=splits,
             preloaded=s.preload and h_per_split == s.block_h)
    if c["warm"]:
        codes = torch.randint(0, 256, (2, c["E"], c["warm"], c["H"]), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(c["seed"])).view(torch.float8_e4m3fn)
        warmed = run_route(t, c["k"], s, warm=tuple(codes.to(device)))
        r["warm_bit_equal"] = all(torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                              b.view(torch.int32) if b.dtype == torch.float32 else b)
                                  for a, b in zip(got, warmed))
    if c["twin"] is not None:  # the same case under other settings that keep the summation order: the same bits
        twin = run_route(t, c["k"], settings_of(c["twin"]))
        r["twin_bit_equal"] = all(torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                              b.view(torch.int32) if b.dtype == torch.float32 else b)
                                  for a, b in zip(got, twin))
    return r


def check_values(c: dict, r: dict) -> None:
    R, E, k = c["R"], c["E"], c["k"]
    assert r["shapes"] == [[R, k], [R, k], [R, E]], r["shapes"]
    assert r["dtypes"] == ["torch.float32", "torch.int64", "torch.float32"], r["dtypes"]
    assert r["finite"], "non-finite weights or scores"
    assert r["exact_ratio"] <= 1, f"{c['name']}: scores off the exact ones by {r['exact_ratio']:.2e} of the bound"
    assert r["own_topk"], f"{c['name']}: experts differ from the top k of the kernel's own scores (lower index on ties)"
    assert r["torch_score_ratio"] <= 1, f"{c['name']}: scores off torch's by {r['torch_score_ratio']:.2e} of the bound"
    assert r["unexplained_rows"] == 0, f"{c['name']}: experts differ from torch's in {r['unexplained_rows']} rows " \
                                       "without a near-tie"
    assert r["weight_ratio"] <= 1, f"{c['name']}: weights off torch's by {r['weight_ratio']:.2e} of the bound"
    if c["data"] in ("int", "equal"):  # logits exact in any order: ties are ties in both, and go the same way
        assert r["experts_equal_torch"], f"{c['name']}: experts differ from torch's on exact logits"
    if c["data"] in ("int", "ties", "equal"):
        assert r["tie_slots"] > 0, f"{c['name']}: no selected expert had a bit-equal rival (ties not exercised)"
    if c["data"] == "equal":
        assert all(row == list(range(k)) for row in r["experts"]), f"{c['name']}: experts {r['experts']}, " \
                                                                   "not the lower indices"
        assert all(abs(x - 1 / k) <= 2 * U for row in r["weights"] for x in row), r["weights"]
    if c["settings"].get("split", 1) > 1:
        assert r["splits"] > 1, f"{c['name']}: asked for {c['settings']['split']} splits, ran {r['splits']}"
    if c["twin"] is not None:
        assert r["twin_bit_equal"], f"{c['name']}: settings {c['twin']} changed the bits"
    if c["warm"]:
        assert r["warm_bit_equal"], f"{c['name']}: warming the chosen experts' slabs changed the bits"


def _check(c: dict, r: dict) -> None:
    if not c["broken"]:
        check_values(c, r)
        return
    if c["broken"] == "ties_high":
        assert r["tie_slots"] > 0, "no tie for the broken tie rule to get wrong"
        caught_by = "top k of the kernel's own scores"
    else:
        assert r["splits"] >= 2, "one split: nothing to drop"
        caught_by = "off the exact ones"
    with pytest.raises(AssertionError, match=caught_by):
        check_values(c, r)


def _summary(c: dict, r: dict) -> str:
    return (f"{c['name']}: splits {r['splits']}, of the bounds: exact {r['exact_ratio']:.1e}, vs torch scores "
            f"{r['torch_score_ratio']:.1e}, weights {r['weight_ratio']:.1e}; rows differing from torch "
            f"{r['differ_rows']} (near-ties {r['near_tie_rows']}), tie slots {r['tie_slots']}, boundary ties "
            f"{r['boundary_tie_rows']}")


# ---- interpreter tests ----------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check, _summary)


def test_cases_cover_the_boundaries():
    plain = [c for c in CASES if not c["broken"]]
    assert {1, 8} <= {c["R"] for c in plain} and {8, 16, 256} <= {c["E"] for c in plain}
    assert {3072} < {c["H"] for c in plain} and {"bf16", "fp32"} == {c["dtype"] for c in plain}
    assert {c["broken"] for c in CASES} == {None, *CONTROLS}


def test_split_heuristic():
    cpu, s = torch.device("cpu"), rt.RouterSettings()  # 8 "SMs" off the GPU: 64 programs wanted
    assert rt.choose_split(256, 3072, s, cpu) == 1  # 64 expert tiles fill it
    assert rt.choose_split(64, 3072, s, cpu) == 4
    assert rt.choose_split(16, 100, rt.RouterSettings(block_e=16, block_h=32), cpu) == 4  # one split per H tile
    assert rt.split_plan(3072, 6, 512) == (6, 512)
    assert rt.split_plan(3072, 4, 512) == (3, 1024)  # whole tiles per split: 3 run, none empty
    assert rt.split_plan(70, 3, 32) == (3, 32)


def test_fits():
    assert rt.fits(1, 256, 3072) and rt.fits(8, 256, 3072) and rt.fits(8, 16, 1)
    assert not rt.fits(9, 256, 3072) and not rt.fits(0, 256, 3072) and not rt.fits(8, rt.MAX_EXPERTS + 1, 16)


def test_logit_tolerance_is_twice_the_fp32_bound():
    b, w = torch.randn(3, 40), torch.randn(16, 40)
    gamma = 40 * U / (1 - 40 * U)
    assert torch.allclose(logit_tolerance(b, w), 2 * gamma * (b.double().abs() @ w.double().abs().T))


def _args(**over):
    a = dict(b=torch.randn(3, 40).bfloat16(), router_w=torch.randn(16, 40), top_k=2)
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(b=torch.randn(3, 41)), "H="),
    (dict(b=torch.randn(40)), "2-D"),
    (dict(b=torch.randn(9, 40)), "block of 9 rows .* run the torch form"),
    (dict(b=torch.randn(3, 40).double()), "b torch.float64 must be"),
    (dict(router_w=torch.randn(16, 40).bfloat16()), "router_w torch.bfloat16 must be float32"),
    (dict(b=torch.randn(40, 3).T), "unit stride"),
    (dict(router_w=torch.randn(40, 16).T), "contiguous"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=17), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(settings=rt.RouterSettings(split=0)), "split"),
    (dict(settings=rt.RouterSettings(block_e=3)), "powers of two"),
    (dict(settings=rt.RouterSettings(block_h=8)), "powers of two"),
    (dict(settings=rt.RouterSettings(select_warps=3)), "select_warps"),
    (dict(settings=rt.RouterSettings(preload=1)), "preload"),
    (dict(router_w=torch.randn(rt.MAX_EXPERTS + 1, 40)), "not taken"),
    (dict(settings=rt.RouterSettings(warm_chunk_bytes=1000)), "warm_chunk_bytes"),
    (dict(warm=(torch.zeros(16, 4, 40, dtype=torch.uint8),)), "warm must be"),
    (dict(warm=(torch.zeros(8, 4, 40, dtype=torch.uint8),) * 2), "warm must be"),  # not one slab an expert
    (dict(warm=(torch.zeros(16, 4, 40), torch.zeros(16, 4, 40))), "warm must be"),  # four bytes an element
    (dict(warm=(torch.zeros(16, 4, 40, dtype=torch.uint8), torch.zeros(16, 2, 40, dtype=torch.uint8))),
     "warm must be"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=f"router: .*{message}"):
        rt.route(**_args(**over))


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        rt.RouterSettings().split = 2


# ---- GPU tests ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch form's fp32 matmul, as the engine runs it
    try:
        r = run_case(c, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    _check(c, r)
    print(_summary(c, r))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 8])
def test_gpu_pdl_and_graph_replay_bit_identical(R):
    """With PDL, and captured in a CUDA graph (no host sync), the outputs are a plain launch's bit for bit, also after
    new inputs."""
    t = build(case("graph", R=R, **MODEL, seed=200), "cuda")
    b = t["b"].clone()

    def step(pdl):
        return rt.route(b, t["w"], 8, pdl=pdl)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(True)
    for seed in range(3):
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)).to(b.dtype).cuda())
        graph.replay()
        plain = step(False)
        for a, p in zip(captured, plain):
            assert torch.equal(a, p)
            if a.dtype == torch.float32:
                assert torch.equal(a.view(torch.int32), p.view(torch.int32))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])

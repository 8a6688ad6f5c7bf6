"""kernels/moe.py and kernels/moe_route.py against plain torch (reference/fp8.py).

Per case (fresh random x, expert weights from reference/fp8.quantize with per-block magnitudes
spanning two decades, routing choices, NaN-prefilled outputs), the interpreter worker checks:
- grouping equal to torch.sort-based `moe_group_ref` (order, segment experts, starts, lengths);
- Gate/Up's split along H: the finalize summed exactly `split` partials for every live pair and
  none for padding pairs (the split cases force split > 1 with several K tiles per split, a last
  split shorter or ending in a partial tile, split boundaries inside a scale block);
- the kernel's E4M3 activations and scales bit-exact vs reference/fp8.act_quant of its own fp32
  hidden (silu(Gate x) * Up x), which itself matches the float64 hidden to fp32 accuracy;
- the output vs Down applied to its own E4M3 activations (DOWN_TOL), and vs `moe_ref` (same
  act_quant rounding, float64) within TOL; padding rows exactly 0;
- padding rows read no expert weights: experts chosen only by padding rows are filled with NaN
  (weights and scales of Gate, Up and Down), and the output must stay finite and bit-equal;
- `moe_ref` vs the unquantized float math within the E4M3 rounding bound, elementwise:
  |out_q - out| <= sum_j |w_j| sum_i |Down_e[n, i]| (2^-4 |h_i| + 2^-10 s_g(i))   (half an E4M3
  ulp relative in the normal range, half the subnormal spacing 2^-9 times the group scale below).
Negative control: a debug switch makes the finalize drop the last split; the value checks must
fail on that run, whose split counts show the broken branch ran for every live pair.
The standalone act_quant kernel is checked bit-exact on E4M3 midpoints (ties to even), values just
beside them, subnormals, saturation at 448, all-zero groups and groups below the 1e-4 clamp.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import moe as mk
from iquest.kernels.moe_route import moe_group, moe_group_ref
from iquest.reference.fp8 import act_quant as act_quant_ref, quantize
from iquest.kernels.testing import interpreted_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative to max |ref|, by output dtype. Kernel vs Down applied to the kernel's own E4M3 activations
# is tight; vs moe_ref it allows an E4M3 rounding flip or two where the fp32 hidden differs from
# moe_ref's in the last bits (one flip moves one channel by an E4M3 ulp).
DOWN_TOL = {"fp32": 1e-5, "bf16": 1e-2}
TOL = {"fp32": 2e-3, "bf16": 1e-2}

BASE = dict(R=8, k=4, E=16, H=64, I=32, block=(16, 16), x="fp32", out="fp32", live="all", pattern="random",
            block_k=128, down_block_n=32, down_block_k=64, seed=0, split_k=None)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row", R=1),
    case("1row_k8", R=1, k=8, E=32),
    case("8rows_random"),
    case("8rows_k8_E64", k=8, E=64, H=48),
    case("8rows_shared_expert", pattern="shared"),         # every row has expert 0, in different slots
    case("8rows_all_same_experts", pattern="same"),        # one segment of 8 rows per expert
    case("ties_equal_weights_same_experts", pattern="same", weights="equal", R=5),
    case("padding_mask_poisoned", live="mask", pattern="poison"),
    case("padding_count_poisoned", live="count", pattern="poison", R=7),
    case("no_live_rows", live="none"),
    case("partial_n_tiles_and_blocks", H=72, down_block_n=32),  # H % 16 != 0, H % 32 != 0
    case("partial_tiles_1row_count", R=1, H=40, live="count"),
    case("rect_blocks_32x16", block=(32, 16), H=80, I=48),
    case("group_32_two_k_tiles", block=(32, 32), I=64, H=96, block_k=16, down_block_k=16),
    case("bf16_in_bf16_out", x="bf16", out="bf16"),
    case("bf16_in_fp32_out_3rows", R=3, x="bf16"),
    case("mini_model_shape", R=4, E=16, k=4, H=256, I=128, block=(16, 16)),
    case("mini_model_default_tiles", R=2, E=16, k=4, H=256, I=128, block=(16, 16), block_k=None, down_block_n=None,
         down_block_k=None),  # moe()'s defaults, as fast/ops.py calls it
    # Gate/Up split along H (block_k = 16 below: K tiles of 16; `split` = the split the wrapper must use)
    case("split3_tiles_3_3_2", H=128, block_k=16, split_k=3, split=3),
    case("split3_last_tile_partial", H=136, block_k=16, split_k=3, split=3),  # 3, 3, 2.5 tiles
    case("split4_shared_uneven_segments", H=128, block_k=16, split_k=4, split=4, pattern="shared"),
    case("split3_all_8rows_same", H=128, block_k=16, split_k=3, split=3, pattern="same"),
    case("split4_1row_k8", R=1, k=8, E=32, H=128, block_k=16, split_k=4, split=4),
    case("split3_padding_mask_poisoned", H=96, block_k=16, split_k=3, split=3, live="mask", pattern="poison"),
    case("split2_padding_count_poisoned", R=7, H=96, block_k=16, split_k=2, split=2, live="count",
         pattern="poison"),
    case("split2_no_live_rows", H=96, block_k=16, split_k=2, split=2, live="none"),
    case("split2_segments_of_24_rows", R=24, k=4, E=8, H=96, block_k=16, split_k=2, split=2, pattern="same"),
    case("split_clamped_to_k_tiles", H=64, block_k=16, split_k=100, split=4),  # one K tile each
    case("split_5_becomes_4", H=128, block_k=16, split_k=5, split=4),  # 2 tiles each, no empty split
    case("split2_in_scale_block_group32", block=(32, 32), I=64, H=96, block_k=16, down_block_k=16, split_k=2,
         split=2),  # splits of 48: the boundary lies inside a 32-wide scale block
    case("split3_bf16_in_bf16_out", H=128, block_k=16, split_k=3, split=3, x="bf16", out="bf16"),
]
# Negative control (run by the worker, not by test_interpreted): the finalize drops the last split.
NEG_CASE = case("neg_drop_last_split", H=128, block_k=16, split_k=3, split=3, drop_last_split=True)

FULL = dict(k=8, E=256, H=6144, I=256, block=(128, 128), x="bf16", block_k=None, down_block_n=None,
            down_block_k=None)  # one TP8 rank at full size (I/TP = 256); None: moe()'s default tiles
GPU_CASES = [  # full size and the mini model (E=16, top-4, H=256, I=128, block 16)
    # min_split: the default split must take the split path at full size (8-16 on an H200)
    *[case(f"gpu_full_{r}rows", R=r, out="bf16", min_split=2, **FULL) for r in (1, 2, 4, 6, 8)],
    case("gpu_full_8rows_same", R=8, pattern="same", min_split=2, **FULL),
    case("gpu_full_8rows_poison", R=8, pattern="poison", live="count", min_split=2, **FULL),
    case("gpu_full_8rows_mask_fp32", R=8, live="mask", min_split=2, **dict(FULL, x="fp32")),
    case("gpu_full_8rows_split1", R=8, split_k=1, split=1, **FULL),
    case("gpu_full_8rows_split96", R=8, split_k=96, split=96, **FULL),  # one 64-wide K tile per split
    case("gpu_full_6rows_other_tiles", R=6, split_k=5, split=5,  # the pre-split tiles: 128-wide K, Down 32 x 64
         **dict(FULL, block_k=128, down_block_n=32, down_block_k=64)),
    *[case(f"gpu_mini_{r}rows", R=r, k=4, E=16, H=256, I=128, block=(16, 16), x="bf16") for r in (1, 8)],
]


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, k, E, H, I, (B0, B1) = c["R"], c["k"], c["E"], c["H"], c["I"], c["block"]

    def expert_weights(rows: int, cols: int):
        qs, ss = [], []
        for _ in range(E):
            mag = 10 ** (torch.rand(-(-rows // B0), -(-cols // B1), generator=gen) * 2 - 1)
            mag = mag.repeat_interleave(B0, 0)[:rows].repeat_interleave(B1, 1)[:, :cols]
            real = torch.randn(rows, cols, generator=gen) * mag
            q, s = quantize(real / cols ** 0.5, (B0, B1))
            qs.append(q)
            ss.append(s)
        return torch.stack(qs), torch.stack(ss)

    gate, gate_scale = expert_weights(I, H)
    up, up_scale = expert_weights(I, H)
    down, down_scale = expert_weights(H, I)

    live = torch.ones(R, dtype=torch.bool)
    if c["live"] == "mask":
        live = torch.rand(R, generator=gen) < 0.5
        live[0], live[-1] = False, True
    elif c["live"] in ("count", "none"):
        live = torch.arange(R) < (0 if c["live"] == "none" else (R + 1) // 2)
    pool = torch.arange(E)
    if c["pattern"] == "poison":  # padding rows choose from experts no live row chooses
        pool = torch.arange(E // 2)
    experts = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(R)])
    if c["pattern"] == "poison":
        experts[~live] += E // 2
    elif c["pattern"] == "shared":
        for r in range(R):
            row = experts[r][experts[r] != 0][: k - 1].tolist()
            experts[r] = torch.tensor(row[: r % k] + [0] + row[r % k:])
    elif c["pattern"] == "same":
        experts = torch.stack([experts[0][torch.randperm(k, generator=gen)] for _ in range(R)])
    weights = torch.softmax(torch.randn(R, k, generator=gen), -1)
    if c.get("weights") == "equal":
        weights = torch.full((R, k), 1.0 / k)
    x = torch.randn(R, H, generator=gen).to(DTYPES[c["x"]])
    live_arg = live if c["live"] in ("all", "mask") else torch.tensor(int(live.sum()), dtype=torch.int32)
    t = dict(x=x, experts=experts, weights=weights.float(), live=live_arg, gate=gate, gate_scale=gate_scale,
             up=up, up_scale=up_scale, down=down, down_scale=down_scale)
    return {name: v.to(device) for name, v in t.items()}, live


ARGS = ("x", "experts", "weights", "live", "gate", "gate_scale", "up", "up_scale", "down", "down_scale")


def run_kernel(c: dict, t: dict, debug: dict | None = None) -> torch.Tensor:
    out = torch.full((c["R"], c["H"]), float("nan"), dtype=DTYPES[c["out"]], device=t["x"].device)
    tiles = {n: c[n] for n in ("block_k", "down_block_n", "down_block_k") if c[n] is not None}
    got = mk.moe(*(t[a] for a in ARGS), block=c["block"], group=c["block"][1], out_dtype=DTYPES[c["out"]],
                 out=out, split_k=c["split_k"], debug=debug, **tiles)
    assert got is out
    return got


def run_case(c: dict, device: str) -> dict:
    t, live = build(c, device)
    R, k, H, group = c["R"], c["k"], c["H"], c["block"][1]
    debug = {"drop_last_split": True} if c.get("drop_last_split") else {}
    got = run_kernel(c, t, debug)
    res = {"finite": bool(torch.isfinite(got).all()), "dtype": str(got.dtype).removeprefix("torch.")}
    res["pad_zero"] = bool((got[~live.to(device)] == 0).all())

    ref_groups = moe_group_ref(t["experts"], t["live"])
    res["groups_equal"] = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(debug["groups"], ref_groups))

    pairs = live.repeat_interleave(k).nonzero().flatten().to(device)  # live (row, slot) pairs
    h = debug["hidden"][pairs]
    q_ref, s_ref = act_quant_ref(h, group)
    res["act_bit_exact"] = bool(torch.equal(debug["act"][pairs].view(torch.uint8), q_ref.view(torch.uint8))
                                and torch.equal(debug["act_scale"][pairs], s_ref))
    res["act_pairs"] = len(pairs)
    res["split"] = debug["split"]
    counts = debug["split_counts"].cpu()
    pad_pairs_cpu = (~live.cpu()).repeat_interleave(k)
    res["split_counts_live"] = sorted(set(counts[~pad_pairs_cpu].tolist()))  # splits summed per live pair
    res["split_counts_pad_zero"] = bool((counts[pad_pairs_cpu] == 0).all())

    res["down_rel_err"] = _down_from_act(c, t, pairs, debug, got)
    ref_q = mk.moe_ref(*(t[a] for a in ARGS), block=c["block"], group=group)
    ref_f = mk.moe_ref(*(t[a] for a in ARGS), block=c["block"], group=group, quantize_act=False)
    h64 = _hidden64(c, t, pairs)
    scale = max(ref_q.abs().max().item(), 1e-30)
    res["hidden_rel_err"] = 0.0
    if len(pairs):
        res["hidden_rel_err"] = ((h.double() - h64).abs().max() / h64.abs().max().clamp(min=1e-30)).item()
    res["rel_err"] = (got.double() - ref_q).abs().max().item() / scale
    bound = _e4m3_bound(c, t, pairs, h64)
    res["quant_err_over_bound"] = ((ref_q - ref_f).abs() / bound.clamp(min=1e-30)).max().item()
    res["quant_rel_err"] = (ref_q - ref_f).abs().max().item() / scale

    if c["pattern"] == "poison":  # experts chosen only by padding rows: NaN everywhere
        chosen = t["experts"].cpu()
        only_pad = sorted(set(chosen[~live].flatten().tolist()) - set(chosen[live].flatten().tolist()))
        assert only_pad or live.all()
        bad = dict(t)
        for name in ("gate", "up", "down"):
            bad[name] = t[name].clone()
            bad[name][only_pad] = float("nan")
            bad[name + "_scale"] = t[name + "_scale"].clone()
            bad[name + "_scale"][only_pad] = float("nan")
        poisoned = run_kernel(c, bad)
        res["poison_finite_equal"] = bool(torch.isfinite(poisoned).all() and torch.equal(poisoned, got))
        res["poisoned_experts"] = len(only_pad)
        # Gate/Up ran no program for them: no segment names them, and padding pairs' hidden rows
        # (NaN-prefilled) were never written. Down masks every load of a padding row.
        seg_experts = set(debug["groups"].seg_expert.tolist())
        pad_pairs = (~live).repeat_interleave(k).nonzero().flatten().to(device)
        res["pad_never_computed"] = bool(not seg_experts & set(only_pad) and debug["hidden"][pad_pairs].isnan().all())
    return res


def _hidden64(c, t, pairs):
    from iquest.reference.fp8 import dequantize

    rows = []
    for p in pairs.tolist():
        r, j = divmod(p, c["k"])
        e = int(t["experts"][r, j])
        x = t["x"][r].double()
        g = dequantize(t["gate"][e], t["gate_scale"][e], c["block"]) @ x
        u = dequantize(t["up"][e], t["up_scale"][e], c["block"]) @ x
        rows.append(torch.nn.functional.silu(g) * u)
    return torch.stack(rows) if rows else torch.zeros(0, c["I"], dtype=torch.float64, device=t["x"].device)


def _down_from_act(c, t, pairs, debug, got) -> float:
    """max |kernel - sum_j w_j Down_e(kernel's dequantized activations)| / max |that| (float64)."""
    from iquest.reference.fp8 import dequantize

    group = c["block"][1]
    y = torch.zeros(c["R"], c["H"], dtype=torch.float64, device=got.device)
    for p in pairs.tolist():
        r, j = divmod(p, c["k"])
        e = int(t["experts"][r, j])
        a = debug["act"][p].double().unflatten(-1, (-1, group)) * debug["act_scale"][p].double()[:, None]
        y[r] += float(t["weights"][r, j]) * (dequantize(t["down"][e], t["down_scale"][e], c["block"]) @ a.flatten())
    return (got.double() - y).abs().max().item() / max(y.abs().max().item(), 1e-30)


def _e4m3_bound(c, t, pairs, h64):
    """Elementwise bound on |moe_ref(quantized) - moe_ref(float)| from E4M3 rounding of h."""
    from iquest.reference.fp8 import dequantize

    group = c["block"][1]
    bound = torch.zeros(c["R"], c["H"], dtype=torch.float64, device=t["x"].device)
    for n, p in enumerate(pairs.tolist()):
        r, j = divmod(p, c["k"])
        e = int(t["experts"][r, j])
        h = h64[n]
        s = h.float().unflatten(-1, (-1, group)).abs().amax(-1).clamp(min=1e-4).double() / 448
        err = 2.0 ** -4 * h.abs() + 2.0 ** -10 * s.repeat_interleave(group) + 1e-6 * h.abs()
        down = dequantize(t["down"][e], t["down_scale"][e], c["block"])
        bound[r] += abs(float(t["weights"][r, j])) * (down.abs() @ err)
    return bound


def _check(c: dict, r: dict) -> None:
    _check_values(c, r)
    if "split" in c:
        assert r["split"] == c["split"], f"split {r['split']}, expected {c['split']}"
    assert r["split"] >= c.get("min_split", 1), f"split {r['split']} < {c.get('min_split')}: not the split path"
    assert r["split_counts_live"] in ([], [r["split"]]), f"splits summed per live pair: {r['split_counts_live']}"
    assert r["split_counts_pad_zero"], "the finalize touched a padding pair"


def _check_values(c: dict, r: dict) -> None:
    assert r["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[c["out"]]
    assert r["finite"], "kernel left NaN in the output"
    assert r["pad_zero"], "padding rows must be written as 0"
    assert r["groups_equal"], "moe_group differs from moe_group_ref"
    assert r["act_bit_exact"], "E4M3 activations or scales differ from reference/fp8.act_quant"
    assert r["hidden_rel_err"] <= 1e-5, f"hidden rel err {r['hidden_rel_err']:.2e}"
    tol = DOWN_TOL[c["out"]]
    assert r["down_rel_err"] <= tol, f"Down on the kernel's activations: rel err {r['down_rel_err']:.2e} > {tol:.0e}"
    tol = TOL[c["out"]]
    assert r["rel_err"] <= tol, f"max |kernel - moe_ref| / max |ref| = {r['rel_err']:.2e} > {tol:.0e}"
    assert r["quant_err_over_bound"] <= 1.0, f"act_quant error exceeds the E4M3 bound ({r['quant_err_over_bound']:.3f})"
    if c["pattern"] == "poison":
        assert r["poisoned_experts"] > 0
        assert r["poison_finite_equal"], "a padding row's expert weights were read"
        assert r["pad_never_computed"], "Gate/Up computed a padding row's expert"


# ---- act_quant alone: ties, near-ties, subnormals, clamps ----------------------------------------------
def act_quant_inputs(group: int) -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mid, mid.nextafter(torch.tensor(1e9)), mid.nextafter(torch.tensor(-1e9))])
    vals = torch.cat([vals, -vals])
    n = -(-len(vals) // (group - 1)) * (group - 1)
    vals = torch.cat([vals, torch.zeros(n - len(vals))]).view(-1, group - 1)
    # first channel 448 makes s = 1 exactly, so the other channels land on midpoints as written
    rows = torch.cat([torch.full((len(vals), 1), 448.0), vals], 1)
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([rows, rows * 2.0 ** -20, rows * 8,  # s = 2^-20 (amax above the clamp) and 8
                      torch.zeros(2, group), torch.randn(3, group, generator=gen) * 1e-6,  # zero / clamped groups
                      torch.randn(4, group, generator=gen) * 10 ** torch.linspace(-3, 3, 4)[:, None]])
    return rows


def run_act_quant(device: str) -> dict:
    out = {}
    for group in (16, 128):
        x = act_quant_inputs(group).to(device)
        q, s = mk.act_quant(x, group)
        q_ref, s_ref = act_quant_ref(x, group)
        out[f"group{group}"] = {"q": bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))),
                                "s": bool(torch.equal(s, s_ref)), "rows": x.shape[0]}
    return out


# ---- interpreter tests ---------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(
    __file__, CASES, _check,
    lambda c, r: f"{c['name']}: rel err {r['rel_err']:.2e}, act_quant err / bound {r['quant_err_over_bound']:.3f}")


def test_interpreted_act_quant_bit_exact(interpreted):
    r = interpreted["act_quant"]
    assert "error" not in r, r.get("error")
    for group, v in r.items():
        assert v["q"] and v["s"], f"{group}: {v}"


def test_interpreted_negative_control_drop_last_split(interpreted):
    """The checks catch a wrong split sum: with the last split dropped they fail, on a run in which the
    broken branch summed split - 1 partials for every live pair."""
    c, r = NEG_CASE, interpreted[NEG_CASE["name"]]
    assert "error" not in r, r.get("error")
    assert r["split"] == 3 and r["act_pairs"] > 0
    assert r["split_counts_live"] == [2], f"the broken branch did not run: {r['split_counts_live']}"
    assert r["rel_err"] > TOL[c["out"]], "the output check alone must catch it"
    with pytest.raises(AssertionError, match="hidden rel err"):
        _check_values(c, r)
    with pytest.raises(AssertionError):
        _check(c, r)


def test_interpreted_group_matches_sort(interpreted):
    r = interpreted["group_random"]
    assert "error" not in r, r.get("error")
    assert r["mismatches"] == [] and r["trials"] > 100


def run_group_random() -> dict:
    gen = torch.Generator().manual_seed(2)
    bad, trials = [], 0
    for R, k, E in [(1, 8, 256), (8, 8, 256), (8, 4, 16), (8, 8, 9), (3, 2, 3), (16, 8, 8)]:
        for t in range(24):
            experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(R)])
            for live in (torch.rand(R, generator=gen) < 0.6, torch.tensor(t % (R + 1))):
                trials += 1
                if not all(torch.equal(a, b) for a, b in zip(moe_group(experts, live), moe_group_ref(experts, live))):
                    bad.append([R, k, E, t])
    return {"mismatches": bad, "trials": trials}


def _args(**over):
    c = case("args", R=2)
    t, _ = build(c, "cpu")
    t.update(over)
    return t


@pytest.mark.parametrize("over, message", [
    (dict(group=32), "must equal the weight block"),
    (dict(x=torch.randn(2, 63)), "must be contiguous float8_e4m3fn"),
    (dict(weights=torch.ones(2, 4, dtype=torch.float64)), "weights must be"),
    (dict(experts=torch.zeros(3, 4, dtype=torch.long)), "experts must be"),
    (dict(live=torch.ones(3, dtype=torch.bool)), "live mask must be"),
    (dict(live=torch.tensor([1.0])), "live must be"),
    (dict(down_scale=torch.ones(16, 4, 3)), "down scale must be"),
    (dict(gate=torch.zeros(16, 32, 64)), "gate must be"),
    (dict(out_dtype=torch.int8), "out_dtype"),
    (dict(split_k=0), "split_k must be"),
    (dict(down_block_n=8), "down_block_n must be"),
])
def test_rejects_bad_inputs(over, message):
    t = _args(**{k: v for k, v in over.items() if k in ARGS})
    kw = {k: v for k, v in over.items() if k not in ARGS}
    with pytest.raises(ValueError, match=message):
        mk.moe(*(t[a] for a in ARGS), block=(16, 16), **{"group": 16, **kw})


@pytest.mark.parametrize("R, split", [(1, 16), (2, 8), (6, 8), (8, 8), (16, 8)])
def test_default_split_fills_h200(R, split):
    """At TP8 full size on an H200 (132 SMs), default tiles (128 channels x 64 of K), the default split
    gives ~1.5-2 Gate/Up programs per SM for the decode pattern (~13 distinct experts at 6 rows, k at
    1 row) without exceeding the two an SM holds, in whole K tiles."""
    k, H, I, bn, bk = 8, 6144, 256, mk.GATE_UP_BLOCK_N, 64
    got, k_per_split = mk.plan_split(R * k, 256, k, H, I, bn, bk, None, sms=132)
    assert got == split and k_per_split % bk == 0 and (got - 1) * k_per_split < H <= got * k_per_split
    segments = k if R == 1 else 13
    assert 1.5 <= segments * (I // bn) * got / 132 <= 2


# ---- GPU tests (real shapes) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    _check(c, r)
    print(f"{c['name']}: rel err {r['rel_err']:.2e}, act_quant err / bound {r['quant_err_over_bound']:.3f}")


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 6, 8])
def test_gpu_graph_replay_bit_identical(R):
    """Full size, default split: repeated eager runs and CUDA graph replays (new x and routing copied
    into the captured inputs, a different live count) are bit-identical to eager (no atomics)."""
    c = case("g", R=R, k=8, E=256, H=6144, I=256, block=(128, 128), x="bf16", out="fp32", live="count")
    t, _ = build(c, "cuda")
    other, _ = build(dict(c, seed=1), "cuda")  # new inputs and routing, the same expert weights
    t2 = dict(t, x=other["x"], experts=other["experts"], weights=other["weights"],
              live=torch.tensor(R, dtype=torch.int32, device="cuda"))

    def run(src):
        return mk.moe(*(src[a] for a in ARGS), block=(128, 128), group=128, out_dtype=torch.float32)

    eager = [run(t).clone() for _ in range(2)]
    eager2 = run(t2).clone()
    assert torch.equal(eager[0], eager[1])
    static = {a: t[a].clone() for a in ARGS}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static)
    for src, want in ((t, eager[0]), (t2, eager2), (t, eager[0])):
        for a in ("x", "experts", "weights", "live"):
            static[a].copy_(src[a])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_gpu_act_quant_bit_exact():
    for group, v in run_act_quant("cuda").items():
        assert v["q"] and v["s"], f"{group}: {v}"


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 4, 8])
def test_gpu_speed_report(R):
    """Prints time and expert-weight bandwidth (distinct experts' Gate/Up/Down bytes) at TP8 full size."""
    from triton.testing import do_bench

    c = case("t", R=R, k=8, E=256, H=6144, I=256, block=(128, 128), x="bf16", out="bf16")
    t, _ = build(c, "cuda")
    ms = do_bench(lambda: mk.moe(*(t[a] for a in ARGS), block=(128, 128), group=128), warmup=20, rep=200)
    distinct = len(set(t["experts"].flatten().tolist()))
    split = mk.plan_split(R * 8, 256, 8, 6144, 256, 128, 128, None, mk._sm_count(torch.device("cuda")))[0]
    print(f"R={R}: {ms * 1e3:.1f} us, {distinct} experts, split {split}, "
          f"{3 * distinct * 256 * 6144 / (ms * 1e-3) / 1e12:.2f} TB/s")


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    jobs = [(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES + [NEG_CASE]]
    worker_main(jobs + [("act_quant", lambda: run_act_quant("cpu")), ("group_random", run_group_random)])

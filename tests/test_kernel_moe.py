"""kernels/moe.py against plain torch (reference/fp8.py) and against the five-launch form moe.py
replaced (a sort of the live pairs by expert, then per-segment kernels), kept below as `sorted_moe`:
the output must be bit-identical to it.

The interpreter runs INTERPRETED_CASES, each property of the list below once at small shapes (an interpreted
program costs the same whatever the GPU would do with it, so rows and tiles are few), with the oracle on ORACLE's
cases; the GPU runs every case, with the oracle, and the full-size ones.

Per case (fresh random x, expert weights from reference/fp8.quantize with per-block magnitudes
spanning two decades, routing choices, NaN-prefilled outputs), the checks:
- the output, E4M3 activations and scales bit-identical to `sorted_moe` on the same inputs (where the
  oracle runs), and for fp32 x with compute_dtype bf16 to `moe` itself on x.to(torch.bfloat16);
- expert ownership without a grouping launch: the Gate/Up and Down programs that did work are
  exactly the first live pair (row-major) of each distinct live expert, none for padding rows;
- Gate/Up's split along H: the finalize summed exactly `split` partials for every live pair and
  none for padding pairs (the split cases force split > 1 with several K tiles per split, a last
  split shorter or ending in a partial tile, split boundaries inside a scale block);
- the kernel's E4M3 activations and scales bit-exact vs reference/fp8.act_quant of its own fp32
  hidden (silu(Gate x) * Up x), which itself matches the float64 hidden to fp32 accuracy;
- the output vs Down applied to its own E4M3 activations (DOWN_TOL), and vs `moe_ref` (same
  act_quant rounding, float64) within TOL; padding rows exactly 0;
- padding rows read no expert weights: experts chosen only by padding rows are filled with NaN
  (weights and scales of Gate, Up and Down), the output must stay finite and bit-equal, no program
  owns them and padding pairs' hidden rows stay unwritten;
- `moe_ref` vs the unquantized float math within the E4M3 rounding bound, elementwise:
  |out_q - out| <= sum_j |w_j| sum_i |Down_e[n, i]| (2^-4 |h_i| + 2^-10 s_g(i))   (half an E4M3
  ulp relative in the normal range, half the subnormal spacing 2^-9 times the group scale below).
fp32 x rounded to bf16 in the kernel is bit-exact under the interpreter too (moe.py rounds with
integer ops, since the interpreter's own fp32 -> bf16 cast truncates): the fp32-x cases put exact
bf16 midpoints and their fp32 neighbours into x, and a probe kernel checks the rounding alone against
torch (and shows the interpreter's plain cast differs), so no case needs a wider tolerance.
The internals (activations, hidden, split counts, which programs worked) come from `mk._moe_probed`, a
test-only launcher that compiles the kernels' instrumentation stores in (the product's launches compile
them out). Negative controls, through the same launcher: the finalize drops the last split; the value
checks must fail on that run, whose split counts show the broken branch ran for every live pair. Another
lets every live pair's program work, repeated experts included: the ownership check must fail on a run
whose program counts show the extra programs ran (their stores repeat the owner's values, so the
output is unchanged: only the ownership check sees them).
The standalone act_quant kernel is checked bit-exact on E4M3 midpoints (ties to even), values just
beside them, subnormals, saturation at 448, all-zero groups and groups below the 1e-4 clamp.
"""

from __future__ import annotations

import inspect

import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.kernels import moe as mk
from iquest.kernels.f16_operands import bf16_grid
from iquest.kernels.moe import _act_quant_tile
from iquest.kernels.moe_route import load_live
from iquest.reference.fp8 import act_quant as act_quant_ref, quantize
from iquest.kernels.testing import interpreted_tests, substituted
from iquest.tests.kernel_controls import MOE as MOE_CONTROLS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative to max |ref|, by output dtype. Kernel vs Down applied to the kernel's own E4M3 activations
# is tight; vs moe_ref it allows an E4M3 rounding flip or two where the fp32 hidden differs from
# moe_ref's in the last bits (one flip moves one channel by an E4M3 ulp).
DOWN_TOL = {"fp32": 1e-5, "bf16": 1e-2}
TOL = {"fp32": 2e-3, "bf16": 1e-2}

BASE = dict(R=8, k=4, E=16, H=64, I=32, block=(16, 16), x="fp32", out="fp32", live="all", pattern="random",
            block_k=128, down_block_n=32, down_block_k=64, seed=0, split_k=None, compute=None)


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
    case("gate_up_16_wide_other_launch", R=5, I=64, gate_up_block_n=16,  # 4 Gate/Up tiles; warps/stages: GPU only
         launch=dict(gate_up_warps=4, gate_up_stages=2, down_warps=8, down_stages=4)),
    case("mini_model_default_tiles", R=2, E=16, k=4, H=256, I=128, block=(16, 16), block_k=None, down_block_n=None,
         down_block_k=None),  # moe()'s defaults, as fast/triton_ops.py calls it
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
    # ownership without a grouping launch: repeated experts, several row blocks, padding-only experts
    case("dup_16rows_k4_E8", R=16, k=4, E=8, H=64),  # every expert chosen by ~8 rows, in varying slots
    case("dup_32rows_k4_E6_mask_two_row_blocks", R=32, k=4, E=6, live="mask"),  # P = MAX_PAIRS, rows 0-15, 16-31
    case("dup_31rows_count_split2", R=31, k=4, E=8, H=96, block_k=16, split_k=2, split=2, live="count"),
    case("same8_k8_8rows", R=8, k=8, E=32, pattern="same"),  # all rows on the same 8 experts, permuted slots
    case("same8_k8_split3_bf16", R=8, k=8, E=32, H=128, block_k=16, split_k=3, split=3, pattern="same",
         x="bf16", out="bf16"),
    case("poison_k8_mask_padding_only_experts", R=8, k=8, E=64, live="mask", pattern="poison"),
    case("poison_k8_count_split2", R=8, k=8, E=64, H=96, block_k=16, split_k=2, split=2, live="count",
         pattern="poison"),
    # fp32 x, bf16 compute (x holds exact bf16 midpoints and their fp32 neighbours): bit-identical to bf16 x
    case("fp32x_bf16_6rows_bf16_out", R=6, compute="bf16", out="bf16", x_ties=True, default_out=True),
    case("fp32x_bf16_fp32_out_split3_shared", H=128, block_k=16, split_k=3, split=3, pattern="shared",
         compute="bf16", x_ties=True),
    case("fp32x_bf16_poison_count", R=7, live="count", pattern="poison", compute="bf16", out="bf16", x_ties=True),
    case("fp32x_bf16_mini_default_tiles", R=6, E=16, k=4, H=256, I=128, block=(16, 16), block_k=None,
         down_block_n=None, down_block_k=None, compute="bf16", out="bf16", x_ties=True),  # the engine's call
    # weight tiles through per-element pointers (tma=False; the default takes tensor descriptors wherever the rows
    # are 16-byte multiples, i.e. in every case above but the partial ones): the same tiles, so the oracle's bits
    case("pointer_loads_8rows_random", launch=dict(tma=False)),
    case("pointer_loads_split3_poison_count", R=7, H=96, block_k=16, split_k=3, split=3, live="count",
         pattern="poison", launch=dict(tma=False)),
    case("pointer_loads_fp32x_bf16_mini_default_tiles", R=6, E=16, k=4, H=256, I=128, block=(16, 16), block_k=None,
         down_block_n=None, down_block_k=None, compute="bf16", out="bf16", x_ties=True, launch=dict(tma=False)),
]
# The combine also adds the residual stream and writes the next norm's partial sums of squares (fused_input_norm);
# `residual` = the tiles a row has (COMBINE_BLOCK = 256 columns each, the last one partial at H = 560)
CASES += [
    case("residual_3rows_mask_3_tiles", R=3, H=560, live="mask", out="bf16", x="bf16", residual=3),
    case("residual_fp32x_bf16_mini_default_tiles", R=6, E=16, k=4, H=256, I=128, block=(16, 16), block_k=None,
         down_block_n=None, down_block_k=None, compute="bf16", out="bf16", x_ties=True, residual=1),
]
# Smaller forms of cases above, for the interpreter (fewer rows, wider Down tiles: fewer programs to interpret)
CASES += [
    case("split3_last_tile_partial_4rows", R=4, H=136, block_k=16, split_k=3, split=3),
    case("split2_in_scale_block_group32_4rows", R=4, block=(32, 32), I=64, H=96, block_k=16, down_block_k=16,
         split_k=2, split=2),
    case("gate_up_16_wide_3rows", R=3, I=64, gate_up_block_n=16),
    case("fp32x_bf16_4rows_bf16_out", R=4, compute="bf16", out="bf16", x_ties=True, default_out=True),
    case("residual_3rows_mask_3_tiles_wide_down", R=3, H=560, live="mask", out="bf16", x="bf16", residual=3,
         down_block_n=128),
    case("dup_32rows_k4_E6_mask_two_row_blocks_narrow", R=32, k=4, E=6, H=32, I=16, live="mask"),
    case("rect_blocks_32x16_4rows", R=4, block=(32, 16), H=80, I=48),
]
# The interpreter's set: each property above once (one row, k = 8, ownership with repeats, padding rows that choose
# experts of their own, no live rows, partial tiles and blocks, rectangular scale blocks, splits with a partial last
# tile or a boundary inside a scale block, several Gate/Up tiles, two row blocks at MAX_PAIRS, fp32 x on the bf16
# grid, the fused input norm, moe()'s defaults); the five-launch oracle runs on the cases in ORACLE (the split plan's
# clamping is host arithmetic: test_split_plan_clamps). The GPU runs every case with the oracle.
INTERPRETED = ("1row", "1row_k8", "8rows_random", "ties_equal_weights_same_experts", "split2_no_live_rows",
               "partial_tiles_1row_count", "mini_model_default_tiles", "dup_32rows_k4_E6_mask_two_row_blocks_narrow",
               "split3_padding_mask_poisoned", "split3_last_tile_partial_4rows", "split2_in_scale_block_group32_4rows",
               "gate_up_16_wide_3rows", "fp32x_bf16_4rows_bf16_out", "residual_3rows_mask_3_tiles_wide_down",
               "rect_blocks_32x16_4rows")
ORACLE = ("1row", "8rows_random", "partial_tiles_1row_count", "mini_model_default_tiles",
          "split3_last_tile_partial_4rows", "fp32x_bf16_4rows_bf16_out")
INTERPRETED_CASES = [dict(c, oracle=c["name"] in ORACLE) for c in CASES if c["name"] in INTERPRETED]
# Negative controls (run by the worker, not by test_interpreted): the finalize drops the last split (the oracle's
# comparison must catch it too); every live pair's program works, repeated experts included.
NEG_CASE = case("neg_drop_last_split", R=4, H=128, block_k=16, split_k=3, split=3, control="drop_last_split",
                oracle=True)
NEG_DEDUP_CASE = case("neg_no_dedup", R=4, pattern="shared", control="no_dedup")

FULL = dict(k=8, E=256, H=6144, I=256, block=(128, 128), x="bf16", block_k=None, down_block_n=None,
            down_block_k=None)  # one TP8 rank at full size (I/TP = 256); None: moe()'s default tiles
GPU_CASES = [  # full size and the mini model (E=16, top-4, H=256, I=128, block 16)
    # min_split: the default split must take the split path at full size (8-16 on an H200)
    *[case(f"gpu_full_{r}rows", R=r, out="bf16", min_split=2, **FULL) for r in (1, 2, 4, 6, 8)],
    case("gpu_full_8rows_same", R=8, pattern="same", min_split=2, **FULL),
    case("gpu_full_8rows_poison", R=8, pattern="poison", live="count", min_split=2, **FULL),
    case("gpu_full_8rows_mask_fp32", R=8, live="mask", min_split=2, **dict(FULL, x="fp32")),
    case("gpu_full_8rows_split1", R=8, split_k=1, split=1, **FULL),
    case("gpu_full_8rows_split48", R=8, split_k=48, split=48, **FULL),  # one K tile (128 wide, the default) per split
    case("gpu_full_6rows_other_tiles", R=6, split_k=5, split=5,  # the pre-split tiles: 128-wide K, Down 32 x 64
         **dict(FULL, block_k=128, down_block_n=32, down_block_k=64)),
    # the engine's call: fp32 routing input, bf16 compute and output (bit-identical to bf16 x)
    *[case(f"gpu_full_{r}rows_fp32x_bf16", R=r, out="bf16", compute="bf16", x_ties=True, min_split=2,
           **dict(FULL, x="fp32")) for r in (1, 6, 8)],
    case("gpu_full_8rows_fp32x_bf16_poison", R=8, pattern="poison", live="count", out="bf16", compute="bf16",
         x_ties=True, min_split=2, **dict(FULL, x="fp32")),
    case("gpu_full_16rows_max_pairs", R=16, out="bf16", min_split=2, **FULL),  # P = R * k = MAX_PAIRS
    *[case(f"gpu_full_{r}rows_fp32x_bf16_pointer_loads", R=r, out="bf16", compute="bf16", x_ties=True, min_split=2,
           launch=dict(tma=False), **dict(FULL, x="fp32")) for r in (1, 6)],
    case("gpu_full_8rows_poison_pointer_loads", R=8, pattern="poison", live="count", min_split=2,
         launch=dict(tma=False), **FULL),
    *[case(f"gpu_mini_{r}rows", R=r, k=4, E=16, H=256, I=128, block=(16, 16), x="bf16") for r in (1, 8)],
    case("gpu_full_6rows_fp32x_bf16_residual", R=6, live="count", out="bf16", compute="bf16", x_ties=True, min_split=2,
         residual=24, **dict(FULL, x="fp32")),
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
    if c.get("x_ties"):  # fp32: columns cycle through bf16 values, exact midpoints, and the fp32 values beside them
        x = with_bf16_ties(x)
    live_arg = live if c["live"] in ("all", "mask") else torch.tensor(int(live.sum()), dtype=torch.int32)
    t = dict(x=x, experts=experts, weights=weights.float(), live=live_arg, gate=gate, gate_scale=gate_scale,
             up=up, up_scale=up_scale, down=down, down_scale=down_scale)
    return {name: v.to(device) for name, v in t.items()}, live


def with_bf16_ties(x: torch.Tensor) -> torch.Tensor:
    """fp32 x whose columns cycle through: x on the bf16 grid, the exact midpoint between it and the next
    bf16 value away from zero (a tie), and that midpoint's fp32 neighbours above and below."""
    b = x.to(torch.bfloat16)
    nxt = (b.view(torch.int16) + 1).view(torch.bfloat16)  # sign-magnitude: one step away from zero
    mid = (b.float() + nxt.float()) / 2  # exact in fp32
    kind = torch.arange(x.shape[-1]) % 4
    return torch.where(kind == 0, b.float(), torch.where(kind == 1, mid, torch.where(
        kind == 2, mid.nextafter(torch.tensor(float("inf"))), mid.nextafter(torch.tensor(float("-inf"))))))


ARGS = ("x", "experts", "weights", "live", "gate", "gate_scale", "up", "up_scale", "down", "down_scale")


def tiles(c: dict) -> dict:
    """The case's tiles, None meaning mk.moe's defaults (passed explicitly, so the sorted oracle runs the very
    tiles, and summation order, of the kernel under test: its own defaults predate the tuned ones)."""
    default = inspect.signature(mk.moe).parameters
    out = {n: default[n].default if c.get(n) is None else c[n]
           for n in ("block_k", "down_block_n", "down_block_k", "gate_up_block_n")}
    out["down_block_k"] = mk.down_tile(False, out["down_block_k"])[0]  # the fp16-operand default these cases run
    return out


def run_kernel(c: dict, t: dict) -> tuple[torch.Tensor, dict]:
    """(output, probe) of the case through mk._moe_probed (the negative controls' defects as the case asks)."""
    out = torch.full((c["R"], c["H"]), float("nan"), dtype=DTYPES[c["out"]], device=t["x"].device)
    compute = {"compute_dtype": DTYPES[c["compute"]]} if c["compute"] else {}
    extra = {}
    if c.get("residual"):  # the next norm's add and partial sums of squares (fused_input_norm), into NaN-filled outputs
        gen = torch.Generator().manual_seed(c["seed"] + 1)
        stream = (torch.randn(c["R"], c["H"], generator=gen) * 4).to(DTYPES[c["out"]]).to(t["x"].device)
        weight = (0.5 + torch.rand(c["H"], generator=gen)).to(DTYPES[c["out"]]).to(t["x"].device)
        extra["residual"] = (stream, weight, *(b.fill_(float("nan")) for b in mk.residual_buffers(stream)))
        if c.get("residual_break"):  # negative control: the kernel is given one weight entry doubled, the check not
            broken = weight.clone()
            broken[c["H"] // 2] *= 2
            extra["residual"] = (stream, broken, *extra["residual"][2:])
    broken = {} if c.get("control") is None else MOE_CONTROLS[c["control"]]
    with substituted(mk, broken):
        got, probe = mk._moe_probed(*(t[a] for a in ARGS), block=c["block"], group=c["block"][1],
                                    out_dtype=DTYPES[c["out"]], out=out, split_k=c["split_k"], **compute, **tiles(c),
                                    **c.get("launch", {}), **extra)
    assert got is out
    if extra:
        probe["residual"] = (extra["residual"][0], weight, *extra["residual"][2:])
    return got, probe


def expected_owners(experts: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[P] bool: pair p = r * k + j owns its expert iff row r is live and no earlier live pair chose it."""
    k = experts.shape[1]
    e, lp = experts.cpu().flatten().tolist(), live.cpu().repeat_interleave(k).tolist()
    return torch.tensor([lp[p] and not any(lp[q] and e[q] == e[p] for q in range(p)) for p in range(len(e))])


def run_case(c: dict, device: str) -> dict:
    t, live = build(c, device)
    R, k, H, group = c["R"], c["k"], c["H"], c["block"][1]
    got, probe = run_kernel(c, t)
    res = {"finite": bool(torch.isfinite(got).all()), "dtype": str(got.dtype).removeprefix("torch.")}
    res["pad_zero"] = bool((got[~live.to(device)] == 0).all())
    # What the kernel computes with: fp32 x with bf16 compute is x.to(torch.bfloat16) (round to nearest even).
    tr = dict(t, x=t["x"].to(DTYPES[c["compute"]])) if c["compute"] else t
    pairs = live.repeat_interleave(k).nonzero().flatten().to(device)  # live (row, slot) pairs

    if device != "cpu" or c.get("oracle"):  # the oracle's interpreted kernels cost as much as the kernel's
        ref_out, ref_act, ref_scale = sorted_moe(*(tr[a] for a in ARGS), block=c["block"], group=group,
                                                 out_dtype=DTYPES[c["out"]], split_k=c["split_k"], **tiles(c))
        res["bit_identical"] = bool(torch.equal(got, ref_out) and torch.equal(
            probe["act"][pairs].view(torch.uint8), ref_act[pairs].view(torch.uint8))
            and torch.equal(probe["act_scale"][pairs], ref_scale[pairs]))
    if c["compute"]:  # the kernel's own rounding vs torch's: the same as passing rounded x
        res["same_as_rounded_x"] = bool(torch.equal(got, run_kernel(dict(c, compute=None), tr)[0]))
        if c.get("default_out") and device != "cpu":  # the wrapper's default, not the kernels': on the GPU only
            res["default_out_dtype"] = str(mk.moe(*(t[a] for a in ARGS), block=c["block"], group=group,
                                                  compute_dtype=DTYPES[c["compute"]], split_k=c["split_k"],
                                                  **tiles(c)).dtype).removeprefix("torch.")
        res["x_off_grid"] = int((t["x"].to(torch.bfloat16).float() != t["x"]).sum())

    owners = expected_owners(t["experts"], live)
    programs = probe["programs"].cpu()
    res["owners_ok"] = [bool(torch.equal(programs[i] == 1, owners) and ((programs[i] == 0) | (programs[i] == 1)).all())
                        for i in range(2)]
    res["programs_ran"] = programs.clamp(min=0).sum(1).tolist()
    res["distinct_live_experts"] = len(set(t["experts"].cpu()[live].flatten().tolist()))
    res["repeated_live_pairs"] = int(len(pairs) - owners.sum())
    h = probe["hidden"][pairs]
    q_ref, s_ref = act_quant_ref(h, group)
    res["act_bit_exact"] = bool(torch.equal(probe["act"][pairs].view(torch.uint8), q_ref.view(torch.uint8))
                                and torch.equal(probe["act_scale"][pairs], s_ref))
    res["act_pairs"] = len(pairs)
    res["split"] = probe["split"]
    counts = probe["split_counts"].cpu()
    pad_pairs_cpu = (~live.cpu()).repeat_interleave(k)
    res["split_counts_live"] = sorted(set(counts[~pad_pairs_cpu].tolist()))  # splits summed per live pair
    res["split_counts_pad_zero"] = bool((counts[pad_pairs_cpu] == 0).all())

    if c.get("residual"):  # h bit for bit as rmsnorm_residual adds, and h * w; each tile's sum of squares of that h
        stream, weight, h_out, g_out, sumsq = probe["residual"]
        res["residual_h_exact"] = _residual_h_g_exact(probe, got)
        # the same check on a run whose kernel had one weight entry doubled must fail
        broken_out, broken = run_kernel(dict(c, residual_break=True), t)
        res["residual_control_caught"] = not _residual_h_g_exact(broken, broken_out)
        h_ref = (stream.float() + got.float()).to(stream.dtype)
        res["residual_changed"] = bool(not torch.equal(h_out, stream))
        sq = h_ref.double().square().split(mk.COMBINE_BLOCK, dim=1)
        sq_ref = torch.stack([part.sum(dim=1) for part in sq], dim=1)
        res["residual_sumsq_err"] = ((sumsq.double() - sq_ref).abs() / sq_ref.clamp(min=1e-30)).max().item()
        res["residual_tiles"] = sumsq.shape[1]
    res["down_rel_err"] = _down_from_act(c, tr, pairs, probe, got)
    ref_q = mk.moe_ref(*(tr[a] for a in ARGS), block=c["block"], group=group)
    ref_f = mk.moe_ref(*(tr[a] for a in ARGS), block=c["block"], group=group, quantize_act=False)
    h64 = _hidden64(c, tr, pairs)
    scale = max(ref_q.abs().max().item(), 1e-30)
    res["hidden_rel_err"] = 0.0
    if len(pairs):
        res["hidden_rel_err"] = ((h.double() - h64).abs().max() / h64.abs().max().clamp(min=1e-30)).item()
    res["rel_err"] = (got.double() - ref_q).abs().max().item() / scale
    bound = _e4m3_bound(c, tr, pairs, h64)
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
        poisoned = run_kernel(c, bad)[0]
        res["poison_finite_equal"] = bool(torch.isfinite(poisoned).all() and torch.equal(poisoned, got))
        res["poisoned_experts"] = len(only_pad)
        # No Gate/Up or Down program worked on them (each owner is a live pair, and a live pair's expert
        # is a live row's), and padding pairs' hidden rows (NaN-prefilled) were never written.
        owned = set(t["experts"].cpu().flatten()[programs[0] == 1].tolist()) | set(
            t["experts"].cpu().flatten()[programs[1] == 1].tolist())
        pad_pairs = (~live).repeat_interleave(k).nonzero().flatten().to(device)
        res["pad_never_computed"] = bool(not owned & set(only_pad) and probe["hidden"][pad_pairs].isnan().all())
    return res


def _residual_h_g_exact(probe: dict, got: torch.Tensor) -> bool:
    """Whether the combine's h = stream + out and g = h * w equal torch's bit for bit (each rounded to the stream's
    dtype), w being the weight the check was given."""
    stream, weight, h_out, g_out, _ = probe["residual"]
    h_ref = (stream.float() + got.float()).to(stream.dtype)
    return torch.equal(h_out, h_ref) and torch.equal(g_out, (h_ref.float() * weight.float()).to(stream.dtype))


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


def _down_from_act(c, t, pairs, probe, got) -> float:
    """max |kernel - sum_j w_j Down_e(kernel's dequantized activations)| / max |that| (float64)."""
    from iquest.reference.fp8 import dequantize

    group = c["block"][1]
    y = torch.zeros(c["R"], c["H"], dtype=torch.float64, device=got.device)
    for p in pairs.tolist():
        r, j = divmod(p, c["k"])
        e = int(t["experts"][r, j])
        a = probe["act"][p].double().unflatten(-1, (-1, group)) * probe["act_scale"][p].double()[:, None]
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
    _check_owners(c, r)
    if "split" in c:
        assert r["split"] == c["split"], f"split {r['split']}, expected {c['split']}"
    assert r["split"] >= c.get("min_split", 1), f"split {r['split']} < {c.get('min_split')}: not the split path"
    assert r["split_counts_live"] in ([], [r["split"]]), f"splits summed per live pair: {r['split_counts_live']}"
    assert r["split_counts_pad_zero"], "the finalize touched a padding pair"


def _check_values(c: dict, r: dict) -> None:
    assert r["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[c["out"]]
    if c.get("residual"):
        assert r["residual_h_exact"], "the combine's h (stream + out) or g (h * w), each rounded, differ from torch's"
        assert r["residual_control_caught"], "a doubled norm weight went unnoticed: the h/g check is blind"
        assert r["residual_changed"], "h equals the stream: the add is not exercised"
        assert r["residual_sumsq_err"] <= 1e-5, f"sums of squares off by {r['residual_sumsq_err']:.1e} (relative)"
        assert r["residual_tiles"] == c["residual"], f"{r['residual_tiles']} sums a row, not {c['residual']}"
    assert r["finite"], "kernel left NaN in the output"
    assert r["pad_zero"], "padding rows must be written as 0"
    assert r.get("bit_identical", True), "output, activations or scales differ from the five-launch form (sorted_moe)"
    if c["compute"]:
        assert r["same_as_rounded_x"], "fp32 x with bf16 compute differs from passing x.to(torch.bfloat16)"
        if c.get("default_out") and "default_out_dtype" in r:
            assert r["default_out_dtype"] == "bfloat16", f"default out_dtype {r['default_out_dtype']}, not compute's"
        assert r["x_off_grid"] > 0, "the case's x is already on the bf16 grid: the rounding is not exercised"
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


def _check_owners(c: dict, r: dict) -> None:
    assert r["owners_ok"] == [True, True], (
        f"Gate/Up, Down programs that worked != first live pair per distinct expert: {r['owners_ok']}, "
        f"ran {r['programs_ran']} for {r['distinct_live_experts']} experts")
    assert r["programs_ran"] == [r["distinct_live_experts"]] * 2


# ---- the five-launch form moe.py replaced: the bit-identity reference -----------------------------------
# sorted_groups sorts the live pairs by expert into segments; Gate/Up and Down ran one program per segment on
# its rows packed into the tile in pair order; the finalize walked the sorted order. Kernels as they were
# (the finalize's instrumentation off), the combine included (_sorted_combine_kernel).
@triton.jit
def _sorted_gate_up_kernel(
    x_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, order_ptr, seg_e_ptr, seg_start_ptr, seg_len_ptr, part_ptr,
    H, I, P, K_TOP, stride_x, s_rows, s_cols, k_per_split,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32: tl.constexpr, PREC: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(seg_e_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)  # 0 for unused segments: nothing below runs
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N divides I: always in range
    k_start = split * k_per_split  # a multiple of BLOCK_K, which divides B1
    k_end = tl.minimum(k_start + k_per_split, H)
    g_rows = g_ptr + e * I * H + n[:, None] * H
    u_rows = u_ptr + e * I * H + n[:, None] * H
    gs_row = gs_ptr + e * s_rows * s_cols + (n // B0) * s_cols
    us_row = us_ptr + e * s_rows * s_cols + (n // B0) * s_cols

    for m0 in range(0, length, BLOCK_M):  # one pass when the segment fits BLOCK_M rows
        mi = m0 + tl.arange(0, BLOCK_M)
        m_ok = mi < length
        pair = tl.load(order_ptr + start + mi, mask=m_ok, other=0)
        x_rows = x_ptr + (pair // K_TOP)[:, None] * stride_x
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < H
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            wu = tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            sg = tl.load(gs_row + k0 // B1)  # the tile lies in one K block
            su = tl.load(us_row + k0 // B1)
            if F32:
                x = x.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            else:
                wg = wg.to(x.dtype)  # exact
                wu = wu.to(x.dtype)
            acc_g += tl.dot(x, tl.trans(wg), input_precision=PREC) * sg[None, :]
            acc_u += tl.dot(x, tl.trans(wu), input_precision=PREC) * su[None, :]
        dst = part_ptr + ((split * P + pair) * 2)[:, None] * I + n[None, :]
        tl.store(dst, acc_g, mask=m_ok[:, None])
        tl.store(dst + I, acc_u, mask=m_ok[:, None])


@triton.jit
def _sorted_finalize_kernel(
    part_ptr, order_ptr, act_ptr, act_s_ptr, h_ptr, count_ptr, P, I,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, STORE_H: tl.constexpr,
):
    q = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tile = tl.program_id(1)
    pair = tl.load(order_ptr + q, mask=q < P, other=-1)  # -1 past the live pairs: padding pairs stay unwritten
    ok = pair >= 0
    n = tile * GROUP + tl.arange(0, GROUP)
    src = part_ptr + (pair * 2)[:, None] * I + n[None, :]
    g = tl.zeros([ROWS, GROUP], tl.float32)
    u = tl.zeros([ROWS, GROUP], tl.float32)
    summed = 0  # splits added (compile-time): probe's split_counts, so a test sees which sum ran
    # Unrolled, so every split's loads issue at once; the adds keep the order s = 0, 1, ... (the
    # sum must not depend on scheduling).
    for s in tl.static_range(SPLIT):
        g += tl.load(src + s * P * 2 * I, mask=ok[:, None], other=0.0)
        u += tl.load(src + s * P * 2 * I + I, mask=ok[:, None], other=0.0)
        summed += 1
    h = g * tl.sigmoid(g) * u
    q8, sc = _act_quant_tile(h)
    tl.store(act_ptr + pair[:, None] * I + n[None, :], q8, mask=ok[:, None])
    tl.store(act_s_ptr + pair * (I // GROUP) + tile, sc, mask=ok)
    if STORE_H:
        tl.store(h_ptr + pair[:, None] * I + n[None, :], h, mask=ok[:, None])
        tl.store(count_ptr + pair, summed + 0 * pair, mask=ok & (tile == 0))


@triton.jit
def _sorted_down_kernel(
    act_ptr, act_s_ptr, w_ptr, ws_ptr, order_ptr, seg_e_ptr, seg_start_ptr, seg_len_ptr, y_ptr,
    H, I, s_rows, s_cols,
    B0: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32: tl.constexpr,
):
    seg = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    e = tl.load(seg_e_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)  # 0 for unused segments: nothing below runs
    w_rows = w_ptr + e * H * I + n[:, None] * I
    ws_row = ws_ptr + e * s_rows * s_cols + (n // B0) * s_cols

    for m0 in range(0, length, BLOCK_M):
        mi = m0 + tl.arange(0, BLOCK_M)
        m_ok = mi < length
        pair = tl.load(order_ptr + start + mi, mask=m_ok, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):  # BLOCK_K divides GROUP == B1: one group and scale block per tile
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + pair[:, None] * I + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            sa = tl.load(act_s_ptr + pair * (I // GROUP) + k0 // GROUP, mask=m_ok, other=0.0)
            sw = tl.load(ws_row + k0 // GROUP, mask=n_ok, other=0.0)
            if F32:
                part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:  # E4M3 -> bf16 is exact and so are the products; the dot accumulates in fp32
                part = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            acc += part * sa[:, None] * sw[None, :]  # the act scale differs per row (pair)
        tl.store(y_ptr + pair[:, None] * H + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def sorted_groups(experts: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The five-launch form's segments, with torch.sort (stable): (order, seg_expert, seg_start, seg_len), each
    [P] int32 on experts' device: live pairs sorted by (expert, pair), -1 past them; one segment per distinct
    live expert, ascending, -1 / 0 / 0 past them."""
    R, k = experts.shape
    P = R * k
    mask = live if live.dtype == torch.bool else torch.arange(R, device=experts.device) < live.reshape(())
    keep = mask.repeat_interleave(k)
    sorted_key, idx = torch.sort(torch.where(keep, experts.reshape(-1), 2**30), stable=True)
    n = int(keep.sum())
    order = torch.full((P,), -1, dtype=torch.int32)
    order[:n] = idx[:n].int().cpu()
    uniq, counts = torch.unique_consecutive(sorted_key[:n].cpu(), return_counts=True)
    d = len(uniq)
    seg_expert, seg_start, seg_len = torch.full((P,), -1, dtype=torch.int32), torch.zeros(P, dtype=torch.int32), \
        torch.zeros(P, dtype=torch.int32)
    seg_expert[:d], seg_len[:d] = uniq.int(), counts.int()
    seg_start[:d] = (torch.cumsum(counts, 0) - counts).int()
    return tuple(t.to(experts.device) for t in (order, seg_expert, seg_start, seg_len))


def sorted_moe(x, experts, weights, live, gate, gate_scale, up, up_scale, down, down_scale, block, group,
               out_dtype, block_k, down_block_n, down_block_k, gate_up_block_n, split_k=None):
    """(out, act, act_scale) of the five-launch form on the same tiles and split as `mk.moe`."""
    R, H = x.shape
    k = experts.shape[1]
    E, I = gate.shape[0], gate.shape[1]
    experts = experts.contiguous()
    count = live.dtype != torch.bool
    groups = sorted_groups(experts, live)
    P = R * k
    slots = min(P, E)
    bn = mk._pow2_divisor(I, gate_up_block_n)
    bk = mk._pow2_divisor(block[1], block_k)
    split, k_per_split = mk.plan_split(P, E, k, H, I, bn, bk, split_k, mk._sm_count(x.device))
    dev = x.device
    part = torch.empty((split, P, 2, I), dtype=torch.float32, device=dev)
    act = torch.empty((P, I), dtype=torch.float8_e4m3fn, device=dev)
    act_scale = torch.empty((P, I // group), dtype=torch.float32, device=dev)
    y = torch.empty((P, H), dtype=torch.float32, device=dev)
    out = torch.empty((R, H), dtype=out_dtype, device=dev)
    f32 = mk.INTERPRETED or x.dtype == torch.float32
    _sorted_gate_up_kernel[(slots, I // bn, split)](
        x, gate, gate_scale, up, up_scale, *groups, part, H, I, P, k, x.stride(0),
        gate_scale.shape[1], gate_scale.shape[2], k_per_split,
        B0=block[0], B1=block[1], BLOCK_M=mk.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
        F32=f32, PREC="ieee" if f32 else "tf32", num_warps=mk.GATE_UP_WARPS)
    _sorted_finalize_kernel[(triton.cdiv(P, mk.FINALIZE_ROWS), I // group)](
        part, groups[0], act.view(torch.uint8), act_scale, act_scale, act_scale, P, I,
        SPLIT=split, GROUP=group, ROWS=mk.FINALIZE_ROWS, STORE_H=False, num_warps=4)
    _sorted_down_kernel[(slots, triton.cdiv(H, down_block_n))](
        act, act_scale, down, down_scale, *groups, y, H, I, down_scale.shape[1], down_scale.shape[2],
        B0=block[0], GROUP=group, BLOCK_M=mk.BLOCK_M, BLOCK_N=down_block_n,
        BLOCK_K=mk._pow2_divisor(group, down_block_k), F32=mk.INTERPRETED, num_warps=4)
    live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
    _sorted_combine_kernel[(R, triton.cdiv(H, mk.COMBINE_BLOCK))](
        y, weights, live_arg, out, R, H, out.stride(0), K_TOP=k, BLOCK=mk.COMBINE_BLOCK, LIVE_COUNT=count,
        num_warps=4)
    return out, act, act_scale


@triton.jit
def _sorted_combine_kernel(y_ptr, weights_ptr, live_ptr, out_ptr, R, H, stride_o, K_TOP: tl.constexpr,
                           BLOCK: tl.constexpr, LIVE_COUNT: tl.constexpr):
    """The combine as it was (one row a program), kept as the oracle's."""
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < H
    live = load_live(live_ptr, r + 0 * n, R, LIVE_COUNT)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K_TOP):
        w = tl.load(weights_ptr + r * K_TOP + j + 0 * n)
        acc += w * tl.load(y_ptr + (r * K_TOP + j) * H + n, mask=n_ok, other=0.0)
    acc = tl.where(live, acc, 0.0)
    tl.store(out_ptr + r * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


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
    __file__, INTERPRETED_CASES, _check,
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
    assert not r["bit_identical"], "the reference comparison must catch it"
    with pytest.raises(AssertionError, match="hidden rel err"):  # and the torch checks without the reference
        _check_values(c, dict(r, bit_identical=True))
    with pytest.raises(AssertionError):
        _check(c, r)


def test_interpreted_negative_control_no_dedup(interpreted):
    """The ownership check catches programs that do not exit for a repeated expert: with the dedup
    switched off it fails, on a run in which a program worked for every live pair (more than the
    distinct experts). The repeats store the owner's values again, so the values stay bit-identical."""
    c, r = NEG_DEDUP_CASE, interpreted[NEG_DEDUP_CASE["name"]]
    assert "error" not in r, r.get("error")
    assert r["repeated_live_pairs"] > 0 and r["act_pairs"] == r["distinct_live_experts"] + r["repeated_live_pairs"]
    assert r["programs_ran"] == [r["act_pairs"]] * 2, f"the broken branch did not run: {r['programs_ran']}"
    _check_values(c, r)  # the values cannot show it
    with pytest.raises(AssertionError, match="first live pair per distinct expert"):
        _check_owners(c, r)
    with pytest.raises(AssertionError):
        _check(c, r)


def test_interpreted_bf16_rounding(interpreted):
    """moe.py's fp32 -> bf16 rounding (Gate/Up's compute_dtype) is torch's, bit for bit, on ties,
    near-ties, subnormals, overflow, signed zeros, infinities and NaN; the interpreter's own cast is not
    (it truncates), which is why moe.py does not rely on it (and, interpreted, never casts x to bf16)."""
    r = interpreted["bf16_rounding"]
    assert "error" not in r, r.get("error")
    assert r["values"] > 1000 and r["ties"] > 100
    assert r["mismatches"] == 0, r
    assert r["plain_cast_mismatches"] > 0, "the interpreter's cast rounds correctly now: the note in moe.py is stale"


@triton.jit
def _bf16_probe_kernel(x_ptr, y_ptr, N, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 out: 0 = moe.py's rounding onto the bf16 grid, 1 = Triton's cast (round trip), 2 = both, as
    Gate/Up does on the GPU (grid, then an exact cast)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0)
    if MODE != 1:
        x = bf16_grid(x)
    if MODE != 0:
        x = x.to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + i, x, mask=i < N)


def bf16_rounding_inputs() -> tuple[torch.Tensor, int]:
    """(fp32 values, how many are exact bf16 midpoints): random bf16 values, the midpoints between them and
    the next bf16 value away from zero, those midpoints' fp32 neighbours, values over 60 decades, specials."""
    gen = torch.Generator().manual_seed(3)
    b = torch.randint(-32768, 32768, (4000,), generator=gen, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    b = b[torch.isfinite(b) & torch.isfinite((b.view(torch.int16) + 1).view(torch.bfloat16))]
    step = (b.view(torch.int16) + 1).view(torch.bfloat16).float()  # one bf16 step away from zero
    mid = (b.float() + step) / 2  # exact in fp32
    fmax = torch.finfo(torch.float32).max
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), fmax, -fmax,
                            # bf16 max, then the ties above it (they round to inf)
                            3.3895313892515355e38, 3.3961775292304485e38, -3.3961775292304485e38,
                            1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 9.2e-41])
    vals = torch.cat([b.float(), mid, mid.nextafter(torch.tensor(float("inf"))),
                      mid.nextafter(torch.tensor(float("-inf"))),
                      torch.randn(2000, generator=gen) * 10 ** (torch.rand(2000, generator=gen) * 60 - 30), special])
    return vals, len(mid)


def run_bf16_rounding(device: str) -> dict:
    x, ties = bf16_rounding_inputs()
    x = x.to(device)
    want = x.to(torch.bfloat16)
    res = {"values": x.numel(), "ties": ties}
    want = want.float()  # exact
    for mode, name in enumerate(("mismatches", "plain_cast_mismatches", "grid_then_cast_mismatches")):
        y = torch.empty_like(x)
        _bf16_probe_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), MODE=mode, BLOCK=256)
        same = (y.view(torch.int32) == want.view(torch.int32)) | (y.isnan() & want.isnan())
        res[name] = int((~same).sum())
    return res


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
    (dict(gate_up_block_n=24), "gate_up_block_n must be"),
    (dict(gate_up_warps=3), "gate_up_warps must be"),
    (dict(down_stages=0), "down_stages must be"),
    (dict(compute_dtype=torch.float16), "compute_dtype"),  # fp32 x: bf16 or fp32 only
    (dict(x=torch.randn(2, 64).to(torch.bfloat16), compute_dtype=torch.float32), "compute_dtype"),
    (dict(experts=torch.zeros(2, 4)), "experts must be"),
    (dict(experts=torch.zeros(2, 65, dtype=torch.long), weights=torch.ones(2, 65)), "at most 128"),
])
def test_rejects_bad_inputs(over, message):
    t = _args(**{k: v for k, v in over.items() if k in ARGS})
    kw = {k: v for k, v in over.items() if k not in ARGS}
    with pytest.raises(ValueError, match=message):
        mk.moe(*(t[a] for a in ARGS), block=(16, 16), **{"group": 16, **kw})


@pytest.mark.parametrize("H, split_k, split, per", [(64, 100, 4, 16), (128, 5, 4, 32), (128, 3, 3, 48),
                                                     (136, 3, 3, 48)])
def test_split_plan_clamps(H, split_k, split, per):
    """Gate/Up's grid for a requested split (K tiles of 16, as the split cases): at most one split a K tile, whole K
    tiles a split, no empty split (5 becomes 4 at 8 tiles), the last one shorter where H is not whole splits."""
    grid, bn, bk, k_per_split = mk.gate_up_grid(32, 16, 4, H, 32, (16, 16), 16, mk.GATE_UP_BLOCK_N, split_k, 132)
    assert (grid[2], bk, k_per_split) == (split, 16, per) and (split - 1) * per < H <= split * per


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
@pytest.mark.parametrize("mode", ["plain", "early_down"])
@pytest.mark.parametrize("R, x", [(1, "bf16"), (6, "bf16"), (8, "bf16"), (6, "fp32")])
def test_gpu_graph_replay_bit_identical(R, x, mode):
    """Full size, default split: repeated eager runs and CUDA graph replays (new x and routing copied
    into the captured inputs, a different live count) are bit-identical to eager (early_down, launched with PDL: Down
    reads the routing before its wait, so new routing in every replay would show a stale read). fp32 x runs with bf16
    compute, as the engine calls it."""
    c = case("g", R=R, k=8, E=256, H=6144, I=256, block=(128, 128), x=x, out="fp32", live="count")
    t, _ = build(c, "cuda")
    other, _ = build(dict(c, seed=1), "cuda")  # new inputs and routing, the same expert weights
    t2 = dict(t, x=other["x"], experts=other["experts"], weights=other["weights"],
              live=torch.tensor(R, dtype=torch.int32, device="cuda"))
    early = dict(early_down=True, pdl=True) if mode == "early_down" else {}

    def run(src):
        return mk.moe(*(src[a] for a in ARGS), block=(128, 128), group=128, out_dtype=torch.float32,
                      compute_dtype=torch.bfloat16, **early)

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


# Down with E4M3 operands in the tensor cores (moe(fp8_down=True)): the products are exact, the MMA accumulates a K
# tile's 64 of them in its own precision before the fp32 scale-and-add. Measured against Down applied in float64 to
# the kernel's own activations (down_rel_err, which isolates Down): FP8_DOWN_TOL, with fp32 output so that no output
# rounding hides it. The default fp16 path stays within DOWN_TOL["fp32"] on the same inputs.
FP8_DOWN_TOL = 1e-3


def fp8_down_errors(R: int, x: str, perturb: float = 0.0, **shape) -> dict:
    """{"fp8": down_rel_err with fp8_down, "f16": the default's, "*_taken", "bit_equal"}, at one full-size TP8 rank
    unless `shape` says otherwise. `perturb` scales one live expert's Down block scales by (1 + perturb) in the fp8
    run only (negative control)."""
    c = case("fp8_down", **{**dict(R=R, k=8, E=256, H=6144, I=256, block=(128, 128), x=x, out="fp32",
                                   compute="bf16" if x == "fp32" else None), **shape})
    t, live = build(c, "cuda")
    tr = dict(t, x=t["x"].to(torch.bfloat16)) if c["compute"] else t
    pairs = live.repeat_interleave(c["k"]).nonzero().flatten().cuda()
    res = {}
    outs = {}
    for name, fp8 in (("f16", False), ("fp8", True)):
        src = dict(t)
        if fp8 and perturb:
            src["down_scale"] = t["down_scale"].clone()
            src["down_scale"][int(t["experts"][0, 0])] *= 1 + perturb
        out = torch.full((R, c["H"]), float("nan"), dtype=torch.float32, device="cuda")
        compute = {"compute_dtype": torch.bfloat16} if c["compute"] else {}
        _, probe = mk._moe_probed(*(src[a] for a in ARGS), block=c["block"], group=c["block"][1],
                                  out_dtype=torch.float32, out=out, fp8_down=fp8, **compute)
        res[name] = _down_from_act(c, tr, pairs, probe, out)
        res[name + "_taken"] = probe["fp8_down"]
        outs[name] = out
    res["bit_equal"] = bool(torch.equal(outs["f16"], outs["fp8"]))
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("R, x, shape", [(1, "bf16", {}), (6, "fp32", {}), (8, "bf16", {}),
                                         # the mini model's 16-wide blocks: 16-deep tiles padded to the wgmma's 32
                                         (6, "fp32", dict(k=4, E=16, H=256, I=128, block=(16, 16)))])
def test_gpu_fp8_down_within_tolerance(R, x, shape):
    r = fp8_down_errors(R, x, **shape)
    print(f"R={R} x={x}: Down rel err fp8 {r['fp8']:.2e}, fp16 operands {r['f16']:.2e}")
    assert r["fp8_taken"] and not r["f16_taken"]
    assert r["f16"] <= DOWN_TOL["fp32"], r
    assert r["fp8"] <= FP8_DOWN_TOL, r
    assert not r["bit_equal"], "fp8_down gave the fp16 path's bits: its branch did not run"


@pytest.mark.gpu
def test_gpu_fp8_down_negative_control():
    """One expert's Down scales off by 1% in the fp8 run must fail the tolerance the test above applies."""
    r = fp8_down_errors(6, "fp32", perturb=0.01)
    print(f"perturbed: Down rel err fp8 {r['fp8']:.2e}")
    assert r["fp8_taken"] and r["fp8"] > FP8_DOWN_TOL, r


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 6])
def test_gpu_fp8_down_graph_replay_bit_identical(R):
    """fp8_down is deterministic: eager runs and a graph replay give the same bits."""
    c = case("g8", R=R, k=8, E=256, H=6144, I=256, block=(128, 128), x="fp32", out="bf16", live="count")
    t, _ = build(c, "cuda")

    def run(src):
        return mk.moe(*(src[a] for a in ARGS), block=(128, 128), group=128, out_dtype=torch.bfloat16,
                      compute_dtype=torch.bfloat16, fp8_down=True)

    eager = [run(t).clone() for _ in range(2)]
    static = {a: t[a].clone() for a in ARGS}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager[0], eager[1]) and torch.equal(out, eager[0])


@pytest.mark.gpu
def test_gpu_bf16_rounding():
    """The kernel's rounding and the GPU's own cast both equal torch's .to(torch.bfloat16)."""
    r = run_bf16_rounding("cuda")
    assert r["mismatches"] == 0 and r["plain_cast_mismatches"] == 0 and r["grid_then_cast_mismatches"] == 0, r


@pytest.mark.gpu
def test_gpu_act_quant_bit_exact():
    for group, v in run_act_quant("cuda").items():
        assert v["q"] and v["s"], f"{group}: {v}"


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    jobs = [(c["name"], lambda c=c: run_case(c, "cpu")) for c in INTERPRETED_CASES + [NEG_CASE, NEG_DEDUP_CASE]]
    worker_main(jobs + [("act_quant", lambda: run_act_quant("cpu")),
                        ("bf16_rounding", lambda: run_bf16_rounding("cpu"))])

"""MoE routing for a few rows: `route_logits_ref(x @ router_w.T, top_k, norm_topk_prob, scaling)` (softmax over all
experts, top-k with ties to the lower index, optionally renormalized, scaled).

Not on the product path until re-based to docs/model.md: written for the retired, guessed architecture (a bf16 router
of E = 256 x H = 6144), it is no longer dispatched by fast/triton_ops.py, and the published model's routing (an fp32
router, renormalized top-k, no scaling: this kernel with an fp32 router_w, norm_topk_prob and scaling 1.0) runs its
torch form. Its tests hold it to its own reference (`route_ref`, below); the figures in this docstring are the
retired sizes'.

x [R, H] fp32 (R = 1..8 at decode), router_w [E, H] bf16 as the retired checkpoint held it (E = 256, H = 6144 there:
3.1 MB, a weight stream; fp32 is taken too). Two launches, fixed grids, no host sync, no
atomics (graph-capturable, replays bit-identical to eager):

Launch 1, grid (cdiv(E, BLOCK_E), SPLIT, cdiv(R, 8)): router logits with the H axis split over the
second grid axis. Each program holds a [BLOCK_E, BLOCK_H] weight tile in registers (read once, widened to
fp32 there, exactly, and loaded 4 columns at a time as an fp32 tile is, so that the lanes sum the same
columns in the same order: a bf16-held router gives the bits of its values held in fp32) and uses it for
every row of its row block (all R <= 8 rows: one row block at decode; more rows take more row blocks,
each reading the weight again), reducing each row over H with fp32 FMAs in a fixed tree (IEEE fp32 like
torch's GEMM: no TF32, no tensor cores), then writes fp32 partial logits part [SPLIT, R, E]. Defaults:
one warp per program and a [4, 512] tile (4 KB of bf16), so the H reduction stays inside a warp (each
lane sums 16 columns of each of its 4 expert rows, then 5 shuffle steps; no shared memory, no barriers;
168 registers, no spills for sm_90a, bf16 or fp32 tile). SPLIT comes from the SM count
(`choose_split`: about PROGRAMS_PER_SM one-warp programs per SM): at E = 256, H = 6144 that is 12
splits of one 512-column tile, 768 programs, all resident at once, so the whole 3.1 MB is in flight
together (a weight stream this short needs most of its bytes in flight to run at bandwidth).

Launch 2, grid (R,): one program per row sums the SPLIT partials in a fixed order (chunks of splits
in index order, each chunk by one fixed reduction tree), then softmax, top-k by k rounds of argmax
(equal scores go to the lower expert index; the chosen one is masked), gather, normalize, scale. A round
is one int64 max over keys score_bits << 32 | (E_PAD - 1 - index): scores are >= 0, so their bits order
as the values do, and the key's high half is the score itself (`packed_topk=False`: the same choice by
two block-wide reductions per round, a max and then the min index among equals; the same bits).
Selection is on the kernel's own fp32 scores, as the reference sorts torch's fp32 softmax scores:
bit-equal logits give equal scores, and so does any pair that rounds to one score.

Softmax follows torch's CUDA kernel: p = exp(l - max), scores = p / sum(p). On the GPU the exp is
libdevice's expf (CUDA's expf, which torch's `std::exp` on fp32 calls, rather than Triton's
ex2.approx-based tl.exp; Triton builds libdevice in flush-to-zero mode, as its PTX shows, so results
below 2^-126, l - max < -87, become 0) and
the divisions are IEEE round-to-nearest (tl.div_rn, not Triton's default approximate fp32 division).
The sum's order differs from torch's, so scores agree to a few ulps, not bit for bit. Under
TRITON_INTERPRET=1 (no libdevice) the exp is NumPy's.

Traffic at R = 8, E = 256, H = 6144 (defaults): 3.15 MB of bf16 router weight read once (6.29 MB if
held in fp32); x (197 KB) read by every expert tile of its split, 12.6 MB of L2 hits in all; 98 KB of
partials written and read back; 8 KB of scores, 0.8 KB of weights and experts written.

Any E >= 1 works (the row program pads E to a power of two with masked lanes); 1 <= top_k <= E.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from .device import sm_count as _sm_count
from .launch import launch_options, wait_for_inputs

INTERPRETED = bool(triton.knobs.runtime.interpret)
MAX_ROWS = 8  # rows per launch-1 program (decode blocks have 1..8); more rows take more row blocks
MAX_EXPERTS = 8192  # the row program holds a row's E logits in registers
PROGRAMS_PER_SM = 8  # launch-1 programs wanted per SM (one-warp programs by default)
PART_CHUNK = 8192  # launch 2 loads at most this many partial values (splits x padded E) at once


@triton.jit
def _rows_dot(acc, w, x_ptr, r0, R, stride_x, h, h_ok, rows, ROWS: tl.constexpr):
    """acc[:, i] += w @ x[r0 + i, h] for the block's rows, one weight tile [BLOCK_E, BLOCK_H] held for all."""
    w = w.to(tl.float32)  # bf16 -> fp32 is exact: the same products as an fp32-held weight
    for i in tl.static_range(ROWS):  # the weight tile stays in registers for every row
        x = tl.load(x_ptr + (r0 + i) * stride_x + h, mask=h_ok & (r0 + i < R), other=0.0)
        acc = tl.where(rows[None, :] == i, acc + tl.sum(w * x[None, :], axis=1)[:, None], acc)
    return acc


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, R, E, H, stride_x, h_per_split,
                          ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    rows = tl.arange(0, ROWS_PAD)
    h_start = pid_s * h_per_split
    h_end = tl.minimum(h_start + h_per_split, H)
    acc = tl.zeros([BLOCK_E, ROWS_PAD], tl.float32)  # acc[e, i]: row r0 + i
    cols = tl.arange(0, BLOCK_H)
    # The same columns, but known contiguous in runs of 4 only: Triton vectorizes the weight load by that, so a bf16
    # tile gets an fp32 tile's register layout (4 columns per load, not 8). The layout sets which columns each lane
    # sums and in what order, so bf16 then gives fp32's bits (checked on the GPU: tests' "twins" cases).
    w_cols = cols // 4 * 4 + cols % 4
    if PRELOAD:
        # The split is one tile: the constant weight tile is loaded into registers before the wait, so its HBM read
        # overlaps the previous kernel; then the loop's one iteration, unchanged.
        h = h_start + cols
        h_ok = h < h_end
        w = tl.load(w_ptr + e[:, None] * H + (h_start + w_cols)[None, :], mask=e_ok[:, None] & h_ok[None, :],
                    other=0.0)
        wait_for_inputs(PDL)
        acc = _rows_dot(acc, w, x_ptr, r0, R, stride_x, h, h_ok, rows, ROWS)
    else:
        wait_for_inputs(PDL)
        for h0 in range(h_start, h_end, BLOCK_H):
            h = h0 + cols
            h_ok = h < h_end
            w = tl.load(w_ptr + e[:, None] * H + (h0 + w_cols)[None, :], mask=e_ok[:, None] & h_ok[None, :],
                        other=0.0)
            acc = _rows_dot(acc, w, x_ptr, r0, R, stride_x, h, h_ok, rows, ROWS)
    r = r0 + rows
    tl.store(part_ptr + (pid_s * R + r[None, :]) * E + e[:, None], acc,
             mask=e_ok[:, None] & (rows[None, :] < ROWS) & (r[None, :] < R))


@triton.jit
def _tie_rank(idx, E_PAD: tl.constexpr):
    """Among equal scores the lower rank is chosen: an expert's rank is its index (the reference's rule). An
    involution, so it is its own inverse (the negative control's ranks the other way, tests/kernel_controls.py)."""
    return idx


@triton.jit
def _router_select_kernel(part_ptr, weights_ptr, experts_ptr, scores_ptr, logits_ptr, R, E, splits, scaling,
                          E_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                          K_PAD: tl.constexpr, NORM: tl.constexpr, WRITE_LOGITS: tl.constexpr,
                          ACCURATE_EXP: tl.constexpr, PACKED_TOPK: tl.constexpr = True,
                          PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    idx = tl.arange(0, E_PAD)
    ok = idx < E
    # Sum the partials: chunks of SPLIT_BLOCK splits in index order, each summed by one fixed tree.
    s_in = tl.arange(0, SPLIT_BLOCK)
    logits = tl.zeros([E_PAD], tl.float32)
    for s0 in range(0, splits, SPLIT_BLOCK):
        s = s0 + s_in
        part = tl.load(part_ptr + ((s[:, None] * R + row) * E + idx[None, :]),
                       mask=(s[:, None] < splits) & ok[None, :], other=0.0)
        logits += tl.sum(part, axis=0)
    if WRITE_LOGITS:
        tl.store(logits_ptr + row * E + idx, logits, mask=ok)

    # Softmax, as torch's CUDA kernel: exp(l - max) / sum.
    logits = tl.where(ok, logits, float("-inf"))
    z = logits - tl.max(logits, axis=0)
    if ACCURATE_EXP:
        p = libdevice.exp(z)
    else:
        p = tl.exp(z)
    p = tl.where(ok, p, 0.0)
    scores = tl.div_rn(p, tl.zeros([E_PAD], tl.float32) + tl.sum(p, axis=0))
    tl.store(scores_ptr + row * E + idx, scores, mask=ok)

    # Top-k: k rounds of argmax; equal scores go to the lower rank (`_tie_rank`); the chosen one is masked.
    slot = tl.arange(0, K_PAD)
    sel_e = tl.zeros([K_PAD], tl.int32)
    sel_v = tl.zeros([K_PAD], tl.float32)
    if PACKED_TOPK:
        # One int64 max per round instead of a max and then a min index among equals. Scores are >= +0 (never
        # -0 or NaN for finite logits), so their bit patterns order as the values do; the low half breaks ties
        # (E_PAD - 1 - rank: larger for the lower rank). Keys are unique, and -1 is below every live key.
        low = E_PAD - 1 - _tie_rank(idx, E_PAD)
        bits = scores.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(ok, (bits << 32) | low.to(tl.int64), -1)
        for j in range(TOP_K):
            best = tl.max(key, axis=0)
            pick = _tie_rank(E_PAD - 1 - (best & 0xFFFFFFFF).to(tl.int32), E_PAD)
            # the high half is the score's own bits: sel_v (and so the weights) bit-equal the unpacked form's
            sel_e = tl.where(slot == j, pick, sel_e)
            sel_v = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), sel_v)
            key = tl.where(key == best, -1, key)
    else:  # two reductions per round; kept for `iquest bench tune` to time against (the same bits)
        # Scores are >= 0, so -1 is below every live entry (padding lanes included).
        work = tl.where(ok, scores, -1.0)
        for j in range(TOP_K):
            best = tl.max(work, axis=0)
            pick = _tie_rank(tl.min(tl.where(work == best, _tie_rank(idx, E_PAD), E_PAD), axis=0), E_PAD)
            sel_e = tl.where(slot == j, pick, sel_e)
            sel_v = tl.where(slot == j, best, sel_v)
            work = tl.where(idx == pick, -1.0, work)

    weights = sel_v
    if NORM:
        weights = tl.div_rn(weights, tl.zeros([K_PAD], tl.float32) + tl.sum(sel_v, axis=0))
    weights = weights * scaling
    k_ok = slot < TOP_K
    tl.store(weights_ptr + row * TOP_K + slot, weights, mask=k_ok)
    tl.store(experts_ptr + row * TOP_K + slot, sel_e.to(tl.int64), mask=k_ok)


# ---- host wrapper ----------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"router: {message}")


def _pow2(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def choose_split(e: int, h: int, block_e: int, block_h: int, device: torch.device) -> int:
    """Splits along H so that E tiles x splits ~ PROGRAMS_PER_SM programs per SM (at most one split per
    H tile): the weight stream needs most of its 3.1 MB (bf16) in flight at once to run at bandwidth."""
    e_tiles, h_tiles = triton.cdiv(e, block_e), triton.cdiv(h, block_h)
    return max(1, min(h_tiles, triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), e_tiles)))


def _split_plan(h: int, split: int, block_h: int) -> tuple[int, int]:
    """(splits actually launched, H columns per split): whole BLOCK_H tiles per split, no empty split."""
    h_per_split = triton.cdiv(triton.cdiv(h, block_h), split) * block_h
    return triton.cdiv(h, h_per_split), h_per_split


def _select(part: torch.Tensor, splits: int, weights: torch.Tensor, experts: torch.Tensor, scores: torch.Tensor,
            logits: torch.Tensor | None, top_k: int, norm_topk_prob: bool, scaling: float, *,
            packed_topk: bool = True, num_warps: int = 4, pdl: bool = False) -> None:
    """Launch 2 on the first `splits` partials of part [S, R, E]; `logits` [R, E], if given, receives the summed
    logits the selection used (route() gives none). Tests wrap it for a negative control (one split fewer) and to read
    those logits."""
    _, R, E = part.shape
    e_pad = triton.next_power_of_2(E)
    split_block = max(1, min(triton.next_power_of_2(splits), PART_CHUNK // e_pad))
    _router_select_kernel[(R,)](
        part, weights, experts, scores, scores if logits is None else logits, R, E, splits, scaling,
        E_PAD=e_pad, SPLIT_BLOCK=split_block, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        NORM=bool(norm_topk_prob), WRITE_LOGITS=logits is not None, ACCURATE_EXP=not INTERPRETED,
        PACKED_TOPK=packed_topk, num_warps=num_warps, **launch_options(pdl, part.device))


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool, scaling: float, *,
          split: int | None = None, block_e: int = 4, block_h: int = 512, num_warps: int = 1, select_warps: int = 4,
          packed_topk: bool = True, pdl: bool = False, preload: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [R, k] fp32, experts [R, k] int64, scores [R, E] fp32) = reference `route(x @ router_w.T,
    top_k, norm_topk_prob, scaling)` for x [R, H] fp32 (unit stride along H) and router_w [E, H] bf16 (as the
    checkpoint holds it) or fp32, contiguous; a bf16 router gives exactly the outputs of its values held in fp32
    (the kernel widens them before its fp32 FMAs). `split`: H splits wanted (default `choose_split`; each split
    gets whole block_h tiles, so fewer may run). `block_e`, `block_h`, `num_warps`: launch 1's tile and warps;
    `select_warps`: launch 2's (its reductions' trees follow the warps, so other values may round differently:
    `iquest bench tune` compares each against the default). `packed_topk`: launch 2's top-k by one max of packed
    (score, index) keys per round (default), or by a max and a min-index reduction per round (False; the same
    bits, kept to time against). `pdl`: as fp8_linear's (kernels/launch.py); `preload`: where a split is one block_h
    tile (the default plan at E = 256, H = 6144), launch 1 loads it before the wait, as fp8_linear's `preload` (the
    same values, so the same bits)."""
    _check(isinstance(x, torch.Tensor) and isinstance(router_w, torch.Tensor), "x and router_w must be tensors")
    _check(x.dim() == 2 and router_w.dim() == 2, f"x {tuple(x.shape)} and router_w {tuple(router_w.shape)} must be 2-D")
    R, H = x.shape
    E, Hw = router_w.shape
    _check(Hw == H, f"x has H={H}, router_w has H={Hw}")
    _check(R >= 1 and H >= 1, f"rows {R} and hidden {H} must be >= 1")
    _check(1 <= E <= MAX_EXPERTS, f"experts {E} must be in 1..{MAX_EXPERTS}")
    _check(x.dtype == torch.float32, f"x {x.dtype} must be float32")
    _check(router_w.dtype in (torch.bfloat16, torch.float32),
           f"router_w {router_w.dtype} must be bfloat16 (as the checkpoint holds it) or float32")
    _check(x.device == router_w.device, f"devices differ: x {x.device}, router_w {router_w.device}")
    _check(x.stride(1) == 1 or H == 1, "x must have unit stride along H")
    _check(router_w.is_contiguous(), "router_w must be contiguous")
    _check(E * H < 2**31 and (R - 1) * x.stride(0) + H < 2**31,
           "x and router_w must span < 2**31 elements (int32 offsets)")
    _check(isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= E,
           f"top_k {top_k!r} must be an int in 1..{E} (the expert count)")
    _check(isinstance(norm_topk_prob, bool), f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    _check(isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and abs(float(scaling)) < float("inf"),
           f"scaling must be a finite float, got {scaling!r}")
    _check(_pow2(block_e) and _pow2(block_h) and block_h >= 16,
           f"block_e {block_e} and block_h {block_h} must be powers of two (block_h >= 16)")
    _check(_pow2(num_warps) and num_warps <= 16, f"num_warps {num_warps} must be a power of two <= 16")
    _check(_pow2(select_warps) and select_warps <= 16, f"select_warps {select_warps} must be a power of two <= 16")
    _check(isinstance(packed_topk, bool), f"packed_topk must be a bool, got {packed_topk!r}")
    if split is None:
        split = choose_split(E, H, block_e, block_h, x.device)
    _check(isinstance(split, int) and not isinstance(split, bool) and split >= 1,
           f"split must be an int >= 1, got {split!r}")
    splits, h_per_split = _split_plan(H, split, block_h)

    dev = x.device
    part = torch.empty((splits, R, E), dtype=torch.float32, device=dev)
    weights = torch.empty((R, top_k), dtype=torch.float32, device=dev)
    experts = torch.empty((R, top_k), dtype=torch.int64, device=dev)
    scores = torch.empty((R, E), dtype=torch.float32, device=dev)

    rows = min(R, MAX_ROWS)
    grid = (triton.cdiv(E, block_e), splits, triton.cdiv(R, rows))
    _router_logits_kernel[grid](x, router_w, part, R, E, H, x.stride(0), h_per_split, ROWS=rows,
                                ROWS_PAD=triton.next_power_of_2(rows), BLOCK_E=block_e, BLOCK_H=block_h,
                                num_warps=num_warps, PRELOAD=preload and h_per_split == block_h,
                                **launch_options(pdl, dev))
    _select(part, splits, weights, experts, scores, None, top_k, norm_topk_prob, float(scaling),
            packed_topk=packed_topk, num_warps=select_warps, pdl=pdl)
    return weights, experts, scores


# ---- reference -------------------------------------------------------------------------------------
def route_logits_ref(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing this kernel computes, in torch: (weights [R, k], experts [R, k] long, scores [R, E]). Softmax over
    all experts, the k largest scores (a stable sort: equal scores go to the lower expert index), their scores
    renormalized when `norm_topk_prob`, times `scaling`. With norm_topk_prob and scaling 1 it is docs/model.md's
    routing (reference.layers.route)."""
    scores = torch.softmax(router_logits, dim=-1)
    experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, experts, scores


def route_ref(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch sequence this replaces: `route_logits_ref(x @ router_w.float().T, ...)` (a bf16 router widened
    exactly)."""
    return route_logits_ref(x @ router_w.float().T, top_k, norm_topk_prob, scaling)

"""The MoE router for a decode block, docs/model.md ("Mixture of experts", "Numerics"): `route(b, router_w, top_k)` is
TorchOps.route_on, that is reference.layers.route(b.float() @ router_w.T, top_k): fp32 logits of the MoE input b [R, H]
(bf16, widened exactly; fp32 taken too) and the fp32 router [E, H] (replicated on every rank), softmax over all E
experts, the k largest scores (equal scores: the lower expert index), their scores renormalized over the k. Returns
(weights [R, k] fp32, experts [R, k] int64, scores [R, E] fp32).

Two launches, fixed grids, no host sync, no atomics (graph-capturable; a replay gives eager's bits):

1. grid (cdiv(E, block_e), splits): the logits, H split over the second axis so that the whole router (3.1 MB at
   E = 256, H = 3072) is in flight at once. A program holds one [block_e, block_h] router tile in registers for all R
   rows (the weight is read once), reduces each row over the tile's columns with fp32 FMAs in a fixed tree (IEEE
   fp32: no TF32, no tensor cores) and writes fp32 partials part [splits, R, E].
2. grid (R,): a row's program sums its partials in a fixed order (`_sum_splits`), then the softmax as torch's CUDA
   kernel computes it (exp(l - max) / sum; on the GPU libdevice's expf, CUDA's expf that torch calls, rather than
   Triton's approximate tl.exp, and round-to-nearest division), then k rounds of one int64 max over the keys
   score_bits << 32 | (E_PAD - 1 - rank). Scores are >= +0, so their bits order as the values do, and among equal
   scores the lower rank wins; an expert's rank is its index (`_tie_rank`). The weights are the chosen scores over
   their sum. The selection is `select_experts`, which kernels/route_tail.py's folded tail calls too. Given the
   layer's Gate and Up codes (`warm`), the row's program then asks L2 for its chosen experts' slabs, which Gate/Up,
   the next launch, streams (a hint: no value changes).

Agreement with TorchOps.route_on: both sum the same fp32 products in different orders (torch's matmul: cuBLAS or the
CPU's BLAS), so logits, scores and weights agree to rounding, not bit for bit. `device.logit_tolerance` states how
far the logits may be apart; an expert choice may differ only where two scores are that close (a near-tie). Exact ties
(equal logits, e.g. equal router rows) go to the lower index in both.

Decode blocks have 1..8 rows; a larger block (prefill) is refused (`fits`), and the engine runs the torch form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import libm
from .device import FLOATS as _FLOATS, is_pow2 as _pow2, sm_count as _sm_count
from .launch import launch_options, slab_ok, wait_for_inputs, warm_slabs

INTERPRETED = libm.INTERPRETED
MAX_ROWS = 8  # launch 1 holds every row of the block against its weight tile
MAX_EXPERTS = 8192  # launch 2 holds a row's E logits in registers
PART_CHUNK = 8192  # launch 2 loads at most this many partial values (splits x padded E) at once


@dataclass(frozen=True)
class RouterSettings:
    """Launch choices. Every one but preload may change the last bits (summation orders follow the tiles, the splits
    and the warps), always within `device.logit_tolerance`; preload gives the same bits (tests: the "twin" cases)."""

    # One warp on a [4, 512] fp32 tile keeps the H reduction inside the warp: no shared memory, no barrier
    # (docs/PERF.md, "The LM head, Philox and the router as kernels").
    block_e: int = 4
    block_h: int = 512
    num_warps: int = 1
    # H splits; None: `choose_split`, about programs_per_sm programs an SM, since a weight stream this short runs at
    # bandwidth only with most of its bytes in flight at once.
    split: int | None = None
    programs_per_sm: int = 8
    select_warps: int = 4
    # Where a split is one tile, launch 1 reads it before the PDL wait, overlapping the previous kernel
    # (docs/PERF.md, "Constant weights loaded into registers before the PDL wait").
    preload: bool = True
    # With `route(warm=...)`: one bulk L2 request a piece of this many bytes of each chosen expert's Gate and Up slabs
    # (the expert prefetch's size, kernels/expert_prefetch.py)
    warm_chunk_bytes: int = 32768


@triton.jit
def _rows_dot(acc, w, b_ptr, stride_b, h, h_ok, rows, ROWS: tl.constexpr):
    """acc[:, i] += w @ b[i, h] for every row i of the block, the weight tile [BLOCK_E, BLOCK_H] held for all."""
    for i in tl.static_range(ROWS):
        x = tl.load(b_ptr + i * stride_b + h, mask=h_ok, other=0.0).to(tl.float32)  # bf16 -> fp32 is exact
        acc = tl.where(rows[None, :] == i, acc + tl.sum(w * x[None, :], axis=1)[:, None], acc)
    return acc


@triton.jit
def _router_logits_kernel(b_ptr, w_ptr, part_ptr, E, H, stride_b, h_per_split,
                          ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    split_logits(b_ptr, w_ptr, part_ptr, E, H, stride_b, h_per_split, ROWS, ROWS_PAD, BLOCK_E, BLOCK_H, PDL, PRELOAD)


@triton.jit
def split_logits(b_ptr, w_ptr, part_ptr, E, H, stride_b, h_per_split, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr):
    """Launch 1's program (E tile, H split): its partial logits of every row, stored at part [split, row, expert].
    Also the expert prefetch's prediction (kernels/expert_prefetch.py)."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    rows = tl.arange(0, ROWS_PAD)
    h_start = pid_s * h_per_split
    h_end = tl.minimum(h_start + h_per_split, H)
    acc = tl.zeros([BLOCK_E, ROWS_PAD], tl.float32)  # acc[e, i]: row i
    cols = tl.arange(0, BLOCK_H)
    if PRELOAD:  # the split is one tile: the constant weight is read before the wait
        h = h_start + cols
        h_ok = h < h_end
        w = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        wait_for_inputs(PDL)
        acc = _rows_dot(acc, w, b_ptr, stride_b, h, h_ok, rows, ROWS)
    else:
        wait_for_inputs(PDL)
        for h0 in range(h_start, h_end, BLOCK_H):
            h = h0 + cols
            h_ok = h < h_end
            w = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            acc = _rows_dot(acc, w, b_ptr, stride_b, h, h_ok, rows, ROWS)
    tl.store(part_ptr + (pid_s * ROWS + rows[None, :]) * E + e[:, None], acc,
             mask=e_ok[:, None] & (rows[None, :] < ROWS))


@triton.jit
def _sum_splits(part_ptr, row, R, E, splits, E_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """A row's logits [E_PAD]: its partials summed in chunks of SPLIT_BLOCK splits in index order, each chunk by one
    fixed tree, so the order is fixed by the launch, not by timing."""
    idx = tl.arange(0, E_PAD)
    s_in = tl.arange(0, SPLIT_BLOCK)
    logits = tl.zeros([E_PAD], tl.float32)
    for s0 in range(0, splits, SPLIT_BLOCK):
        s = s0 + s_in
        part = tl.load(part_ptr + ((s[:, None] * R + row) * E + idx[None, :]),
                       mask=(s[:, None] < splits) & (idx < E)[None, :], other=0.0)
        logits += tl.sum(part, axis=0)
    return logits


@triton.jit
def _tie_rank(idx, E_PAD: tl.constexpr):
    """Among equal scores the lower rank is chosen, and an expert's rank is its index (docs/model.md: ties go to the
    lower expert index). An involution, used both ways in the key."""
    return idx


@triton.jit
def select_experts(logits, row, E, weights_ptr, experts_ptr, scores_ptr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
                   K_PAD: tl.constexpr, ACCURATE_EXP: tl.constexpr, RANK: tl.constexpr):
    """A row's routing from its fp32 logits [E_PAD] (past E ignored): the softmax, the top TOP_K and their
    renormalized weights, stored at `row`. The one definition of the selection, shared by `_router_select_kernel` and
    kernels/route_tail.py. RANK is `_tie_rank`, passed in by each kernel so a test's copy of a kernel can swap it."""
    idx = tl.arange(0, E_PAD)
    ok = idx < E
    logits = tl.where(ok, logits, float("-inf"))
    z = logits - tl.max(logits, axis=0)
    p = libm.exp(z, ACCURATE_EXP)  # libdevice's on the GPU; the interpreter has none: NumPy's
    p = tl.where(ok, p, 0.0)
    scores = tl.div_rn(p, tl.zeros([E_PAD], tl.float32) + tl.sum(p, axis=0))
    tl.store(scores_ptr + row * E + idx, scores, mask=ok)

    # Scores are >= +0 (never -0 or NaN for finite logits), so their bits order as the values do; the low half
    # (larger for the lower rank) makes every key unique, and -1 is below every live key.
    slot = tl.arange(0, K_PAD)
    sel_e = tl.zeros([K_PAD], tl.int32)
    sel_v = tl.zeros([K_PAD], tl.float32)
    low = E_PAD - 1 - RANK(idx, E_PAD)
    key = tl.where(ok, (scores.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low.to(tl.int64), -1)
    for j in range(TOP_K):
        best = tl.max(key, axis=0)
        sel_e = tl.where(slot == j, RANK(E_PAD - 1 - (best & 0xFFFFFFFF).to(tl.int32), E_PAD), sel_e)
        sel_v = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), sel_v)
        key = tl.where(key == best, -1, key)

    weights = tl.div_rn(sel_v, tl.zeros([K_PAD], tl.float32) + tl.sum(sel_v, axis=0))
    k_ok = slot < TOP_K
    tl.store(weights_ptr + row * TOP_K + slot, weights, mask=k_ok)
    tl.store(experts_ptr + row * TOP_K + slot, sel_e.to(tl.int64), mask=k_ok)


@triton.jit
def _router_select_kernel(part_ptr, weights_ptr, experts_ptr, scores_ptr, R, E, splits, gate_ptr, up_ptr,
                          stride_gate, stride_up, slab_bytes,
                          E_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                          ACCURATE_EXP: tl.constexpr, PDL: tl.constexpr = False, WARM: tl.constexpr = False,
                          CHUNK: tl.constexpr = 32768, CHUNKS_PAD: tl.constexpr = 1):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    logits = _sum_splits(part_ptr, row, R, E, splits, E_PAD, SPLIT_BLOCK)
    select_experts(logits, row, E, weights_ptr, experts_ptr, scores_ptr, E_PAD, TOP_K, K_PAD, ACCURATE_EXP,
                   _tie_rank)
    if WARM:  # the experts just chosen: their Gate and Up slabs asked of L2 before Gate/Up, the next launch, reads them
        tl.debug_barrier()  # the row's experts, stored by other threads of this program, read back
        slot = tl.arange(0, K_PAD)
        experts = tl.load(experts_ptr + row * TOP_K + slot, mask=slot < TOP_K, other=-1)
        warm_slabs(gate_ptr, experts, stride_gate, slab_bytes, CHUNK, CHUNKS_PAD)
        warm_slabs(up_ptr, experts, stride_up, slab_bytes, CHUNK, CHUNKS_PAD)


# ---- host wrapper ----------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"router: {message}")


def fits(R: int, E: int, H: int) -> bool:
    """Whether `route` takes a block of R rows with a router [E, H]; otherwise the engine runs the torch form."""
    return 1 <= R <= MAX_ROWS and 1 <= E <= MAX_EXPERTS and H >= 1 and E * H < 2**31 and R * H < 2**31


def choose_split(e: int, h: int, settings: RouterSettings, device: torch.device) -> int:
    """H splits so that E tiles x splits ~ programs_per_sm programs an SM (at most one split per H tile)."""
    e_tiles, h_tiles = triton.cdiv(e, settings.block_e), triton.cdiv(h, settings.block_h)
    return max(1, min(h_tiles, triton.cdiv(settings.programs_per_sm * _sm_count(device), e_tiles)))


def split_plan(h: int, split: int, block_h: int) -> tuple[int, int]:
    """(splits launched, H columns per split): whole block_h tiles per split, no empty split."""
    h_per_split = triton.cdiv(triton.cdiv(h, block_h), split) * block_h
    return triton.cdiv(h, h_per_split), h_per_split


def _check_settings(s: RouterSettings) -> None:
    _check(isinstance(s, RouterSettings), f"settings must be a RouterSettings, got {type(s).__name__}")
    _check(_pow2(s.block_e) and _pow2(s.block_h) and s.block_h >= 16,
           f"block_e {s.block_e!r} and block_h {s.block_h!r} must be powers of two (block_h >= 16)")
    _check(_pow2(s.num_warps) and s.num_warps <= 16, f"num_warps {s.num_warps!r} must be a power of two <= 16")
    _check(_pow2(s.select_warps) and s.select_warps <= 16,
           f"select_warps {s.select_warps!r} must be a power of two <= 16")
    _check(s.split is None or (isinstance(s.split, int) and not isinstance(s.split, bool) and s.split >= 1),
           f"split must be None or an int >= 1, got {s.split!r}")
    _check(isinstance(s.programs_per_sm, int) and s.programs_per_sm >= 1,
           f"programs_per_sm must be an int >= 1, got {s.programs_per_sm!r}")
    _check(isinstance(s.preload, bool), f"preload must be a bool, got {s.preload!r}")
    _check(_pow2(s.warm_chunk_bytes) and s.warm_chunk_bytes >= 16,
           f"warm_chunk_bytes {s.warm_chunk_bytes!r} must be a power of two >= 16")


def route(b: torch.Tensor, router_w: torch.Tensor, top_k: int, *, settings: RouterSettings = RouterSettings(),
          pdl: bool = False, warm: tuple[torch.Tensor, torch.Tensor] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [R, k] fp32, experts [R, k] int64, scores [R, E] fp32) = TorchOps.route_on(b, router_w, top_k) to
    rounding (`device.logit_tolerance`), for b [R, H] bf16 (fp16 / fp32 taken too; unit stride along H), R in
    1..MAX_ROWS, and router_w [E, H] fp32, contiguous. `pdl`: as kernels/launch.py's. `warm`: the layer's Gate and Up
    codes (E4M3 [E, I_r, H] each, `launch.slab_ok`): the select then asks L2 for each chosen expert's two slabs, so
    Gate/Up, the launch after it, reads them from L2 (a cache hint: the same results; on the GPU only, the interpreter
    having no such requests). ValueError for what it does not take."""
    _check(isinstance(b, torch.Tensor) and isinstance(router_w, torch.Tensor), "b and router_w must be tensors")
    _check(b.dim() == 2 and router_w.dim() == 2, f"b {tuple(b.shape)} and router_w {tuple(router_w.shape)} must be 2-D")
    R, H = b.shape
    E, Hw = router_w.shape
    _check(Hw == H, f"b has H={H}, router_w has H={Hw}")
    _check(fits(R, E, H), f"a block of {R} rows with a router [{E}, {H}] is not taken (rows 1..{MAX_ROWS}, experts "
           f"1..{MAX_EXPERTS}, < 2**31 elements): run the torch form")
    _check(b.dtype in _FLOATS, f"b {b.dtype} must be bfloat16, float16 or float32")
    _check(router_w.dtype == torch.float32,
           f"router_w {router_w.dtype} must be float32 (docs/model.md: an fp32 router)")
    _check(b.device == router_w.device, f"devices differ: b {b.device}, router_w {router_w.device}")
    _check(b.stride(1) == 1 or H == 1, "b must have unit stride along H")
    _check(router_w.is_contiguous(), "router_w must be contiguous")
    _check((R - 1) * b.stride(0) + H < 2**31, "b must span < 2**31 elements (int32 offsets)")
    _check(isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= E,
           f"top_k {top_k!r} must be an int in 1..{E} (the expert count)")
    _check_settings(settings)
    if warm is not None:
        _check(len(warm) == 2 and all(isinstance(w, torch.Tensor) and slab_ok(w) and w.shape[0] == E
                                      and w.device == b.device for w in warm) and warm[0].shape == warm[1].shape,
               f"warm must be the Gate and Up codes [{E}, I_r, H], one byte an element, each expert's slab contiguous "
               f"and 16-byte aligned, on {b.device}")
    split = settings.split if settings.split is not None else choose_split(E, H, settings, b.device)
    splits, h_per_split = split_plan(H, split, settings.block_h)

    dev = b.device
    part = torch.empty((splits, R, E), dtype=torch.float32, device=dev)
    weights = torch.empty((R, top_k), dtype=torch.float32, device=dev)
    experts = torch.empty((R, top_k), dtype=torch.int64, device=dev)
    scores = torch.empty((R, E), dtype=torch.float32, device=dev)

    grid = (triton.cdiv(E, settings.block_e), splits)
    _router_logits_kernel[grid](b, router_w, part, E, H, b.stride(0), h_per_split, ROWS=R,
                                ROWS_PAD=triton.next_power_of_2(R), BLOCK_E=settings.block_e,
                                BLOCK_H=settings.block_h, num_warps=settings.num_warps,
                                PRELOAD=settings.preload and h_per_split == settings.block_h,
                                **launch_options(pdl, dev))
    e_pad = triton.next_power_of_2(E)
    gate, up = warm if warm is not None else (part, part)  # unread without WARM
    slab = gate[0].numel() if warm is not None else 0
    _router_select_kernel[(R,)](
        part, weights, experts, scores, R, E, splits, gate, up, gate.stride(0), up.stride(0), slab, E_PAD=e_pad,
        SPLIT_BLOCK=max(1, min(triton.next_power_of_2(splits), PART_CHUNK // e_pad)), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), ACCURATE_EXP=not INTERPRETED, num_warps=settings.select_warps,
        WARM=warm is not None and not INTERPRETED, CHUNK=settings.warm_chunk_bytes,
        CHUNKS_PAD=triton.next_power_of_2(max(1, triton.cdiv(slab, settings.warm_chunk_bytes))),
        **launch_options(pdl, dev))
    return weights, experts, scores

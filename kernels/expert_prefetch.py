"""Expert prefetch (docs/round.md, "Expert prefetch"): while a layer's attention runs, a side branch predicts each live
row's experts from the layer's incoming normalized hidden `a` and asks L2 for their Gate and Up weights, so that the
MoE's Gate/Up reads them from L2 instead of HBM. A cache hint: no value the round computes changes, and the experts
Gate/Up reads are still the router's (or the router fold's).

`warm(a, live, predictor, gate, up, top_k)`: the prediction is the router's selection (its softmax is monotone, so
its top k: kernels/router.py `select_experts`) over `a @ predictor.T`, with `predictor` the layer's fp32 router scaled
by its feed_forward_norm weight (the router fold's matrix, fast/router_fold.py), which sees the MoE input's direction
but for the attention's contribution. Two launches, fixed grids, graph-capturable:

1. grid (cdiv(E, block_e), splits): partial logits of the block's rows, the router's first launch (its
   `split_logits`), except that every program first counts the live rows and returns at once where the prefetch does
   not pay (`PrefetchSettings.rows`).
2. grid (R,): a live row's program sums its partials (router `_sum_splits`), selects its k experts into `predicted`
   [R, k] (-1 where the row is not live or the width not paying), then issues bulk L2 prefetches
   (`cp.async.bulk.prefetch.L2`, sm_90) of each expert's Gate and Up rows in `chunk_bytes` pieces. Rows choosing
   the same expert ask twice; the second request finds the lines in flight.

The prefetch instructions exist only on the GPU (ISSUE is off under the interpreter); `predicted` is what the
coverage report (bench/prefetch.py) and the tests read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import is_pow2 as _pow2, sm_count as _sm_count
from .launch import slab_ok, warm_slabs
from .router import _sum_splits, _tie_rank, select_experts, split_logits, split_plan

INTERPRETED = bool(triton.knobs.runtime.interpret)
MAX_ROWS = 8


@dataclass(frozen=True)
class PrefetchSettings:
    """Launch choices and where the branch runs; none changes a value the round computes."""

    # The live-row counts (verification widths) the branch prefetches at; at others its programs return at once.
    # 4 and 5 rows: where the design document finds the branch pays; at 6-8 it ends too late (docs/PERF.md, "The
    # expert prefetch, an engine option").
    rows: tuple[int, ...] = (4, 5)
    block_e: int = 4
    block_h: int = 512
    num_warps: int = 1
    # The router's choice for the same [256 x 3072] fp32 product (kernels/router.py). With fewer programs an SM the
    # branch ran longer than the attention it overlaps (docs/PERF.md, "The expert prefetch, an engine option").
    programs_per_sm: int = 8
    chunk_bytes: int = 32768  # one bulk prefetch request
    select_warps: int = 4


@triton.jit
def _live_width_pays(live_ptr, R, ROWS_PAD: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                     W3: tl.constexpr):
    """Whether the block's live-row count is one of the paying widths (W0..W3; 0: unused)."""
    r = tl.arange(0, ROWS_PAD)
    n = tl.sum(tl.load(live_ptr + r, mask=r < R, other=0).to(tl.int32), axis=0)
    return (n == W0) | (n == W1) | (n == W2) | (n == W3)


@triton.jit
def _predict_logits_kernel(a_ptr, w_ptr, part_ptr, live_ptr, E, H, stride_a, h_per_split,
                           ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                           W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    if _live_width_pays(live_ptr, ROWS, ROWS_PAD, W0, W1, W2, W3):
        split_logits(a_ptr, w_ptr, part_ptr, E, H, stride_a, h_per_split, ROWS, ROWS_PAD, BLOCK_E, BLOCK_H, False, False)


@triton.jit
def _predict_warm_kernel(part_ptr, live_ptr, predicted_ptr, weights_ptr, scores_ptr, gate_ptr, up_ptr, R, E, splits,
                         stride_gate, stride_up, nbytes,
                         ROWS_PAD: tl.constexpr, E_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, ACCURATE_EXP: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                         W2: tl.constexpr, W3: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                         ISSUE: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.arange(0, K_PAD)
    live = tl.load(live_ptr + row).to(tl.int32) != 0
    if live & _live_width_pays(live_ptr, R, ROWS_PAD, W0, W1, W2, W3):
        logits = _sum_splits(part_ptr, row, R, E, splits, E_PAD, SPLIT_BLOCK)
        select_experts(logits, row, E, weights_ptr, predicted_ptr, scores_ptr, E_PAD, TOP_K, K_PAD, ACCURATE_EXP,
                       _tie_rank)
        tl.debug_barrier()  # the row's experts, stored by other threads of this program, read back
        if ISSUE:
            experts = tl.load(predicted_ptr + row * TOP_K + slot, mask=slot < TOP_K, other=-1)
            warm_slabs(gate_ptr, experts, stride_gate, nbytes, CHUNK, CHUNKS_PAD)
            warm_slabs(up_ptr, experts, stride_up, nbytes, CHUNK, CHUNKS_PAD)
    else:
        tl.store(predicted_ptr + row * TOP_K + slot, tl.full([K_PAD], -1, tl.int64), mask=slot < TOP_K)


# ---- host wrapper ----------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"expert_prefetch: {message}")


def fits(R: int, predictor: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `warm` takes a block of R rows with these weights; otherwise the engine launches no branch."""
    E, H = predictor.shape
    return (1 <= R <= MAX_ROWS and E * H < 2**31 and gate.shape == up.shape and gate.shape[0] == E
            and slab_ok(gate) and slab_ok(up) and gate.shape[1] * gate.shape[2] < 2**31)


def _splits(E: int, H: int, s: PrefetchSettings, device: torch.device) -> tuple[int, int]:
    split = max(1, min(triton.cdiv(H, s.block_h), triton.cdiv(s.programs_per_sm * _sm_count(device),
                                                                triton.cdiv(E, s.block_e))))
    return split_plan(H, split, s.block_h)


def scratch(a: torch.Tensor, predictor: torch.Tensor, top_k: int,
            settings: PrefetchSettings = PrefetchSettings()) -> tuple[torch.Tensor, ...]:
    """What `warm` writes: (partials, predicted, and the selection's unread weights and scores). Allocate it on the
    stream that owns the memory (a graph's capture stream) before launching the branch on a side stream."""
    (R, _), (E, H) = a.shape, predictor.shape
    splits, _ = _splits(E, H, settings, a.device)
    f32 = dict(dtype=torch.float32, device=a.device)
    return (torch.empty((splits, R, E), **f32), torch.empty((R, top_k), dtype=torch.int64, device=a.device),
            torch.empty((R, top_k), **f32), torch.empty((R, E), **f32))


def warm(a: torch.Tensor, live: torch.Tensor, predictor: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
         top_k: int, *, settings: PrefetchSettings = PrefetchSettings(),
         out: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Launch the branch on the current stream; returns `predicted` [R, k] int64 (-1 for rows not warmed), written
    when the branch completes. a [R, H] (bf16 / fp32, unit stride along H), live [R] bool, predictor [E, H] fp32
    contiguous, gate and up [E, I, H] E4M3 as the MoE kernel reads them; `out`: `scratch`'s buffers (made here if
    None). ValueError for what it does not take."""
    R, H = a.shape
    E, Hp = predictor.shape
    _check(Hp == H and predictor.dtype == torch.float32 and predictor.is_contiguous(),
           f"predictor must be a contiguous fp32 [E, {H}], got {predictor.dtype} {tuple(predictor.shape)}")
    _check(fits(R, predictor, gate, up), f"a block of {R} rows with gate {tuple(gate.shape)} is not taken")
    _check(a.stride(1) == 1 and live.shape == (R,) and live.dtype == torch.bool and live.is_contiguous(),
           "a must have unit stride along H, live a contiguous bool [R]")
    _check(isinstance(top_k, int) and 1 <= top_k <= E, f"top_k {top_k!r} must be in 1..{E}")
    s = settings
    _check(_pow2(s.block_e) and _pow2(s.block_h, 16) and _pow2(s.chunk_bytes, 16) and 1 <= len(s.rows) <= 4
           and all(1 <= w <= MAX_ROWS for w in s.rows), f"settings {s!r} not taken")
    widths = (*s.rows, *(0,) * (4 - len(s.rows)))
    splits, h_per_split = _splits(E, H, s, a.device)
    part, predicted, weights, scores = out if out is not None else scratch(a, predictor, top_k, s)
    _check(part.shape == (splits, R, E) and predicted.shape == (R, top_k), "out must be scratch()'s buffers")
    rows_pad = triton.next_power_of_2(R)
    _predict_logits_kernel[(triton.cdiv(E, s.block_e), splits)](
        a, predictor, part, live, E, H, a.stride(0), h_per_split, ROWS=R, ROWS_PAD=rows_pad, BLOCK_E=s.block_e,
        BLOCK_H=s.block_h, W0=widths[0], W1=widths[1], W2=widths[2], W3=widths[3], num_warps=s.num_warps)
    nbytes = gate.shape[1] * gate.shape[2]
    e_pad = triton.next_power_of_2(E)
    _predict_warm_kernel[(R,)](
        part, live, predicted, weights, scores, gate, up, R, E, splits, gate.stride(0), up.stride(0), nbytes,
        ROWS_PAD=rows_pad, E_PAD=e_pad, SPLIT_BLOCK=max(1, min(triton.next_power_of_2(splits), 8192 // e_pad)),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), ACCURATE_EXP=not INTERPRETED, W0=widths[0], W1=widths[1],
        W2=widths[2], W3=widths[3], CHUNK=s.chunk_bytes,
        CHUNKS_PAD=triton.next_power_of_2(triton.cdiv(nbytes, s.chunk_bytes)), ISSUE=not INTERPRETED,
        num_warps=s.select_warps)
    return predicted

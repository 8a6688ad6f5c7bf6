"""This rank's top-k logits in parallel tiles (seed: "Parallelize the Top-K vocabulary scan").

`fast.sampler.local_candidates` is the contract: the top-min(k, Vr) of logits [R, Vr] fp32 by rank key
(value descending, ties: lower id), ids global (`vocab_offset` + column). The kernels order the same
int64 rank keys (`_key` below is `fast.sampler._keys`), so the result is bit-identical and never
depends on the order in which equal values are met: keys are unique.

Pass 1, grid (tiles, rows): each program keys one tile of TILE columns and keeps its top-KP keys
(KP = k rounded up to a power of two, at least 2; `tl.topk`, a bitonic top-k), in descending order. Entry 0 is the
tile's maximum.
Pass 2, grid (rows,): an ordered merge of the tiles' sorted lists. Tile maxima let most tiles be
skipped: a key of the global top-k lies in a tile whose maximum is at least that key, and if KP >= k
tiles had larger maxima, k larger keys would exist. So only the KP tiles with the largest maxima can
contribute; with more tiles than that, the merge reads those tiles' lists and nothing else (the
others' lists are never loaded). With fewer tiles every list is merged. Both branches give the same
keys (the skip is exact, not a heuristic; the tests run both).

Outputs: keys [R, k'] int64 (what the ranks all-gather, see `fast.sampler.sample_rows`), and their
values [R, k'] fp32 and global ids [R, k'] int64; k' = min(k, Vr).

Not fused here: the LM-head GEMV. The logits [R, Vr] fp32 are 640 KB at R=8, Vr=20000, against a
245 MB bf16 weight stream, so fusing the scan into the GEMV would save a launch and ~1 us of traffic,
not bandwidth; it needs a split over Vr as wide as the GPU anyway, i.e. this pass-1 grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from .device import is_pow2
from .launch import launch_options, wait_for_inputs

LOW = 0xFFFFFFFF  # low word of a key: LOW - id
SENTINEL = tl.constexpr(-(2**63))  # below every key of a float (see _key): padding in lists and tiles
MAX_K = 64


@dataclass(frozen=True)
class TopKSettings:
    """Launch choices. None changes a bit of the result: the keys are exact and unique, so any tile and either merge
    give the same top-k (tests: the skip against the full merge, tiles 16 to 8192)."""

    # Columns a pass-1 program keys (at least k rounded up, checked at the call). Smaller tiles give more, shorter
    # programs, the same bits; a tile is adopted from a timing of the round, not of the op alone: 1024, paired in the
    # round with the attention's stages (docs/PERF.md, "Current state": the same-bits tunes, 0.9903x).
    tile: int = 1024
    # Both passes' warps (8 keys a thread of a 1024 tile): the tune's choice with its tile.
    num_warps: int = 4
    # The merge reads only the KP tiles the maxima allow (exact: module docstring), so it is on: fewer reads, the same
    # keys (docs/PERF.md, "Current state"). It acts only where the tiles, rounded up to a power of two, outnumber KP
    # (not at 1024 on 20000 columns: 20 tiles, 32 rounded up, KP 32 at k = 20).
    skip: bool = True

    def __post_init__(self):
        _check_settings(self)


# ---- rank keys (fast.sampler._keys / unkey) ---------------------------------------------------
@triton.jit
def _key(v, ids):
    """int64 rank keys of fp32 values v (not NaN) and int64 ids: larger key = larger value, then lower id."""
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 compares equal to +0.0: one key
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # negative floats: flip magnitude
    return (ordered << 32) | (4294967295 - ids)


@triton.jit
def _unkey(keys):
    """(fp32 values, int64 ids) of rank keys."""
    ordered = keys >> 32  # arithmetic: the signed high word
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.int32)
    return bits.to(tl.float32, bitcast=True), 4294967295 - (keys & 4294967295)


# ---- pass 1: per-tile candidates -----------------------------------------------------------------
@triton.jit
def _tile_topk_kernel(logits_ptr, cand_ptr, V, stride_r, vocab_offset, n_tiles,
                      TILE: tl.constexpr, KP: tl.constexpr,
                      PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    r = tl.program_id(1)
    col = t * TILE + tl.arange(0, TILE)
    ok = col < V
    v = tl.load(logits_ptr + r * stride_r + col, mask=ok, other=0.0)
    keys = tl.where(ok, _key(v, col.to(tl.int64) + vocab_offset), SENTINEL)
    top = tl.topk(keys, KP)  # descending; top[0] is the tile maximum
    tl.store(cand_ptr + (r * n_tiles + t) * KP + tl.arange(0, KP), top)


# ---- pass 2: ordered merge of the tiles that can contribute --------------------------------------
@triton.jit
def _merge_kernel(cand_ptr, keys_ptr, values_ptr, ids_ptr, n_tiles, vocab_offset, K,
                  TILE: tl.constexpr, KP: tl.constexpr, TP: tl.constexpr, SKIP: tl.constexpr,
                  PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    row = cand_ptr + r * n_tiles * KP
    j = tl.arange(0, KP)
    if SKIP:
        # The KP largest tile maxima name the only tiles that can hold a top-k key (module docstring).
        t = tl.arange(0, TP)
        maxima = tl.load(row + t * KP, mask=t < n_tiles, other=SENTINEL)
        best = tl.topk(maxima, KP)  # TP > KP >= k, so all KP are real tiles
        _, best_ids = _unkey(best)
        tiles = ((best_ids - vocab_offset) // TILE).to(tl.int32)
        lists = tl.load(row + tiles[:, None] * KP + j[None, :])  # [KP, KP]
        merged = tl.topk(tl.reshape(lists, [KP * KP]), KP)
    else:
        t = tl.arange(0, TP)
        lists = tl.load(row + t[:, None] * KP + j[None, :], mask=(t < n_tiles)[:, None], other=SENTINEL)
        merged = tl.topk(tl.reshape(lists, [TP * KP]), KP)
    values, ids = _unkey(merged)
    ok = j < K
    tl.store(keys_ptr + r * K + j, merged, mask=ok)
    tl.store(values_ptr + r * K + j, values, mask=ok)
    tl.store(ids_ptr + r * K + j, ids, mask=ok)


# ---- host wrapper ------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"local_topk: {message}")


def _check_settings(s: TopKSettings) -> None:
    _check(isinstance(s, TopKSettings), f"settings must be a TopKSettings, got {type(s).__name__}")
    _check(is_pow2(s.tile, 16), f"tile {s.tile!r} must be a power of two >= 16")
    _check(is_pow2(s.num_warps) and s.num_warps <= 16, f"num_warps {s.num_warps!r} must be a power of two <= 16")
    _check(isinstance(s.skip, bool), f"skip must be a bool, got {s.skip!r}")


def local_topk_keys(logits: torch.Tensor, k: int, vocab_offset: int, *,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    settings: TopKSettings = TopKSettings(),
                    pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys int64, values fp32, global ids int64), each [R, min(k, Vr)], of logits [R, Vr] fp32.

    Equal to `fast.sampler._local_keys` and `local_candidates`, whatever the settings (`TopKSettings`; its tile must
    be at least k rounded up to a power of two). out: preallocated (keys, values, ids), contiguous. `pdl`: as
    kernels/launch.py's.
    """
    _check(logits.dim() == 2 and logits.dtype == torch.float32,
           f"logits must be float32 [R, Vr], got {logits.dtype} {tuple(logits.shape)}")
    _check(logits.stride(1) == 1, "logits must have unit stride along the vocabulary")
    R, V = logits.shape
    _check(R >= 1 and V >= 1, "empty logits")
    _check(1 <= k <= MAX_K, f"k must be in [1, {MAX_K}], got {k}")
    _check(0 <= vocab_offset and vocab_offset + V <= 2**31, f"ids must stay below 2**31, got offset {vocab_offset}")
    _check_settings(settings)
    tile = settings.tile
    kp = max(2, triton.next_power_of_2(k))  # tl.topk needs at least two
    _check(tile >= kp, f"tile {tile} must be a power of two >= {kp}")
    K = min(k, V)
    n_tiles = triton.cdiv(V, tile)
    tp = triton.next_power_of_2(n_tiles)
    if out is None:
        dev = logits.device
        out = (torch.empty((R, K), dtype=torch.int64, device=dev), torch.empty((R, K), dtype=torch.float32, device=dev),
               torch.empty((R, K), dtype=torch.int64, device=dev))
    keys, values, ids = out
    for o, dt in zip(out, (torch.int64, torch.float32, torch.int64)):
        _check(tuple(o.shape) == (R, K) and o.dtype == dt and o.is_contiguous() and o.device == logits.device,
               f"out tensors must be contiguous [{R}, {K}] (int64, float32, int64)")
    cand = torch.empty((R, n_tiles, kp), dtype=torch.int64, device=logits.device)
    _tile_topk_kernel[(n_tiles, R)](logits, cand, V, logits.stride(0), vocab_offset, n_tiles,
                                     TILE=tile, KP=kp, num_warps=settings.num_warps,
                                     **launch_options(pdl, logits.device))
    _merge_kernel[(R,)](cand, keys, values, ids, n_tiles, vocab_offset, K,
                        TILE=tile, KP=kp, TP=tp, SKIP=settings.skip and tp > kp, num_warps=settings.num_warps,
                        **launch_options(pdl, logits.device))
    return keys, values, ids


def local_topk(logits: torch.Tensor, k: int, vocab_offset: int, *, settings: TopKSettings = TopKSettings(),
               pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's top-k (values [R, k'] fp32, global ids [R, k'] int64): `fast.sampler.local_candidates`."""
    _, values, ids = local_topk_keys(logits, k, vocab_offset, settings=settings, pdl=pdl)
    return values, ids

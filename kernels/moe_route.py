"""Live-row helpers of the MoE kernels (`load_live`, `check_live`, the pair capacity MAX_PAIRS), and
`moe_group`, the device-side grouping that kernels/moe.py launched before its programs found their
experts' rows themselves. moe no longer calls moe_group; bench/tune.py (its `moe_group` op) and the
bit-identity reference in tests/test_kernel_moe.py (the five-launch form) still do.

moe_group: a verification block has R rows (R <= 8 at decode) and each row chose k experts, so there
are at most P = R * k (row, slot) pairs, pair p = r * k + j. Pairs of padding rows are dropped first, so
nothing downstream reads the weights of an expert that only padding rows chose. The live pairs are
ordered by (expert, pair index) and cut into one segment per distinct expert. Every output has a
fixed size of P entries, so consumers' grids are sized for the worst case (P distinct experts) and
programs of unused entries exit at once:

    order     [P] int32  pair indices, live pairs sorted by (expert, pair); entries past the live
                         pair count are -1
    seg_expert[P] int32  the expert of segment s (ascending), -1 past the distinct-expert count
    seg_start [P] int32  the segment's first position in `order` (0 when unused)
    seg_len   [P] int32  its number of pairs (0 when unused: the consumer's row loop runs 0 times)

With P <= 128 one program does it all: an O(P^2) comparison matrix gives every pair its rank, and
each output entry is a reduction over pairs (no scatter, so no two lanes store to one address).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_PAIRS = 128  # R * k a moe call takes (its programs' pair vectors); TritonOps splits longer blocks


class Groups(NamedTuple):
    order: torch.Tensor
    seg_expert: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor


@triton.jit
def load_live(live_ptr, rows, R, LIVE_COUNT: tl.constexpr):
    """Liveness of `rows`: a bool/uint8 mask [R], or (LIVE_COUNT) rows < a device int count."""
    if LIVE_COUNT:
        n = tl.load(live_ptr).to(tl.int32)
        return rows < n
    return tl.load(live_ptr + rows, mask=rows < R, other=0) != 0


@triton.jit
def _moe_group_kernel(experts_ptr, live_ptr, order_ptr, seg_e_ptr, seg_start_ptr, seg_len_ptr, R, K_TOP,
                      P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr):
    P = R * K_TOP
    i = tl.arange(0, P_PAD)  # pair index along rows of the matrices
    j = tl.arange(0, P_PAD)  # the other pair along columns
    ok = (i < P) & load_live(live_ptr, i // K_TOP, R, LIVE_COUNT)
    e = tl.load(experts_ptr + i, mask=i < P, other=0).to(tl.int32)
    key = tl.where(ok, e, 1073741824)  # dropped pairs sort after every live one
    ki = key[:, None]
    kj = key[None, :]  # the same keys in the column role
    same = ki == kj
    before = (kj < ki) | (same & (j[None, :] < i[:, None]))
    pos = tl.sum(before.to(tl.int32), axis=1)  # rank of pair i in (expert, pair) order
    first = ok & (tl.sum((same & (j[None, :] < i[:, None])).to(tl.int32), axis=1) == 0)
    count = tl.sum(same.to(tl.int32), axis=1)  # pairs sharing i's expert (live ones, when i is live)
    seg = tl.sum(((kj < ki) & first[None, :]).to(tl.int32), axis=1)  # distinct live experts below i's

    # order[q] = the live pair whose rank is q (-1 past the live pairs)
    q = tl.arange(0, P_PAD)
    hit = (pos[None, :] == q[:, None]) & ok[None, :]
    order = tl.sum(tl.where(hit, j[None, :], 0), axis=1)
    order = tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, order, -1)
    tl.store(order_ptr + q, order, mask=q < P)

    # segment s takes its values from the first pair of its expert
    hit = (seg[None, :] == q[:, None]) & first[None, :]
    used = tl.sum(hit.to(tl.int32), axis=1) > 0
    tl.store(seg_e_ptr + q, tl.where(used, tl.sum(tl.where(hit, key[None, :], 0), axis=1), -1), mask=q < P)
    tl.store(seg_start_ptr + q, tl.sum(tl.where(hit, pos[None, :], 0), axis=1), mask=q < P)
    tl.store(seg_len_ptr + q, tl.sum(tl.where(hit, count[None, :], 0), axis=1), mask=q < P)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"moe: {message}")


def check_live(live: torch.Tensor, R: int, device: torch.device) -> bool:
    """Validates `live` (bool [R] mask, or an integer count of leading live rows: 0-d or [1]);
    returns True when it is a count."""
    _check(live.device == device, f"live is on {live.device}, experts on {device}")
    if live.dtype == torch.bool:
        _check(tuple(live.shape) == (R,) and live.is_contiguous(), f"live mask must be [{R}], got {tuple(live.shape)}")
        return False
    _check(live.dtype in (torch.int32, torch.int64) and live.numel() == 1,
           f"live must be a bool mask [{R}] or one int32/int64 count, got {live.dtype} {tuple(live.shape)}")
    return True


def moe_group(experts: torch.Tensor, live: torch.Tensor) -> Groups:
    """experts [R, k] int64 (each row's chosen experts), live mask [R] bool or count -> Groups."""
    _check(experts.dim() == 2 and experts.dtype in (torch.int32, torch.int64) and experts.is_contiguous(),
           f"experts must be contiguous int [R, k], got {experts.dtype} {tuple(experts.shape)}")
    R, k = experts.shape
    P = R * k
    _check(1 <= P <= MAX_PAIRS, f"R * k = {P} pairs, at most {MAX_PAIRS}")
    count = check_live(live, R, experts.device)
    out = torch.empty((4, P), dtype=torch.int32, device=experts.device)
    live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
    _moe_group_kernel[(1,)](experts, live_arg, out[0], out[1], out[2], out[3], R, k,
                            P_PAD=max(16, triton.next_power_of_2(P)), LIVE_COUNT=count)
    return Groups(*out.unbind(0))


def moe_group_ref(experts: torch.Tensor, live: torch.Tensor) -> Groups:
    """The same metadata with torch.sort (stable) and unique_consecutive; host-synchronizing."""
    R, k = experts.shape
    P = R * k
    mask = live if live.dtype == torch.bool else torch.arange(R, device=experts.device) < live.reshape(())
    keep = mask.repeat_interleave(k)
    key = torch.where(keep, experts.reshape(-1), 2**30)
    sorted_key, idx = torch.sort(key, stable=True)
    n = int(keep.sum())
    order = torch.full((P,), -1, dtype=torch.int32)
    order[:n] = idx[:n].int().cpu()
    uniq, counts = torch.unique_consecutive(sorted_key[:n].cpu(), return_counts=True)
    d = len(uniq)
    seg_expert = torch.full((P,), -1, dtype=torch.int32)
    seg_start = torch.zeros(P, dtype=torch.int32)
    seg_len = torch.zeros(P, dtype=torch.int32)
    seg_expert[:d] = uniq.int()
    seg_len[:d] = counts.int()
    seg_start[:d] = (torch.cumsum(counts, 0) - counts).int()
    return Groups(order, seg_expert, seg_start, seg_len)

"""The attention's q/k/v projection ending in its per-head prologue, in one launch (docs/model.md, "Attention", steps
1-3, and the KV write of docs/round.md): kernels/fp8_linear.py's split-K product with one head of the projection an
output tile (BLOCK_N = head_dim), whose last split to arrive sums the tile and then does what kernels/qk_rope_kv.py
does for that head, for every row of the tile: q and k normalized (one D-vector weight each) and their first
rotary_dim dims rotated NeoX-style, the rotated q stored over the projection's q columns, k and v stored at the rows'
cache slots (padding rows: the trash slot), the slots' positions recorded by the first KV head.

Why: the projection and the prologue are two dependent launches a layer, and the prologue needs nothing but the
projection's own tile (a head's 128 values a row) and per-row constants. Folding it into the tile's last split removes
a launch and its dependent step (issue 52) without a load the linear does not already make: the last split reads the
split partials anyway.

Roundings are the unfused pair's: the tile's sum is rounded to the output dtype (the projection's output), and the
head's norm, rotation and cache stores are kernels/qk_rope_kv.py's `head_rows`. One difference: a row's sum of squares
is added in this kernel's layout (the tile's rows over the linear's warps), not qk_rope_kv's one row over one warp, so
a norm's fp32 result may differ from the unfused pair's in its last bits, which after the rounding to bf16 almost
never shows (the unfused kernel already differs from torch's order the same way: tests/test_kernel_qk_rope_kv.py's
TOL).

K is split as the plain linear splits it under the same settings, so every tile's sum is that linear's bit for bit.
The product's `split_k=8` (fast/kernel_settings.py) takes a TP8 rank's 24 K tiles three a program, 64 programs of one
head. 12 splits (96 programs) were adopted at 17fb4ea inside a candidate of four settings paired only together; paired
alone, 8 splits made the round 0.9910x (docs/PERF.md, "Current state", the candidate of 9c6eda1). Another split
changes the sums' order: a numerical change.

Requirements (`fits`): head_dim a power of two >= 16 and the weight's q/k/v rows whole heads; the split sum done in the
launch (`locks`, or one split); decode and prefill blocks alike (rows in tiles of 16).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import fp8_linear as fl
from .launch import launch_options
from .qk_rope_kv import check as check_prologue, head_rows, qk_rope_kv_fits
from .rmsnorm import _on_grid


@triton.jit
def _prologue(total, y_ptr, stride_ym, head, m, m_ok, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr, ck_ptr,
              cv_ptr, sp_ptr, HQ, HKV, SLOTS, eps, stride_cos, stride_sin,
              D: tl.constexpr, ROT: tl.constexpr, ROPE: tl.constexpr, INTERP: tl.constexpr):
    """Head `head` of the tile's rows, from its summed product `total` [BLOCK_M, D] fp32."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    i = tl.arange(0, D)
    y_tile = y_ptr + m[:, None] * stride_ym + (head * D + i)[None, :]
    tl.store(y_tile, total.to(DT), mask=m_ok[:, None])  # the projection's output, as the unfused linear's
    tl.debug_barrier()  # the tile's stores seen by every thread before head_rows reads them (and the partners)
    if head < HQ:
        n = head_rows(y_tile, qw_ptr, cos_ptr, sin_ptr, m, m_ok, stride_cos, stride_sin, eps, D, ROT, ROPE, DT,
                      INTERP)
        tl.debug_barrier()  # every partner read before the rotated q is stored over it
        tl.store(y_tile, n.to(DT), mask=m_ok[:, None])
    else:
        pos = tl.load(pos_ptr + m, mask=m_ok, other=0)
        live = tl.load(live_ptr + m, mask=m_ok, other=0) != 0
        slot = tl.where(live, pos % SLOTS, SLOTS)
        CK: tl.constexpr = ck_ptr.dtype.element_ty
        CV: tl.constexpr = cv_ptr.dtype.element_ty
        if head < HQ + HKV:
            h = head - HQ
            n = head_rows(y_tile, kw_ptr, cos_ptr, sin_ptr, m, m_ok, stride_cos, stride_sin, eps, D, ROT, ROPE, DT,
                          INTERP)
            tl.store(ck_ptr + (slot[:, None] * HKV + h) * D + i[None, :], _on_grid(n, CK).to(CK), mask=m_ok[:, None])
            if h == 0:
                tl.store(sp_ptr + slot, tl.where(live, pos, -1), mask=m_ok)
        else:
            h = head - HQ - HKV
            v = tl.load(y_tile, mask=m_ok[:, None], other=0.0).to(tl.float32)
            tl.store(cv_ptr + (slot[:, None] * HKV + h) * D + i[None, :], _on_grid(v, CV).to(CV), mask=m_ok[:, None])


@triton.jit
def _qkv_rope_kv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_ym, scale_cols, k_per_split, splits,
    qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr, ck_ptr, cv_ptr, sp_ptr, HQ, HKV, SLOTS, eps, stride_cos,
    stride_sin,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, ROT: tl.constexpr, ROPE: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr = False, PRELOAD: tl.constexpr = 0,
):
    head, pid_k, pid_m, m, n, m_ok, n_ok = fl.program_tile(M, N, BLOCK_M, D)  # one head an N tile
    acc = fl.split_product(x_ptr, w_ptr, s_ptr, m, n, m_ok, n_ok, pid_k, K, stride_xm, scale_cols, k_per_split, B0,
                           B1, BLOCK_M, D, BLOCK_K, F32, PREC, PDL, PRELOAD)
    if SPLIT:
        last, total = fl.serial_sum(acc, part_ptr, lock_ptr, m, n, m_ok[:, None] & n_ok[None, :], pid_k,
                                    pid_m * tl.num_programs(0) + head, M, N, splits, BLOCK_M, D)
        if last:
            _prologue(total, y_ptr, stride_ym, head, m, m_ok, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr,
                      ck_ptr, cv_ptr, sp_ptr, HQ, HKV, SLOTS, eps, stride_cos, stride_sin, D, ROT, ROPE, INTERP)
    else:
        _prologue(acc, y_ptr, stride_ym, head, m, m_ok, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr, ck_ptr,
                  cv_ptr, sp_ptr, HQ, HKV, SLOTS, eps, stride_cos, stride_sin, D, ROT, ROPE, INTERP)


# ---- host wrapper ----------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"qkv_rope_kv: {message}")


def lock_count(m: int, head_dim: int, n: int) -> int:
    """Counters `qkv_rope_kv(locks=...)` needs for m rows of an n-row projection: one per (row tile, head)."""
    return triton.cdiv(n, head_dim) * triton.cdiv(m, fl.BLOCK_M)


def fits(heads_q: int, heads_kv: int, head_dim: int, rotary_dim: int | None, n: int) -> bool:
    """Whether `qkv_rope_kv` takes a projection of n = (heads_q + 2 heads_kv) head_dim rows with this layout."""
    return (head_dim >= 16 and qk_rope_kv_fits(heads_q, heads_kv, head_dim, rotary_dim)
            and n == (heads_q + 2 * heads_kv) * head_dim)


def qkv_rope_kv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], heads_q: int,
                heads_kv: int, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float, cos: torch.Tensor | None,
                sin: torch.Tensor | None, positions: torch.Tensor, live: torch.Tensor, cache_k: torch.Tensor,
                cache_v: torch.Tensor, slot_pos: torch.Tensor, *, locks: torch.Tensor | None = None,
                pdl: bool = False, settings: fl.LinearSettings = fl.LinearSettings()) -> torch.Tensor:
    """kernels/fp8_linear.py's `fp8_linear(x, w, scale, block)` (W's rows: q heads, then k heads, then v heads, of
    head_dim = cache_k.shape[-1] each) followed by kernels/qk_rope_kv.py's `qk_rope_kv` on its q/k/v views, in one
    launch. Returns the rotated q [R, heads_q, head_dim] (a view of the projection's output). `locks`: zeroed counters
    for the split sum (`lock_count`), left zeroed; without them K is not split. `settings`: the projection's launch,
    with one head a tile: its block_n sets the K split only, as the plain linear's (the same sums). Arguments after `block` as
    `qk_rope_kv`'s; ValueError for what it does not take."""
    D = cache_k.shape[-1] if cache_k.dim() == 3 else 0
    _check(x.dim() == 2 and w.dim() == 2 and D >= 1, "x, w must be 2-D and cache_k [slots + 1, Hkv, head_dim]")
    _check(not settings.direct, "settings.direct: the fused projection has no direct form (fp8_linear_direct)")
    # K split as the plain linear splits it under `settings` (its column tiles, not a head's), so the tile sums are
    # its own, bit for bit; without locks the sum is not split
    splits = fl.split_plan(w.shape[0], x.shape[1], block, settings, x.device)[1] if locks is not None else 1
    st = replace(settings, block_n=D, split_k=splits)
    c = fl.plan_call(x, w, scale, block, x.dtype, None, st)
    rot = None if cos is None else cos.shape[-1]
    _check(fits(heads_q, heads_kv, D, rot, c.N), f"{heads_q} q and {heads_kv} kv heads of {D} (rotary_dim {rot}) "
           f"for a projection of {c.N} rows is not a layout it takes (`fits`)")
    R = c.M
    # the prologue's operands, checked as qk_rope_kv checks them (its views of the projection are what it would get)
    y = c.out
    q = y[:, :heads_q * D].view(R, heads_q, D)
    k = y[:, heads_q * D:(heads_q + heads_kv) * D].view(R, heads_kv, D)
    v = y[:, (heads_q + heads_kv) * D:].view(R, heads_kv, D)
    slots = check_prologue(q, k, v, q_norm_w, k_norm_w, eps, cos, sin, positions, live, cache_k, cache_v, slot_pos,
                           q)
    grid = fl.tile_grid(c.M, c.N, c.splits, D)
    fl.check_locks(locks, grid[0] * grid[2], x.device)
    f32 = fl.INTERPRETED or x.dtype == torch.float32
    tiles = fl.preload_tiles(c.K, c.k_per_split, c.block_k) if st.preload else 0
    cos_t, sin_t = (y, y) if cos is None else (cos, sin)  # never read without RoPE
    _qkv_rope_kv_kernel[grid](
        x, w, scale, y, c.part, locks if c.splits > 1 else c.part, c.M, c.N, c.K, x.stride(0), y.stride(0),
        c.scale_cols, c.k_per_split, c.splits, q_norm_w, k_norm_w, cos_t, sin_t, positions, live.view(torch.uint8),
        cache_k, cache_v, slot_pos, heads_q, heads_kv, slots, float(eps), cos_t.stride(0), sin_t.stride(0),
        B0=block[0], B1=block[1], BLOCK_M=fl.BLOCK_M, D=D, BLOCK_K=c.block_k, SPLIT=c.splits > 1, F32=f32,
        PREC="ieee" if f32 else "tf32", ROT=rot or 0, ROPE=cos is not None, INTERP=fl.INTERPRETED, PRELOAD=tiles,
        num_warps=st.num_warps, num_stages=st.num_stages, **launch_options(pdl, x.device))
    return q

"""Rotary embedding of a block's q and k, and the KV-cache write, in one launch.

Not on the product path until re-based to docs/model.md: it rotates every dim of a head (the retired, guessed
architecture's full-width RoPE), while the published model normalizes q and k per head first and rotates only the
first rotary_dim (32) dims, with a base per layer type; fast/triton_ops.py no longer dispatches it, and the published
rotary runs its torch form. Its tests hold it to its own reference (`rope_kv_ref`, `rope_tables_ref`,
`apply_rope_ref`, below).

The attention block's `apply_rope_ref(q)`, `apply_rope_ref(k)` and `LayerKV.write` (slot arithmetic, three
`index_copy_`) are about fifteen small kernels per layer; a decode round runs ~90 layers of them. This
kernel does the same work in one launch with the same roundings as the torch sequence: each product
`x * cos` and `rotate_half(x) * sin` is rounded to the activation dtype, then their sum is, exactly
as torch's separate elementwise kernels do. On the GPU the kernel is compiled with floating-point
contraction off (`enable_fp_fusion=False`), so no multiply-add is fused into an FMA: the result is
bit-identical to the torch sequence in fp32 and bf16.

The rotary factors come from the model's tables (fast/model.rope_tables), row `rope_rows[r]` for row r, so a
forward computes none. One program per (row, head) over q heads then kv heads. A kv program writes its rotated k and its v
to the row's slot (`position % slots`, or the trash slot `slots` for padding rows) and the head-0
program writes `slot_pos` (the position, or -1 for padding rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS
from .launch import launch_options, wait_for_inputs



@triton.jit
def _values(ptr, off, stride_s, D: tl.constexpr, PARTS: tl.constexpr):
    """What the projection holds at ptr + off: its values (PARTS = 0), or, from its K splits' fp32 partial products
    (fp8_linear(unsummed=True)), what fp8_linear would have stored before rounding: the one split's product, or the
    splits summed in order from zero. The caller rounds to the activation dtype, as fp8_linear does."""
    if PARTS <= 1:
        values = tl.load(ptr + off)
    else:  # one return only: Triton types every return of a function, the pruned branch's too
        values = tl.zeros([D], tl.float32)
        for sk in tl.static_range(PARTS):
            values += tl.load(ptr + sk * stride_s + off)
    return values


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, rr_ptr, pos_ptr, live_ptr, qo_ptr, ck_ptr, cv_ptr, sp_ptr,
                    HQ, HKV, SLOTS, TABLE_ROWS, stride_q, stride_k, stride_v, stride_s, D: tl.constexpr,
                    HALF: tl.constexpr, PARTS: tl.constexpr = 0, PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    DT: tl.constexpr = qo_ptr.dtype.element_ty  # the activation dtype (q's; k and v's too)
    if not EARLY:
        wait_for_inputs(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, D)
    rot = tl.where(i < HALF, i + HALF, i - HALF)            # rotate_half: [-x[h:], x[:h]]
    sign = tl.where(i < HALF, -1.0, 1.0)
    # EARLY: the rows' table rows come from the positions, written before the forward (two launches back or earlier,
    # kernels/launch.py), and the tables are constant: the factors are read before the wait, q/k/v after it.
    t = tl.minimum(tl.load(rr_ptr + row), TABLE_ROWS - 1)  # padding rows may run past the tables
    c = tl.load(cos_ptr + t * D + i)
    s = tl.load(sin_ptr + t * D + i)
    if EARLY:
        wait_for_inputs(PDL)
    if head < HQ:
        base = row * stride_q + head * D
        x = _values(q_ptr, base + i, stride_s, D, PARTS).to(DT)
        xr = (_values(q_ptr, base + rot, stride_s, D, PARTS).to(DT).to(tl.float32) * sign).to(DT)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (xr.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        tl.store(qo_ptr + (row * HQ + head) * D + i, (a.to(tl.float32) + b.to(tl.float32)).to(qo_ptr.dtype.element_ty))
    else:
        h = head - HQ
        pos = tl.load(pos_ptr + row)
        live = tl.load(live_ptr + row) != 0
        slot = tl.where(live, pos % SLOTS, SLOTS)
        base = row * stride_k + h * D
        x = _values(k_ptr, base + i, stride_s, D, PARTS).to(DT)
        xr = (_values(k_ptr, base + rot, stride_s, D, PARTS).to(DT).to(tl.float32) * sign).to(DT)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (xr.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        k = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        dst = (slot * HKV + h) * D
        tl.store(ck_ptr + dst + i, k.to(ck_ptr.dtype.element_ty))
        v = _values(v_ptr, row * stride_v + h * D + i, stride_s, D, PARTS).to(DT)
        tl.store(cv_ptr + dst + i, v.to(cv_ptr.dtype.element_ty))
        if h == 0:
            tl.store(sp_ptr + slot, tl.where(live, pos, -1))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"rope_kv: {message}")


def rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor, live: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
            slot_pos: torch.Tensor, *, rope_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
            pdl: bool = False, early: bool = False) -> torch.Tensor:
    """Rotated q [R, Hq, D] (returned, contiguous); rotated k and v written to `cache_k`/`cache_v` [slots + 1, Hkv, D]
    at each row's slot, `slot_pos` [slots + 1] updated. cos/sin: rotary tables [T, D] in q's dtype, row r rotated by
    their row `rope_rows[r]` (int64 [R]; default `positions`; clamped to T - 1, which only padding rows reach); live
    bool [R]. q, k and v may be column slices of one projection's rows (any row stride; heads and head_dim dense
    within a row). `early` (with `pdl`): the rotary factors are read before the PDL wait, for a caller whose rope_rows
    were written two launches back or earlier (then final: kernels/launch.py); the same bits."""
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be [R, heads, D]")
    R, HQ, D = q.shape
    HKV = k.shape[1]
    _check(tuple(k.shape) == (R, HKV, D) and tuple(v.shape) == (R, HKV, D), f"k {tuple(k.shape)} and v "
           f"{tuple(v.shape)} must be [{R}, Hkv, {D}]")
    _check(q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share a float dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        _check(t.stride(2) == 1 and t.stride(1) == D, f"{name} must be dense within a row (strides [*, {D}, 1])")
    return _launch(q, k, v, (q.stride(0), k.stride(0), v.stride(0)), 0, 0, R, HQ, HKV, D, q.dtype, cos, sin,
                   positions, live, cache_k, cache_v, slot_pos, rope_rows, out, pdl, early)


def rope_kv_parts(parts: torch.Tensor, heads_q: int, heads_kv: int, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, live: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  slot_pos: torch.Tensor, *, dtype: torch.dtype, rope_rows: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, pdl: bool = False, early: bool = False) -> torch.Tensor:
    """`rope_kv` of the q/k/v projection left unsummed: `parts` [S, R, (Hq + 2 Hkv) D] fp32, the K splits' partial
    products of fp8_linear(unsummed=True) (q's columns, then k's, then v's). Each value is summed in split order and
    rounded to `dtype` here, as fp8_linear would have before storing it, so the result is rope_kv's of fp8_linear's
    output, bit for bit; the projection's own sum (an arrival count and a serial tail per tile) is gone."""
    _check(parts.dim() == 3 and parts.dtype == torch.float32 and parts.is_contiguous() and parts.shape[0] >= 1,
           f"parts must be contiguous fp32 [splits, R, N], got {parts.dtype} {tuple(parts.shape)}")
    S, R, N = parts.shape
    D = cache_k.shape[-1] if cache_k.dim() == 3 else 0
    _check(heads_q >= 1 and heads_kv >= 1 and N == (heads_q + 2 * heads_kv) * D,
           f"parts' {N} columns must be (heads_q + 2 heads_kv) x head_dim = ({heads_q} + 2 x {heads_kv}) x {D}")
    _check(dtype in _FLOATS, f"dtype {dtype} must be bf16, fp16 or fp32")
    q, k, v = parts[0, :, :heads_q * D], parts[0, :, heads_q * D:], parts[0, :, (heads_q + heads_kv) * D:]
    return _launch(q, k, v, (N, N, N), R * N, S, R, heads_q, heads_kv, D, dtype, cos, sin, positions, live, cache_k,
                   cache_v, slot_pos, rope_rows, out, pdl, early)


def _launch(q, k, v, strides, stride_s, parts, R, HQ, HKV, D, dtype, cos, sin, positions, live, cache_k, cache_v,
            slot_pos, rope_rows, out, pdl, early):
    _check(D >= 2 and D & (D - 1) == 0, f"head_dim {D} must be a power of two")
    _check(cos.dtype == dtype and sin.dtype == dtype and cos.dim() == 2 and cos.shape[0] >= 1
           and cos.shape[1] == D and cos.shape == sin.shape, f"cos and sin must be [T, {D}] {dtype} tables")
    if rope_rows is None:
        rope_rows = positions
    slots = cache_k.shape[0] - 1
    _check(slots >= 1 and tuple(cache_k.shape) == (slots + 1, HKV, D) and cache_v.shape == cache_k.shape,
           f"caches must be [slots + 1, {HKV}, {D}]")
    _check(tuple(slot_pos.shape) == (slots + 1,) and slot_pos.dtype == torch.int64, "slot_pos must be int64 [slots + 1]")
    _check(tuple(positions.shape) == (R,) and positions.dtype == torch.int64, f"positions must be int64 [{R}]")
    _check(tuple(live.shape) == (R,) and live.dtype == torch.bool, f"live must be bool [{R}]")
    _check(tuple(rope_rows.shape) == (R,) and rope_rows.dtype == torch.int64, f"rope_rows must be int64 [{R}]")
    for name, t in (("cos", cos), ("sin", sin), ("positions", positions), ("rope_rows", rope_rows), ("live", live),
                    ("cache_k", cache_k), ("cache_v", cache_v), ("slot_pos", slot_pos)):
        _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        _check(t.is_contiguous(), f"{name} must be contiguous")
    if out is None:
        out = torch.empty((R, HQ, D), dtype=dtype, device=q.device)
    _check(tuple(out.shape) == (R, HQ, D) and out.dtype == dtype and out.is_contiguous(),
           f"out must be contiguous [{R}, {HQ}, {D}] {dtype}")
    options = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}  # no FMA: torch's roundings
    _rope_kv_kernel[(R, HQ + HKV)](q, k, v, cos, sin, rope_rows, positions, live.view(torch.uint8), out, cache_k,
                                   cache_v, slot_pos, HQ, HKV, slots, cos.shape[0], *strides, stride_s, D=D,
                                   HALF=D // 2, PARTS=parts, EARLY=bool(early and pdl), **options,
                                   **launch_options(pdl, q.device))
    return out


def rope_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, live: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                slot_pos: torch.Tensor, rope_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The torch sequence this kernel replaces (the tables' rows, `apply_rope_ref`, then LayerKV.write's copies)."""
    rows = (positions if rope_rows is None else rope_rows).clamp(max=cos.shape[0] - 1)
    cos, sin = cos.index_select(0, rows), sin.index_select(0, rows)
    q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
    slots = cache_k.shape[0] - 1
    slot = torch.where(live, positions % slots, torch.full_like(positions, slots))
    cache_k.index_copy_(0, slot, k.to(cache_k.dtype))
    cache_v.index_copy_(0, slot, v.to(cache_v.dtype))
    slot_pos.index_copy_(0, slot, torch.where(live, positions, torch.full_like(positions, -1)))
    return q


def rope_tables_ref(positions: torch.Tensor, head_dim: int, theta: float,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, head_dim] at `positions` for full-width rotate-half RoPE (the head_dim / 2 angles twice), angles
    in float64: the tables this kernel reads."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, heads, D] rotated by its row's cos/sin [R, D] over every dim: x cos + rotate_half(x) sin, each product
    and the sum rounded to x's dtype (the torch elementwise sequence)."""
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None, :]

"""The published attention's per-head prologue in one launch (docs/model.md, "Attention", steps 2 and 3, and the KV
write of docs/round.md): q and k normalized per head (one D-vector weight each), the first rotary_dim dims of both
rotated NeoX-style by the rows' factors, k and v stored at the rows' cache slots. The torch sequence it replaces
(`qk_rope_kv_torch`, below: two norms, two rotations, LayerKV.write's slot arithmetic and three copies) is some
thirty small kernels per layer.

Roundings are the torch form's: each norm runs in fp32 and is rounded once to the activation dtype; the rotation
widens that to fp32, rounds each of its two products and their sum in fp32, and rounds the result once more to the
activation dtype. The GPU build has contraction off (`enable_fp_fusion=False`) so no product and sum fuse into an
FMA. A head's sum of squares is added in Triton's tree order, not torch's: the norm's fp32 result may differ in the
last bits (the tests' TOL gives the bound and its reason), which after the rounding to bf16 almost never shows.
Values are rounded to bf16 with integer ops (`bf16_grid`) because Triton's interpreter truncates on a bf16 cast.

One program per (row, head), the q heads first, then the KV heads: a KV program also copies its v and the head-0
one records the slot's position. A rotated dim needs its partner's normalized value; the program loads the
partner's input and weight again (the same cache lines) rather than shuffle registers, and scales them by the same
1/rms, so both halves are the very values the norm stored. Padding rows write the trash slot `slots` (slot_pos -1),
which no query reads; several padding rows write it in no defined order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..reference.layers import apply_rope, rms_norm
from .device import FLOATS as _FLOATS
from .launch import launch_options, wait_for_inputs
from .rmsnorm import _on_grid

MAX_HEAD_DIM = 1024
MAX_HEADS = 65535  # the grid's second dimension


@dataclass(frozen=True)
class QkRopeSettings:
    """Launch settings of `qk_rope_kv`. A head of 128 values is 4 a thread in one warp; more warps would only add
    a cross-warp reduction to each head's sum of squares."""

    num_warps: int = 1

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"QkRopeSettings: num_warps {self.num_warps} must be a power of two in 1..32")


def qk_rope_kv_fits(heads_q: int, heads_kv: int, head_dim: int, rotary_dim: int | None) -> bool:
    """Does `qk_rope_kv` take this layout (any number of rows does)? rotary_dim None: a layer without RoPE."""
    return (head_dim >= 2 and head_dim & (head_dim - 1) == 0 and head_dim <= MAX_HEAD_DIM
            and heads_q >= 1 and heads_kv >= 1 and heads_q + heads_kv <= MAX_HEADS
            and (rotary_dim is None or (rotary_dim >= 2 and rotary_dim % 2 == 0 and rotary_dim <= head_dim)))


@triton.jit
def _pairs(i, ROT: tl.constexpr):
    """NeoX halves of the first ROT dims: dim i's partner (whose value enters its rotation), the partner's sign
    (rotate_half: [-w, u]), and whether dim i rotates at all."""
    HALF: tl.constexpr = ROT // 2
    partner = tl.where(i < HALF, i + HALF, tl.where(i < ROT, i - HALF, i))
    return partner, tl.where(i < HALF, -1.0, 1.0), i < ROT


@triton.jit
def _head(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, D: tl.constexpr, ROT: tl.constexpr, ROPE: tl.constexpr,
          DT: tl.constexpr):
    """One head normalized and rotated: fp32 values on DT's grid. One row a program, as this module's kernel holds
    it (`head_rows` is the same over a tile of rows: here it would add layout conversions through shared memory)."""
    i = tl.arange(0, D)
    x = tl.load(x_ptr + i).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    n = _on_grid(x * rstd * tl.load(w_ptr + i).to(tl.float32), DT)
    if ROPE:
        partner, sign, rotates = _pairs(i, ROT)
        other = _on_grid(tl.load(x_ptr + partner).to(tl.float32) * rstd * tl.load(w_ptr + partner).to(tl.float32),
                         DT)
        c = tl.load(cos_ptr + i, mask=rotates, other=0.0)
        s = tl.load(sin_ptr + i, mask=rotates, other=0.0)
        n = tl.where(rotates, _on_grid(n * c + (other * sign) * s, DT), n)
    return n


@triton.jit
def separately(v, INTERP: tl.constexpr):
    """v, as a value the GPU compiler cannot fold into the add that reads it: the product rounds before the sum, as
    torch's does, in a kernel built with contraction on (kernels/qkv_rope_kv.py's, for its projection's sake). The
    interpreter never contracts."""
    if not INTERP:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)
    return v


@triton.jit
def head_rows(x_ptrs, w_ptr, cos_ptr, sin_ptr, rows, ok, stride_cos, stride_sin, eps, D: tl.constexpr,
              ROT: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """`_head` over a tile of rows, for a kernel holding several rows of a head at once (kernels/qkv_rope_kv.py's
    projection tile): rows of one head normalized and rotated (fp32 values on DT's grid): x_ptrs [N, D] points at each row's head,
    `rows` [N] are the rows of the factors cos/sin, `ok` [N] the rows to read. A rotated dim's partner is loaded again
    (the same cache lines) and scaled by the same 1/rms, so both halves are the very values the norm stores."""
    i = tl.arange(0, D)
    x = tl.load(x_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(separately(x * x, INTERP), axis=1) / D + eps)
    w = tl.load(w_ptr + i).to(tl.float32)
    n = _on_grid(x * rstd[:, None] * w[None, :], DT)
    if ROPE:
        partner, sign, rotates = _pairs(i, ROT)
        p = tl.load(x_ptrs + (partner - i)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        other = _on_grid(p * rstd[:, None] * tl.load(w_ptr + partner).to(tl.float32)[None, :], DT)
        rot_ok = ok[:, None] & rotates[None, :]
        c = tl.load(cos_ptr + rows[:, None] * stride_cos + i[None, :], mask=rot_ok, other=0.0)
        s = tl.load(sin_ptr + rows[:, None] * stride_sin + i[None, :], mask=rot_ok, other=0.0)
        turned = separately(n * c, INTERP) + separately((other * sign[None, :]) * s, INTERP)
        n = tl.where(rotates[None, :], _on_grid(turned, DT), n)
    return n


@triton.jit
def _qk_rope_kv_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr, out_ptr, ck_ptr,
                       cv_ptr, sp_ptr, HQ, HKV, SLOTS, eps, stride_q, stride_k, stride_v, stride_cos, stride_sin,
                       stride_o, D: tl.constexpr, ROT: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, D)
    cos_row, sin_row = cos_ptr + row * stride_cos, sin_ptr + row * stride_sin
    if head < HQ:
        n = _head(q_ptr + row * stride_q + head * D, qw_ptr, cos_row, sin_row, eps, D, ROT, ROPE, DT)
        tl.store(out_ptr + row * stride_o + head * D + i, n.to(DT))
    else:
        h = head - HQ
        pos = tl.load(pos_ptr + row)
        live = tl.load(live_ptr + row) != 0
        slot = tl.where(live, pos % SLOTS, SLOTS)
        n = _head(k_ptr + row * stride_k + h * D, kw_ptr, cos_row, sin_row, eps, D, ROT, ROPE, DT)
        dst = (slot * HKV + h) * D + i
        CK: tl.constexpr = ck_ptr.dtype.element_ty
        CV: tl.constexpr = cv_ptr.dtype.element_ty
        tl.store(ck_ptr + dst, _on_grid(n, CK).to(CK))
        v = tl.load(v_ptr + row * stride_v + h * D + i).to(tl.float32)
        tl.store(cv_ptr + dst, _on_grid(v, CV).to(CV))
        if h == 0:
            tl.store(sp_ptr + slot, tl.where(live, pos, -1))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"qk_rope_kv: {message}")


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
          eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor, live: torch.Tensor,
          cache_k: torch.Tensor, cache_v: torch.Tensor, slot_pos: torch.Tensor, out: torch.Tensor) -> int:
    """Refuse what `qk_rope_kv` (or a kernel ending in its prologue, kernels/qkv_rope_kv.py) cannot take; the cache's
    slots (the trash slot's index)."""
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be [R, heads, D]")
    R, HQ, D = q.shape
    HKV = k.shape[1]
    _check(tuple(k.shape) == (R, HKV, D) and tuple(v.shape) == (R, HKV, D),
           f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{R}, Hkv, {D}]")
    _check(q.dtype in _FLOATS and k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share a float dtype")
    _check((cos is None) == (sin is None), "cos and sin must both be given or both be None")
    rot = None if cos is None else cos.shape[-1]
    _check(qk_rope_kv_fits(HQ, HKV, D, rot), f"Hq {HQ}, Hkv {HKV}, head_dim {D}, rotary_dim {rot} is not a layout "
           f"it takes (qk_rope_kv_fits): head_dim a power of two <= {MAX_HEAD_DIM}, rotary_dim even and <= head_dim")
    dev = q.device
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.device == dev, f"{name} is on {t.device}, q on {dev}")
        _check(t.stride(2) == 1 and (t.stride(1) == D or t.shape[1] == 1),
               f"{name} must be dense within a row (strides [*, {D}, 1])")
    for name, t in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        _check(tuple(t.shape) == (D,) and t.dtype in _FLOATS and t.is_contiguous() and t.device == dev,
               f"{name} must be a contiguous float [{D}] on {dev}")
    _check(float(eps) >= 0.0, f"eps {eps} must be >= 0")
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            _check(t.dim() == 2 and tuple(t.shape) == (R, rot) and t.dtype == torch.float32 and t.device == dev
                   and (t.stride(1) == 1 or rot == 1), f"{name} must be fp32 [{R}, rotary_dim] (columns dense) on "
                   f"{dev}, got {t.dtype} {tuple(t.shape)}")
    slots = cache_k.shape[0] - 1 if cache_k.dim() == 3 else 0
    _check(slots >= 1 and tuple(cache_k.shape) == (slots + 1, HKV, D) and cache_v.shape == cache_k.shape
           and cache_k.dtype in _FLOATS and cache_v.dtype in _FLOATS, f"caches must be float [slots + 1, {HKV}, {D}]")
    _check(tuple(slot_pos.shape) == (slots + 1,) and slot_pos.dtype == torch.int64, "slot_pos must be int64 [slots + 1]")
    _check(tuple(positions.shape) == (R,) and positions.dtype == torch.int64, f"positions must be int64 [{R}]")
    _check(tuple(live.shape) == (R,) and live.dtype == torch.bool, f"live must be bool [{R}]")
    for name, t in (("positions", positions), ("live", live), ("cache_k", cache_k), ("cache_v", cache_v),
                    ("slot_pos", slot_pos)):
        _check(t.device == dev and t.is_contiguous(), f"{name} must be contiguous on {dev}")
    _check(tuple(out.shape) == (R, HQ, D) and out.dtype == q.dtype and out.device == dev and out.stride(2) == 1
           and (out.stride(1) == D or HQ == 1), f"out must be {q.dtype} [{R}, {HQ}, {D}], dense within a row")
    return slots


def qk_rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
               eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor,
               live: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slot_pos: torch.Tensor, *,
               out: torch.Tensor | None = None, settings: QkRopeSettings = QkRopeSettings(),
               pdl: bool = False) -> torch.Tensor:
    """q [R, Hq, D] normalized per head by q_norm_w [D] and rotated (returned, in q's dtype); k likewise with
    k_norm_w, stored with v at each row's slot of cache_k/cache_v [slots + 1, Hkv, D] (position % slots; padding
    rows, live False: the trash slot `slots`), slot_pos [slots + 1] int64 set to the position (-1 for padding rows).
    cos, sin: the rows' fp32 factors [R, rotary_dim] (rotary_dim = cos.shape[-1] first dims rotate), or both None
    for a layer without RoPE. q, k, v may be column views of one projection's rows (any row stride, dense within a
    row); `out` too, and may be q itself. `qk_rope_kv_torch` is the same sequence in torch."""
    if out is None and q.dim() == 3:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    slots = check(q, k, v, q_norm_w, k_norm_w, eps, cos, sin, positions, live, cache_k, cache_v, slot_pos,
                  out if out is not None else q)
    _check(isinstance(settings, QkRopeSettings), "settings must be a QkRopeSettings")
    R, HQ, D = q.shape
    HKV = k.shape[1]
    rot = None if cos is None else cos.shape[-1]
    if R == 0:
        return out
    options = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}  # torch's roundings
    cos_t, sin_t = (q, q) if cos is None else (cos, sin)  # never read without RoPE
    _qk_rope_kv_kernel[(R, HQ + HKV)](
        q, k, v, q_norm_w, k_norm_w, cos_t, sin_t, positions, live.view(torch.uint8), out, cache_k, cache_v,
        slot_pos, HQ, HKV, slots, float(eps), q.stride(0), k.stride(0), v.stride(0), cos_t.stride(0),
        sin_t.stride(0), out.stride(0), D=D, ROT=rot or 0, ROPE=cos is not None, num_warps=settings.num_warps,
        **options, **launch_options(pdl, q.device))
    return out


def qk_rope_kv_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor,
                     k_norm_w: torch.Tensor, eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     positions: torch.Tensor, live: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     slot_pos: torch.Tensor) -> torch.Tensor:
    """The torch sequence `qk_rope_kv` replaces (the caches and slot_pos updated in place; the rotated q
    returned)."""
    dtype = q.dtype
    q = rms_norm(q.float(), q_norm_w.float(), eps).to(dtype)
    k = rms_norm(k.float(), k_norm_w.float(), eps).to(dtype)
    if cos is not None:
        q = apply_rope(q.float(), cos, sin).to(dtype)
        k = apply_rope(k.float(), cos, sin).to(dtype)
    slots = cache_k.shape[0] - 1
    slot = torch.where(live, positions % slots, torch.full_like(positions, slots))
    cache_k.index_copy_(0, slot, k.to(cache_k.dtype))
    cache_v.index_copy_(0, slot, v.to(cache_v.dtype))
    slot_pos.index_copy_(0, slot, torch.where(live, positions, torch.full_like(positions, -1)))
    return q

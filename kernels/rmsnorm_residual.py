"""Fused residual add + RMSNorm: h = x + r (the new residual, in the residual's dtype), y = rmsnorm(h) * w;
and the same kernel without the residual (`rmsnorm`: the layer's input norm, one launch instead of six).

Not on the product path until re-based to docs/model.md: the fused tail is the retired, guessed architecture's
pre-norm residual (x + attn_out, then the post-attention norm); the published layer has sandwich norms (the branch
output normalized, scaled and added, the residual continued from the normalized input after layer 0), so
fast/triton_ops.py dispatches neither kernel and every published norm runs its torch form. Its tests hold it to its
own references (`rmsnorm_residual_ref`, `rmsnorm_ref`).

The decoder layer's `x = x + attn_out; b = rms_norm(x, post_norm)` in one pass over each row. The sum
is rounded to the residual's dtype first and the norm reads that rounded value, as the torch
sequence does; the norm itself runs in fp32 and `y` may be kept in fp32 (routing reads the fp32
normalized input, see fast/model.py). One program per row holds the whole row, so `residual_out`
may alias `x` or `residual` (update in place).

`f16_out` (the post-attention norm, whose y is the MoE's input): the kernel also writes y rounded to bf16 as the
MoE's Gate/Up fp16 operand tiles (kernels/f16_operands.py), once per row, instead of every Gate/Up program that
reads a tile rescaling it (ncu: ~14% of Gate/Up's instructions). Same values, so the same bits downstream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS
from .f16_operands import bf16_grid, f16_rows, tile_width
from .launch import launch_options, wait_for_inputs

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_residual_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, f16_ptr, f16d_ptr, H, eps,
                             stride_x, stride_r, stride_y, stride_h, stride_f16, stride_f16d,
                             BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, F16_TILE: tl.constexpr = 0,
                             PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    i = tl.arange(0, BLOCK)
    ok = i < H
    if PRELOAD:  # the norm's weight is constant: read before the wait, so its HBM latency overlaps the previous kernel
        w = tl.load(w_ptr + i, mask=ok, other=0.0)
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + i, mask=ok, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + i, h, mask=ok)
        h = h.to(tl.float32)
    else:
        h = x
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    if not PRELOAD:
        w = tl.load(w_ptr + i, mask=ok, other=0.0)
    y = (h * inv * w.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + i, y, mask=ok)
    if F16_TILE > 0:  # y's tiles as Gate/Up's fp16 operands: y rounded to bf16, scaled per tile by 2^s
        tiles = tl.arange(0, BLOCK // F16_TILE)
        y16, down = f16_rows(tl.reshape(bf16_grid(y.to(tl.float32)), [BLOCK // F16_TILE, F16_TILE]))
        col = tiles[:, None] * F16_TILE + tl.arange(0, F16_TILE)[None, :]
        tl.store(f16_ptr + row * stride_f16 + col, y16, mask=col < H)
        tl.store(f16d_ptr + row * stride_f16d + tiles, down, mask=tiles < H // F16_TILE)




def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"rmsnorm_residual: {message}")


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None, f16_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     num_warps: int = 8, pdl: bool = False, preload: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [R, H] in out_dtype (default residual's), h = x + residual [R, H] in residual's dtype). `preload`: the weight
    is read before the PDL wait (kernels/launch.py; the same values).
    `f16_out` = (fp16 [R, H], fp32 [R, H / t]) is filled with y rounded to bf16 as the MoE's Gate/Up operand tiles
    of width t (a power of two dividing H): `f16_operands.f16_rows_tiles(y.to(bf16), t)`."""
    _check(x.dim() == 2 and tuple(residual.shape) == tuple(x.shape), f"x {tuple(x.shape)} and residual "
           f"{tuple(residual.shape)} must be the same [R, H]")
    R, H = x.shape
    _check(R >= 1 and 1 <= H <= MAX_HIDDEN, f"rows {R} and hidden {H} must be >= 1 (hidden <= {MAX_HIDDEN})")
    _check(tuple(weight.shape) == (H,), f"weight must be [{H}], got {tuple(weight.shape)}")
    _check(x.dtype in _FLOATS and residual.dtype in _FLOATS and weight.dtype in _FLOATS,
           f"dtypes {x.dtype}, {residual.dtype}, {weight.dtype} must be bf16, fp16 or fp32")
    out_dtype = out_dtype or residual.dtype
    _check(out_dtype in _FLOATS, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    if out is None:
        out = torch.empty((R, H), dtype=out_dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty_like(residual)
    _check(tuple(out.shape) == (R, H) and out.dtype == out_dtype, f"out must be [{R}, {H}] {out_dtype}")
    _check(tuple(residual_out.shape) == (R, H) and residual_out.dtype == residual.dtype,
           f"residual_out must be [{R}, {H}] {residual.dtype}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("out", out), ("residual_out", residual_out)):
        _check(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        _check(t.stride(-1) == 1, f"{name} must have unit stride along the hidden dimension")
    _check(isinstance(eps, float) and eps > 0, f"eps must be a positive float, got {eps!r}")
    y16, down, tile = _check_f16_out(f16_out, R, H, out)
    _rmsnorm_residual_kernel[(R,)](x, residual, weight, out, residual_out, y16, down, H, eps, x.stride(0),
                                   residual.stride(0), out.stride(0), residual_out.stride(0), y16.stride(0),
                                   down.stride(0), BLOCK=triton.next_power_of_2(H), RESIDUAL=True, F16_TILE=tile,
                                   PRELOAD=preload, num_warps=num_warps, **launch_options(pdl, x.device))
    return out, residual_out


def _check_f16_out(f16_out, R: int, H: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(fp16 tiles, their 2^-s, tile width); without f16_out, `out` twice and width 0 (pointers left unused)."""
    if f16_out is None:
        return out, out, 0
    return (*f16_out, tile_width(f16_out, R, H, out.device, "rmsnorm_residual: f16_out"))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None, *,
            out: torch.Tensor | None = None, num_warps: int = 8, pdl: bool = False, preload: bool = False) -> torch.Tensor:
    """y = rmsnorm(x) * w [R, H] in out_dtype (default x's), computed in fp32 from x (no residual); `preload` as
    rmsnorm_residual's."""
    _check(x.dim() == 2, f"x must be [R, H], got {tuple(x.shape)}")
    R, H = x.shape
    _check(R >= 1 and 1 <= H <= MAX_HIDDEN, f"rows {R} and hidden {H} must be >= 1 (hidden <= {MAX_HIDDEN})")
    _check(tuple(weight.shape) == (H,), f"weight must be [{H}], got {tuple(weight.shape)}")
    _check(x.dtype in _FLOATS and weight.dtype in _FLOATS, f"dtypes {x.dtype}, {weight.dtype} must be bf16, fp16 or fp32")
    out_dtype = out_dtype or x.dtype
    _check(out_dtype in _FLOATS, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    if out is None:
        out = torch.empty((R, H), dtype=out_dtype, device=x.device)
    _check(tuple(out.shape) == (R, H) and out.dtype == out_dtype, f"out must be [{R}, {H}] {out_dtype}")
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        _check(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
        _check(t.stride(-1) == 1, f"{name} must have unit stride along the hidden dimension")
    _check(isinstance(eps, float) and eps > 0, f"eps must be a positive float, got {eps!r}")
    _rmsnorm_residual_kernel[(R,)](x, x, weight, out, out, out, out, H, eps, x.stride(0), x.stride(0), out.stride(0),
                                   out.stride(0), 0, 0, BLOCK=triton.next_power_of_2(H), RESIDUAL=False,
                                   PRELOAD=preload, num_warps=num_warps, **launch_options(pdl, x.device))
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference rms_norm of x in fp32, rounded to out_dtype (default x's)."""
    from ..reference.layers import rms_norm

    return rms_norm(x.float(), weight.float(), eps).to(out_dtype or x.dtype)


def rmsnorm_residual_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = (x + residual) rounded to residual's dtype; y = reference rms_norm of h in fp32."""
    from ..reference.layers import rms_norm

    h = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm(h.float(), weight.float(), eps).to(out_dtype or residual.dtype), h

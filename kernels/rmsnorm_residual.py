"""Fused residual add + RMSNorm: h = x + r (the new residual, in the residual's dtype), y = rmsnorm(h) * w;
and the same kernel without the residual (`rmsnorm`: the layer's input norm, one launch instead of six).

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
from .router import INTERPRETED, PART_CHUNK, rank_row, sum_parts, weigh_row

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_residual_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, f16_ptr, f16d_ptr, H, eps,
                             stride_x, stride_r, stride_y, stride_h, stride_f16, stride_f16d,
                             BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, F16_TILE: tl.constexpr = 0,
                             PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                             part_ptr=None, weights_ptr=None, experts_ptr=None, scores_ptr=None, E=0, splits=0,
                             scaling=1.0, ROUTE: tl.constexpr = False, E_PAD: tl.constexpr = 1,
                             SPLIT_BLOCK: tl.constexpr = 1, TOP_K: tl.constexpr = 1, K_PAD: tl.constexpr = 1,
                             NORM_TOPK: tl.constexpr = False, ACCURATE_EXP: tl.constexpr = False,
                             EARLY_PARTS: tl.constexpr = False):
    i = tl.arange(0, BLOCK)
    ok = i < H
    row = tl.program_id(0)
    if PRELOAD:  # the norm's weight is constant: read before the wait, so its HBM latency overlaps the previous kernel
        w = tl.load(w_ptr + i, mask=ok, other=0.0)
    if ROUTE and EARLY_PARTS:  # written two launches back (kernels/router_fold.py): summed and ranked before the wait
        raw = sum_parts(part_ptr, row, tl.num_programs(0), E, splits, E_PAD, SPLIT_BLOCK)
        sel_e, sel_v = rank_row(raw, E, E_PAD, TOP_K, K_PAD)
    wait_for_inputs(PDL)
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
    if ROUTE:  # stage route_fold: the row's folded router logits (kernels/router_fold.py) scaled by this 1 / rms
        if not EARLY_PARTS:
            raw = sum_parts(part_ptr, row, tl.num_programs(0), E, splits, E_PAD, SPLIT_BLOCK)
            sel_e, sel_v = rank_row(raw, E, E_PAD, TOP_K, K_PAD)
        # the experts are ranked on the unscaled sum (1 / rms > 0 keeps its order): only the weights need 1 / rms
        weigh_row(raw, inv, sel_e, sel_v, row, weights_ptr, experts_ptr, scores_ptr, E, scaling, E_PAD, TOP_K, K_PAD,
                  NORM_TOPK, ACCURATE_EXP)




def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"rmsnorm_residual: {message}")


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None, f16_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     num_warps: int = 8, pdl: bool = False, preload: bool = False,
                     _route: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
                                   PRELOAD=preload, num_warps=num_warps, **(_route or {}),
                                   **launch_options(pdl, x.device))
    return out, residual_out


def rmsnorm_residual_route(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           part: torch.Tensor, top_k: int, norm_topk_prob: bool, scaling: float, *,
                           f16_out: tuple[torch.Tensor, torch.Tensor] | None = None, num_warps: int = 8,
                           pdl: bool = False, preload: bool = False, early: bool = False) -> tuple[torch.Tensor, ...]:
    """`rmsnorm_residual` with fp32 y and the layer's routing (stage route_fold): the folded router logits, the sum of
    part [S, R, E] (kernels/router_fold.route_parts) times the row's 1 / rms: softmax scores, the top-k ranked on the
    unscaled sum (ties to the lower index; with `early`, before the wait), weights normalized if `norm_topk_prob`,
    times `scaling`. Returns
    (y [R, H] fp32, h [R, H], weights [R, k] fp32, experts [R, k] int64, scores [R, E] fp32). `early`: `part` was
    written two launches back or earlier (kernels/launch.py): it is read and summed before the PDL wait."""
    _check(x.dim() == 2 and tuple(residual.shape) == tuple(x.shape), f"x {tuple(x.shape)} and residual "
           f"{tuple(residual.shape)} must be the same [R, H]")
    R, H = x.shape
    _check(isinstance(part, torch.Tensor) and part.dim() == 3 and part.shape[1] == R and part.dtype == torch.float32
           and part.is_contiguous() and part.device == x.device,
           f"part must be a contiguous [S, {R}, E] fp32 on {x.device}, got {tuple(part.shape)} {part.dtype}")
    S, _, E = part.shape
    _check(isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= E,
           f"top_k {top_k!r} must be an int in 1..{E}")
    _check(isinstance(norm_topk_prob, bool), f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    _check(isinstance(scaling, (int, float)) and not isinstance(scaling, bool), f"scaling must be a float, got {scaling!r}")
    dev = x.device
    weights = torch.empty((R, top_k), dtype=torch.float32, device=dev)
    experts = torch.empty((R, top_k), dtype=torch.int64, device=dev)
    scores = torch.empty((R, E), dtype=torch.float32, device=dev)
    e_pad = triton.next_power_of_2(E)
    route = dict(part_ptr=part, weights_ptr=weights, experts_ptr=experts, scores_ptr=scores, E=E, splits=S,
                 scaling=float(scaling), ROUTE=True, E_PAD=e_pad,
                 SPLIT_BLOCK=max(1, min(triton.next_power_of_2(S), PART_CHUNK // e_pad)), TOP_K=top_k,
                 K_PAD=triton.next_power_of_2(top_k), NORM_TOPK=norm_topk_prob, ACCURATE_EXP=not INTERPRETED,
                 EARLY_PARTS=early)
    y, h = rmsnorm_residual(x, residual, weight, eps, torch.float32, f16_out=f16_out, num_warps=num_warps, pdl=pdl,
                            preload=preload, _route=route)
    return y, h, weights, experts, scores


def rmsnorm_residual_route_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                               scaling: float) -> tuple[torch.Tensor, ...]:
    """The torch sequence: h = x + residual rounded to its dtype, y = rms_norm(h) * w in fp32, and routing on
    `logits` [R, E] (the folded sum) times h's 1 / rms (fast/ops.py's fallback of stage route_fold)."""
    from ..reference.layers import route

    h = (x.float() + residual.float()).to(residual.dtype)
    hf = h.float()
    inv = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = hf * inv * weight.float()
    return (y, h, *route(logits.float() * inv, top_k, norm_topk_prob, scaling))


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

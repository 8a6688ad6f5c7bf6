"""The published layer's norms (docs/model.md, "Forward"): a plain RMSNorm (`rmsnorm`), and the sandwich tail
(`add_norm`): the branch output normalized, scaled and added to the residual, and the sum normalized for the next
consumer, in one launch instead of the torch sequence's fifteen or so elementwise kernels.

Both are the torch forms `rmsnorm_torch` / `add_norm_torch` (below) with the same roundings: every norm runs in
fp32 and is rounded once to its output dtype; the branch is rounded to the residual's dtype, scaled and rounded
again (when the scale is not 1), added and rounded again, and the next norm reads that rounded sum, as
fast/model.py's `_scaled_add` and `TorchOps.norm` do. The GPU build has floating-point contraction off
(`enable_fp_fusion=False`), so no multiply and add fuse into one rounding that torch makes two of.

One difference is left, by design: a row's sum of squares is added in Triton's tree order, not torch's, so a norm's
fp32 result may differ from torch's in its last bits (see the tests' TOL for the bound and its reason); rounded to
bf16 that almost never shows. Values are rounded to bf16 with integer ops (`bf16_grid`), because Triton's
interpreter truncates on a bf16 cast: the interpreted CPU tests then see the GPU's roundings.

One program per row holds the whole row in registers (H = 3072 at full size), so an output may alias an input of
its own row (the new residual written over the old one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..reference.layers import rms_norm
from .device import FLOATS as _FLOATS
from .bf16_round import bf16_grid
from .launch import launch_options, wait_for_inputs

MAX_HIDDEN = 16384  # a row lives in registers: 64 fp32 values a thread at 8 warps, before spilling gets likely


@dataclass(frozen=True)
class RmsNormSettings:
    """Launch settings of `rmsnorm` and `add_norm`. A row of 3072 padded to 4096 is 16 values a thread at 8 warps:
    few enough to stay in registers, enough threads to hide a row's load latency."""

    num_warps: int = 8

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"RmsNormSettings: num_warps {self.num_warps} must be a power of two in 1..32")


def rmsnorm_fits(hidden: int) -> bool:
    """Does a row of `hidden` values fit one program's registers?"""
    return 1 <= hidden <= MAX_HIDDEN


@triton.jit
def _on_grid(v, DT: tl.constexpr):
    """fp32 v rounded to nearest-even in DT, kept fp32 so the next op computes in fp32 as torch's opmath does."""
    if DT == tl.bfloat16:
        v = bf16_grid(v)
    elif DT == tl.float16:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _norm_row(x, w, eps, H):
    """RMSNorm of one fp32 row (zeros past H), unrounded: (x * rsqrt(mean(x^2) + eps)) * w, torch's product order."""
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    return x * rstd * w


@triton.jit
def _branch(y, yw, eps, H, Y_NORM: tl.constexpr, DT: tl.constexpr):
    """What the residual receives from the branch before the scale: its normalized output, rounded to DT (layer 0's
    MLP and every attention branch), or the output itself."""
    if Y_NORM:
        y = _on_grid(_norm_row(y, yw, eps, H), DT)
    return y


@triton.jit
def _residual_add(res, t, scale, SCALED: tl.constexpr, RDT: tl.constexpr):
    """residual + t * scale, each op rounded to the residual's dtype (a scale of 1 skipped: it rounds nowhere)."""
    t = _on_grid(t, RDT)
    if SCALED:
        t = _on_grid(t * scale, RDT)
    return _on_grid(res + t, RDT)


@triton.jit
def tail_weights(yw_ptr, nw_ptr, i, m, Y_NORM: tl.constexpr):
    """The sandwich tail's two norm weights as fp32 rows (the branch norm's only with Y_NORM; constants, so a kernel
    may read them before its wait)."""
    nw = tl.load(nw_ptr + i, mask=m, other=0.0).to(tl.float32)
    if Y_NORM:
        yw = tl.load(yw_ptr + i, mask=m, other=0.0).to(tl.float32)
    else:
        yw = nw  # unread: _branch passes y through
    return yw, nw


@triton.jit
def sandwich_tail(res, y, yw, nw, eps, scale, H, Y_NORM: tl.constexpr, SCALED: tl.constexpr, RDT: tl.constexpr,
                  DT: tl.constexpr):
    """One row's sandwich tail in fp32 on the dtypes' grids: (h = res + branch(y) * scale in RDT, b = the next norm of
    h in DT). The one definition `add_norm` and the peer all-reduce's fused tail (kernels/allreduce.py) share, so the
    two give the same bits at the same BLOCK and warps."""
    h = _residual_add(res, _branch(y, yw, eps, H, Y_NORM, DT), scale, SCALED, RDT)
    return h, _on_grid(_norm_row(h, nw, eps, H), DT)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, H, eps, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < H
    x = tl.load(x_ptr + row * stride_x + i, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    ODT: tl.constexpr = o_ptr.dtype.element_ty
    tl.store(o_ptr + row * stride_o + i, _on_grid(_norm_row(x, w, eps, H), ODT).to(ODT), mask=m)


@triton.jit
def _add_norm_kernel(r_ptr, y_ptr, yw_ptr, nw_ptr, h_ptr, b_ptr, H, eps, scale, stride_r, stride_y, stride_h,
                     stride_b, BLOCK: tl.constexpr, Y_NORM: tl.constexpr, SCALED: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    RDT: tl.constexpr = h_ptr.dtype.element_ty
    DT: tl.constexpr = b_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < H
    yw, nw = tail_weights(yw_ptr, nw_ptr, i, m, Y_NORM)
    y = tl.load(y_ptr + row * stride_y + i, mask=m, other=0.0).to(tl.float32)
    res = tl.load(r_ptr + row * stride_r + i, mask=m, other=0.0).to(tl.float32)
    h, b = sandwich_tail(res, y, yw, nw, eps, scale, H, Y_NORM, SCALED, RDT, DT)
    tl.store(h_ptr + row * stride_h + i, h.to(RDT), mask=m)
    tl.store(b_ptr + row * stride_b + i, b.to(DT), mask=m)


def _check(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {message}")


def _rows(t: torch.Tensor, name: str, op: str, R: int | None = None, H: int | None = None) -> None:
    """A float [R, H] whose rows may sit anywhere (a column view of a wider row) but whose columns are dense."""
    _check(t.dim() == 2 and t.dtype in _FLOATS, op, f"{name} must be a float [rows, hidden], got {t.dtype} "
           f"{tuple(t.shape)}")
    _check((R is None or t.shape[0] == R) and (H is None or t.shape[1] == H), op,
           f"{name} {tuple(t.shape)} must be [{R}, {H}]")
    _check(t.stride(1) == 1 or t.shape[1] == 1, op, f"{name} must have unit column stride")


def _weight(w: torch.Tensor, name: str, op: str, H: int, device: torch.device) -> None:
    _check(tuple(w.shape) == (H,) and w.dtype in _FLOATS and w.is_contiguous(), op,
           f"{name} must be a contiguous float [{H}], got {w.dtype} {tuple(w.shape)}")
    _check(w.device == device, op, f"{name} is on {w.device}, the rows on {device}")


def _common(x: torch.Tensor, eps: float, op: str, settings: RmsNormSettings) -> tuple[int, int, dict]:
    R, H = x.shape
    _check(rmsnorm_fits(H), op, f"hidden {H} must be 1..{MAX_HIDDEN} (rmsnorm_fits)")
    _check(float(eps) >= 0.0 and float(eps) == float(eps), op, f"eps {eps} must be >= 0")
    _check(isinstance(settings, RmsNormSettings), op, "settings must be an RmsNormSettings")
    return R, triton.next_power_of_2(H), compile_options(settings)


def compile_options(settings: RmsNormSettings) -> dict:
    """The build of a kernel with a norm of a row of BLOCK = next_power_of_2(H): torch rounds each product and sum, so
    the GPU build must not contract them into FMAs (the interpreter never does); and a row's sum of squares is added
    in the order its layout gives, set by BLOCK and the warps, so kernels sharing `sandwich_tail` share these."""
    options = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
    return dict(options, num_warps=settings.num_warps)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None, *,
            out: torch.Tensor | None = None, settings: RmsNormSettings = RmsNormSettings(),
            pdl: bool = False) -> torch.Tensor:
    """rms_norm(x.float(), w.float(), eps).to(out_dtype) over the last dim of x [R, H] (`rmsnorm_torch`); out_dtype
    None: x's. `out` [R, H] may be a column view (e.g. one half of a wider row); x's rows may be strided too."""
    op = "rmsnorm"
    _rows(x, "x", op)
    R, H = x.shape
    _weight(w, "w", op, H, x.device)
    out_dtype = out_dtype or x.dtype
    _check(out_dtype in _FLOATS, op, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    if out is None:
        out = torch.empty((R, H), dtype=out_dtype, device=x.device)
    _rows(out, "out", op, R, H)
    _check(out.dtype == out_dtype and out.device == x.device, op, f"out must be {out_dtype} on {x.device}")
    R, block, options = _common(x, eps, op, settings)
    if R:
        _rmsnorm_kernel[(R,)](x, w, out, H, float(eps), x.stride(0), out.stride(0), BLOCK=block, **options,
                              **launch_options(pdl, x.device))
    return out


def check_tail(op: str, residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm_w: torch.Tensor | None,
               next_norm_w: torch.Tensor, eps: float, dtype: torch.dtype) -> float:
    """Refuse a sandwich tail's arguments that `add_norm` (or a kernel ending in its tail) cannot take; the scale as
    a float."""
    _rows(residual, "residual", op)
    R, H = residual.shape
    _check(rmsnorm_fits(H), op, f"hidden {H} must be 1..{MAX_HIDDEN} (rmsnorm_fits)")
    _rows(y, "y", op, R, H)
    _check(y.device == residual.device, op, f"y is on {y.device}, residual on {residual.device}")
    if y_norm_w is not None:
        _weight(y_norm_w, "y_norm_w", op, H, residual.device)
    _weight(next_norm_w, "next_norm_w", op, H, residual.device)
    _check(dtype in _FLOATS, op, f"dtype {dtype} must be bf16, fp16 or fp32")
    _check(float(eps) >= 0.0 and float(eps) == float(eps), op, f"eps {eps} must be >= 0")
    scale = float(scale)
    _check(scale == scale and abs(scale) != float("inf"), op, f"scale {scale} must be finite")
    return scale


def add_norm(residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm_w: torch.Tensor | None,
             next_norm_w: torch.Tensor, eps: float, dtype: torch.dtype, *, h_out: torch.Tensor | None = None,
             b_out: torch.Tensor | None = None, settings: RmsNormSettings = RmsNormSettings(),
             pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sandwich tail (`add_norm_torch`): h = residual + branch * scale in residual's dtype (the branch: y
    normalized by y_norm_w and rounded to `dtype`, or y itself when y_norm_w is None), and b = the next norm of h,
    rounded to `dtype`. residual [R, H] fp32 (the draft's stream) or `dtype`; y [R, H] any float dtype. `h_out`
    (residual's dtype) may be `residual` itself: the update in place. Rows may be strided, columns dense."""
    op = "add_norm"
    scale = check_tail(op, residual, y, scale, y_norm_w, next_norm_w, eps, dtype)
    R, H = residual.shape
    h = torch.empty((R, H), dtype=residual.dtype, device=residual.device) if h_out is None else h_out
    b = torch.empty((R, H), dtype=dtype, device=residual.device) if b_out is None else b_out
    _rows(h, "h_out", op, R, H)
    _rows(b, "b_out", op, R, H)
    _check(h.dtype == residual.dtype and h.device == residual.device, op,
           f"h_out must be {residual.dtype} on {residual.device}")
    _check(b.dtype == dtype and b.device == residual.device, op, f"b_out must be {dtype} on {residual.device}")
    R, block, options = _common(residual, eps, op, settings)
    if R:
        _add_norm_kernel[(R,)](residual, y, y if y_norm_w is None else y_norm_w, next_norm_w, h, b, H, float(eps),
                               scale, residual.stride(0), y.stride(0), h.stride(0), b.stride(0), BLOCK=block,
                               Y_NORM=y_norm_w is not None, SCALED=scale != 1.0, **options,
                               **launch_options(pdl, residual.device))
    return h, b


# ---- the torch forms (what the kernels replace; fast/torch_ops.py may call these) ---------------------------------


def rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return rms_norm(x.float(), w.float(), eps).to(out_dtype or x.dtype)


def add_norm_torch(residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm_w: torch.Tensor | None,
                   next_norm_w: torch.Tensor, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    t = y if y_norm_w is None else rms_norm(y.float(), y_norm_w.float(), eps).to(dtype)
    t = t.to(residual.dtype)
    h = residual + (t if scale == 1.0 else t * scale)
    return h, rms_norm(h.float(), next_norm_w.float(), eps).to(dtype)

"""LM head: logits [R, V] fp32 = x [R, H] @ W^T for a few rows (R = 1..8), reading W in bf16.

Not on the product path until re-based to docs/model.md: written for the retired, guessed architecture's bf16-held
head (and its optional fused final norm), it is no longer dispatched by fast/triton_ops.py; the published heads
(the target's and the draft's own, fp32 products with the weights held in fp32 by fast/weights.py) run their torch
form. Its tests hold it to its own reference (`lm_head_ref`).

The rank's LM head rows are bf16 in the checkpoint. Every bf16 value converts to fp32 exactly, so
`x.float() @ W.float().T` (the engine's fp32 product) is a sum of products of the same values; this
kernel streams the bf16 rows (half the bytes of an fp32 copy) and multiplies them exactly:

- bf16 x: one tensor-core dot per K tile; a product of two bf16 values (8-bit significands) is exact
  in fp32 and the accumulator is fp32.
- fp32 (or fp16) x: x is split in registers into bf16 parts, x = hi + mid + lo (fp16: hi + mid), each
  part the rounding of what the previous ones leave. The split is exact (24 significant bits in three
  8-bit parts; it holds with truncation too, which is how Triton's interpreter converts), so the
  three dots add exactly the products x[k] * W[k] split in three, in fp32. When x holds bf16 values
  (the engine's `rms_norm(...).float()`), mid and lo are zero and the result is the bf16 path's.
- fp16 / fp32 W: both operands in fp32, `input_precision="ieee"` (no tf32), W read at its own width.

So only the order of the fp32 additions differs from cuBLAS. Grid: (V tiles of BLOCK_V, R tiles of
16); each program reads its [BLOCK_V, H] weight rows once, K tile by K tile, for all of its rows
(tl.dot needs 16 rows; rows >= R are masked, so they load nothing). The last V tile is partial: its
loads re-read row V-1 (no masks in the weight stream) and its stores are masked. The K tail (H not a
multiple of BLOCK_K) is one masked step after the unmasked loop. No atomics (deterministic), no host
reads (graph-capturable).

The final RMSNorm is not fused: the engine's `rms_norm` rounds mean(x^2) to bf16 after an fp32 sum
whose order torch does not fix, so an in-kernel sum would sometimes land on the other side of a
bf16 rounding boundary and scale that row's logits by one bf16 step (~0.4%). `norm_weight`/`eps`
apply reference/layers.rms_norm (the engine's torch ops, bit for bit) before the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, sm_count as _sm_count
from .launch import launch_options, wait_for_inputs

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): the bf16
# parts are upcast to fp32 (exactly) before the dot there.
INTERPRETED = bool(triton.knobs.runtime.interpret)
BLOCK_R = 16  # tl.dot's smallest M; decode blocks have 1..8 rows
PROGRAMS_PER_SM = 4  # choose_block_v: the largest V tile that still gives this many programs per SM


@triton.jit
def _dot_part(acc, part, wt, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter: fp32 operands holding the bf16 values (wt upcast by the caller)
        acc = tl.dot(part.to(tl.float32), wt, acc, input_precision="ieee")
    else:  # bf16 x bf16 on tensor cores (input_precision only concerns fp32 operands)
        acc = tl.dot(part, wt, acc)
    return acc


@triton.jit
def _accumulate(acc, x, w, X_PARTS: tl.constexpr, UPCAST: tl.constexpr):
    """acc [BLOCK_R, BLOCK_V] += x [BLOCK_R, BLOCK_K] @ w [BLOCK_V, BLOCK_K]^T, exact products, fp32 sums."""
    wt = tl.trans(w)
    if X_PARTS == 0:  # W not bf16: fp32 operands, fp32 FMA (ieee, never tf32)
        acc = tl.dot(x.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
    else:
        if UPCAST:
            wt = wt.to(tl.float32)
        if X_PARTS == 1:  # x is bf16
            acc = _dot_part(acc, x, wt, UPCAST)
        else:
            xf = x.to(tl.float32)
            hi = xf.to(tl.bfloat16)
            rest = xf - hi.to(tl.float32)  # exact
            acc = _dot_part(acc, hi, wt, UPCAST)
            mid = rest.to(tl.bfloat16)
            acc = _dot_part(acc, mid, wt, UPCAST)
            if X_PARTS == 3:
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact: what is left fits 8 bits
                acc = _dot_part(acc, lo, wt, UPCAST)
    return acc


@triton.jit
def _lm_head_kernel(x_ptr, w_ptr, y_ptr, R, V, H, stride_x, stride_w, stride_y,
                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    X_PARTS: tl.constexpr, UPCAST: tl.constexpr,
                    PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    pid_v = tl.program_id(0)
    pid_r = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    r_ok = rows < R
    k = tl.arange(0, BLOCK_K)
    # The partial last V tile re-reads row V-1 (never stored): the weight loads carry no mask.
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :]
    w_ptrs = w_ptr + tl.minimum(cols, V - 1)[:, None].to(tl.int64) * stride_w + k[None, :]

    acc = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    k_full = (H // BLOCK_K) * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=r_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + k0)
        acc = _accumulate(acc, x, w, X_PARTS, UPCAST)
    if k_full < H:  # the K tail
        k_ok = (k_full + k) < H
        x = tl.load(x_ptrs + k_full, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k_full, mask=k_ok[None, :], other=0.0)
        acc = _accumulate(acc, x, w, X_PARTS, UPCAST)

    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, acc, mask=r_ok[:, None] & (cols < V)[None, :])


# ---- host wrapper ----------------------------------------------------------------------------------
_X_PARTS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}  # bf16 parts that hold x exactly


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"lm_head: {message}")


def choose_block_v(v: int, device: torch.device) -> int:
    """The largest V tile in (128, 64, 32) giving >= PROGRAMS_PER_SM programs per SM, else 16: fine enough that
    the last partial wave is small (V = 20000 on 132 SMs: 32, 625 programs)."""
    programs = PROGRAMS_PER_SM * _sm_count(device)
    for bv in (128, 64, 32):
        if triton.cdiv(v, bv) >= programs:
            return bv
    return 16


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, H: int, x_parts: int, block_v: int,
            block_k: int, num_warps: int, num_stages: int, pdl: bool = False) -> None:
    R, V = out.shape
    grid = (triton.cdiv(V, block_v), triton.cdiv(R, BLOCK_R))
    _lm_head_kernel[grid](x, weight, out, R, V, H, x.stride(0), weight.stride(0), out.stride(0),
                          BLOCK_R=BLOCK_R, BLOCK_V=block_v, BLOCK_K=block_k, X_PARTS=x_parts, UPCAST=INTERPRETED,
                          num_warps=num_warps, num_stages=num_stages, **launch_options(pdl, x.device))


def lm_head(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float | None = None,
            *, out: torch.Tensor | None = None, block_v: int | None = None, block_k: int = 128, num_warps: int = 4,
            num_stages: int = 4, pdl: bool = False) -> torch.Tensor:
    """Logits [R, V] fp32 = x.float() @ weight.float().T, fp32 accumulation, exact products.

    x [R, H] bf16 / fp16 / fp32 (unit stride along H); weight [V, H] bf16 (the fast path; fp16 / fp32
    accepted), unit stride along H. With `norm_weight` [H] and `eps`, x is first replaced by
    reference/layers.rms_norm(x, norm_weight, eps) (torch ops in x's dtype, as the engine does; not fused).
    `out`: [R, V] fp32 with unit stride along V (rows may be strided). `block_v` defaults to choose_block_v."""
    _check(x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D")
    R, H = x.shape
    V, Hw = weight.shape
    _check(Hw == H, f"x has hidden size {H}, weight has {Hw}")
    _check(R >= 1 and V >= 1 and H >= 1, f"empty operand: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    _check(x.dtype in _FLOATS, f"x dtype {x.dtype} must be bf16, fp16 or fp32")
    _check(weight.dtype in _FLOATS, f"weight dtype {weight.dtype} must be bf16, fp16 or fp32")
    _check(x.device == weight.device, f"x is on {x.device}, weight on {weight.device}")
    _check(x.stride(1) == 1 or H == 1, "x must have unit stride along the hidden dimension")
    _check(weight.stride(1) == 1 or H == 1, "weight must have unit stride along the hidden dimension")
    if norm_weight is not None or eps is not None:
        _check(norm_weight is not None and eps is not None, "norm_weight and eps go together")
        _check(tuple(norm_weight.shape) == (H,) and norm_weight.dtype in _FLOATS,
               f"norm_weight must be [{H}] bf16, fp16 or fp32, got {tuple(norm_weight.shape)} {norm_weight.dtype}")
        _check(norm_weight.device == x.device, f"norm_weight is on {norm_weight.device}, x on {x.device}")
        _check(isinstance(eps, float) and eps > 0, f"eps must be a positive float, got {eps!r}")
    if out is None:
        out = torch.empty((R, V), dtype=torch.float32, device=x.device)
    _check(tuple(out.shape) == (R, V) and out.dtype == torch.float32, f"out must be [{R}, {V}] fp32, got "
           f"{tuple(out.shape)} {out.dtype}")
    _check(out.device == x.device, f"out is on {out.device}, x on {x.device}")
    _check(out.stride(1) == 1 or V == 1, "out must have unit stride along the vocabulary dimension")
    if block_v is None:
        block_v = choose_block_v(V, x.device)
    for name, b in (("block_v", block_v), ("block_k", block_k)):
        _check(isinstance(b, int) and b >= 16 and b & (b - 1) == 0, f"{name} {b!r} must be a power of two >= 16")

    if norm_weight is not None:
        from ..reference.layers import rms_norm

        x = rms_norm(x, norm_weight, eps)
    x_parts = _X_PARTS[x.dtype] if weight.dtype == torch.bfloat16 else 0
    _launch(x, weight, out, H, x_parts, block_v, block_k, num_warps, num_stages, pdl)
    return out


# ---- reference -------------------------------------------------------------------------------------
def lm_head_ref(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                eps: float | None = None) -> torch.Tensor:
    """The engine's product (fast/model.FastModel.logits): [rms_norm in x's dtype, then] x.float() @ W.float().T."""
    if norm_weight is not None:
        from ..reference.layers import rms_norm

        x = rms_norm(x, norm_weight, eps)
    return x.float() @ weight.float().T

"""The router folded into the attention tail (seed: "Fold routing into the attention tail"; stage route_fold).

A layer routes on b = rmsnorm(h2) * g2 with h2 = x + o, o = W_o a (x the residual stream entering the layer, a the
attention output that o_proj takes, g2 the post-attention norm's weight). The router is linear and the norm's
1 / rms(h2) is one positive factor a row, so

    logits = W_r b = (1 / rms(h2)) * ( W_r (g2 * x)  +  F a ),     F = W_r diag(g2) W_o   [E, A]

where F is made once from the weights (`fold_weight`: float64 products, rounded to fp32 once). Both terms exist
before o_proj runs: this launch computes them as partial logits, and the norm after o_proj scales their sum by its
1 / rms and selects the experts (kernels/rmsnorm_residual.rmsnorm_residual_route), so the layer launches two kernels
fewer than router logits + selection after the norm (kernels/router.py).

A numerical change, qualified as one: the router sees the unrounded x + W_o a, where the unfolded engine routes on
h2 rounded to the compute dtype with o rounded before the add, and the sums run in another order. The norm ranks
the experts on the unscaled sum, before its 1 / rms is known (router.rank_row: a positive factor keeps the order, so
the choice differs from ranking the scores only where rounding makes two scores equal), and then forms the scores and
weights as the unfolded kernel does (router.weigh_row). x * g2 is exact in fp32 for bf16 x and
g2 (two 8-bit significands), so the first term is the fp32 FMA tree of exact products, as router.py's.

One launch, grid (E tiles, splits of H then splits of A, row blocks), one warp a program as router.py's logits
kernel: a split is one BLOCK_H-wide tile of W_r (bf16) or of F (fp32), loaded into registers before the PDL wait
(`preload`: constant weights), and each program writes fp32 partials part [S, R, E] of its rows: splits of H first,
then of A. Fixed grid, no atomics: replays are bit-identical to eager runs.

With PDL (kernels/launch.py) the stream's term does not wait at all (`early`: x was written launches ago), and o_proj,
launched next, reads the attention output it shares with this launch's A splits before its own wait
(fp8_linear(early_x=)), so the two run side by side; the norm after o_proj reads these partials before its wait too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, wait_for_inputs
from .router import MAX_EXPERTS, MAX_ROWS, _rows_dot

BLOCK_E = 4
BLOCK_H = 512


@triton.jit
def _rows_dot_scaled(acc, w, x_ptr, g, r0, R, stride_x, h, h_ok, rows, ROWS: tl.constexpr):
    """acc[:, i] += w @ (g * x[r0 + i, h]) for the block's rows (g fp32 [BLOCK_H], the product exact for bf16 x, g)."""
    w = w.to(tl.float32)
    for i in tl.static_range(ROWS):
        x = tl.load(x_ptr + (r0 + i) * stride_x + h, mask=h_ok & (r0 + i < R), other=0.0).to(tl.float32) * g
        acc = tl.where(rows[None, :] == i, acc + tl.sum(w * x[None, :], axis=1)[:, None], acc)
    return acc


@triton.jit
def _route_parts_kernel(x_ptr, g_ptr, a_ptr, w_ptr, f_ptr, part_ptr, R, E, H, A, stride_x, stride_a, splits_h,
                        ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False, DROP_A: tl.constexpr = False,
                        EARLY: tl.constexpr = False):
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    rows = tl.arange(0, ROWS_PAD)
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_E, ROWS_PAD], tl.float32)  # acc[e, i]: row r0 + i
    if pid_s < splits_h:  # W_r (g2 * x): the router's bf16 tile, the norm weight's columns
        h = pid_s * BLOCK_H + cols
        h_ok = h < H
        if EARLY:  # x was written two launches back or earlier: the whole term before the wait (launch.py)
            w = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            g = tl.load(g_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
            acc = _rows_dot_scaled(acc, w, x_ptr, g, r0, R, stride_x, h, h_ok, rows, ROWS)
            wait_for_inputs(PDL)
        else:
            if PRELOAD:  # constant weights: read before the wait, so their HBM latency overlaps the previous kernel
                w = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
                g = tl.load(g_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
                wait_for_inputs(PDL)
            else:
                wait_for_inputs(PDL)
                w = tl.load(w_ptr + e[:, None] * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
                g = tl.load(g_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
            acc = _rows_dot_scaled(acc, w, x_ptr, g, r0, R, stride_x, h, h_ok, rows, ROWS)
    else:  # F a: the folded o_proj's fp32 tile
        c = (pid_s - splits_h) * BLOCK_H + cols
        c_ok = c < A
        if PRELOAD:
            f = tl.load(f_ptr + e[:, None] * A + c[None, :], mask=e_ok[:, None] & c_ok[None, :], other=0.0)
            wait_for_inputs(PDL)
        else:
            wait_for_inputs(PDL)
            f = tl.load(f_ptr + e[:, None] * A + c[None, :], mask=e_ok[:, None] & c_ok[None, :], other=0.0)
        if not DROP_A:  # DROP_A (tests' negative control only): the attention term left out
            acc = _rows_dot(acc, f, a_ptr, r0, R, stride_a, c, c_ok, rows, ROWS)
    r = r0 + rows
    tl.store(part_ptr + (pid_s * R + r[None, :]) * E + e[:, None], acc,
             mask=e_ok[:, None] & (rows[None, :] < ROWS) & (r[None, :] < R))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"route_parts: {message}")


def splits(h: int, a: int) -> tuple[int, int]:
    """(splits of H, splits of A): one BLOCK_H-wide tile each."""
    return triton.cdiv(h, BLOCK_H), triton.cdiv(a, BLOCK_H)


def route_parts(x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, router_w: torch.Tensor, fold_w: torch.Tensor, *,
                out: torch.Tensor | None = None, pdl: bool = False, preload: bool = False,
                drop_a: bool = False, early: bool = False) -> torch.Tensor:
    """Partial router logits part [S, R, E] fp32 whose sum over S is W_r (g * x) + F a (not yet scaled by the norm's
    1 / rms): x [R, H] the residual stream, g [H] the post-attention norm's weight, a [R, A] the attention output as
    o_proj takes it, router_w [E, H] bf16 (or fp32), fold_w = `fold_weight(...)` [E, A] fp32. `preload`: the weight
    tiles are read before the PDL wait (kernels/launch.py); `early`: the stream's whole term is computed before it
    (x written two launches back or earlier: the layer's input, the previous layer's output; the same values).
    `drop_a` (tests' negative control only) leaves out F a."""
    for name, t in (("x", x), ("g", g), ("a", a), ("router_w", router_w), ("fold_w", fold_w)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a tensor")
        _check(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
    _check(x.dim() == 2 and a.dim() == 2 and x.shape[0] == a.shape[0],
           f"x {tuple(x.shape)} and a {tuple(a.shape)} must be [R, H] and [R, A]")
    R, H = x.shape
    A = a.shape[1]
    E = router_w.shape[0]
    _check(R >= 1 and H >= 1 and A >= 1, f"rows {R}, hidden {H} and attention width {A} must be >= 1")
    _check(1 <= E <= MAX_EXPERTS, f"experts {E} must be in 1..{MAX_EXPERTS}")
    _check(tuple(router_w.shape) == (E, H) and tuple(fold_w.shape) == (E, A) and tuple(g.shape) == (H,),
           f"router_w {tuple(router_w.shape)}, fold_w {tuple(fold_w.shape)} and g {tuple(g.shape)} must be "
           f"[{E}, {H}], [{E}, {A}] and [{H}]")
    _check(router_w.dtype in (torch.bfloat16, torch.float32) and fold_w.dtype == torch.float32,
           f"router_w {router_w.dtype} must be bf16 or fp32 and fold_w {fold_w.dtype} fp32")
    _check(router_w.is_contiguous() and fold_w.is_contiguous() and g.is_contiguous(),
           "router_w, fold_w and g must be contiguous")
    _check(x.stride(1) == 1 and a.stride(1) == 1, "x and a must have unit stride along their rows")
    _check(E * max(H, A) < 2**31, "the weights must span < 2**31 elements (int32 offsets)")
    sh, sa = splits(H, A)
    if out is None:
        out = torch.empty((sh + sa, R, E), dtype=torch.float32, device=x.device)
    _check(tuple(out.shape) == (sh + sa, R, E) and out.dtype == torch.float32 and out.is_contiguous(),
           f"out must be a contiguous [{sh + sa}, {R}, {E}] fp32")
    rows = min(R, MAX_ROWS)
    grid = (triton.cdiv(E, BLOCK_E), sh + sa, triton.cdiv(R, rows))
    _route_parts_kernel[grid](x, g, a, router_w, fold_w, out, R, E, H, A, x.stride(0), a.stride(0), sh, ROWS=rows,
                              ROWS_PAD=triton.next_power_of_2(rows), BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H, PRELOAD=preload,
                              DROP_A=drop_a, EARLY=early, num_warps=1, **launch_options(pdl, x.device))
    return out


def fold_weight(router_w: torch.Tensor, post_norm: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """F = W_r diag(g2) W_o [E, A] in fp32, from the router [E, H], the post-attention norm's weight [H] and o_proj's
    weight [H, A] as its kernel reads it (dequantized): float64 products and sums, rounded once."""
    return ((router_w.double() * post_norm.double()) @ wo.double()).float().contiguous()


def route_logits_ref(x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, router_w: torch.Tensor,
                     fold_w: torch.Tensor) -> torch.Tensor:
    """The torch sequence of the same sum: W_r (g * x) + F a [R, E] fp32 (fast/ops.py's fallback)."""
    return (x.float() * g.float()) @ router_w.float().T + a.float() @ fold_w.T

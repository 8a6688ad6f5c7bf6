"""The attention's sandwich tail that also selects the MoE layer's experts (the router fold, issue 52):
`add_norm_route` is kernels/rmsnorm.py's `add_norm` (h = r + s * attn_out_norm(o), b = ffn_norm(h)) and, in the
same launch, the router's softmax and top-k of logits the o-projection already made most of.

Why: the router reads b, so on its own it is two launches after the tail (kernels/router.py: a logits pass over the
3 MB fp32 router, then the selection). But with W' = router * w_ffn (fp32 [E, H]),

    logits = rstd_h * (W' r + s * rstd_o * W' (w_out * o)),

and both products are linear in the rows, so the o-projection (kernels/o_proj_router.py) writes their partial sums
per output-column tile, parts [T, 2, R, E] fp32 ([t, 0]: of W' r, [t, 1]: of W' (w_out * o)); the tail, which holds
the row and computes both inverse norms anyway, sums them and selects. The router's two launches leave the layer's
chain.

Roundings: h and b are `add_norm`'s bits (the same `sandwich_tail`, weights, BLOCK = next_power_of_2(H), warps and
build: `rmsnorm.compile_options`). The logits use the UNROUNDED fp32 t and h of the same row:
rstd_o = rsqrt(sum(y^2) / H + eps) (`_norm_row`'s expression), t32 = y * rstd_o * w_out, h32 = r + s * t32,
rstd_h = rsqrt(sum(h32^2) / H + eps); A and B are the parts summed over t in chunks of `RouteTailSettings`'
part_chunk in index order, each chunk by one fixed tree (as router.py's `_sum_splits`), so the order is the launch's,
not the timing's; logits = rstd_h * (A + (s * rstd_o) * B). The selection is router.py's `select_experts` itself
(libdevice exp on the GPU, tl.exp under the interpreter, round-to-nearest division, ties to the lower index).

This is a numerical change against routing on the rounded b that the experts read: nothing of t, h or b is rounded
on the way, so the logits are an fp32 evaluation of router @ (w_ffn * h * rstd_h), not of router @ b. It is measured
and qualified elsewhere (fast/router_fold.py, docs/PERF.md); the tests here hold the kernel to its own torch form
`add_norm_route_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..reference.layers import route
from . import rmsnorm, router
from .launch import launch_options, wait_for_inputs


@dataclass(frozen=True)
class RouteTailSettings:
    """Launch choices beyond the tail's own (its warps are add_norm's: h and b must keep its bits). part_chunk may
    change the logits' last bits (the parts' summation tree follows it), never h or b."""

    # Partial values (tiles x padded E) one step of the parts sum loads for each of A and B, as router.PART_CHUNK: a
    # row's program is alone on its SM at decode, so the sum is load latency, and 8192 is 3 steps at T 96, E 256 (32
    # fp32 a thread each at 8 warps): sm_90a, 94 registers, no spill beside the row the tail holds.
    part_chunk: int = 8192

    def __post_init__(self):
        p = self.part_chunk
        if not (isinstance(p, int) and not isinstance(p, bool) and p >= 1 and p & (p - 1) == 0):
            raise ValueError(f"RouteTailSettings: part_chunk {p!r} must be a power of two >= 1")


@triton.jit
def _rstd(x, eps, H):
    """1 / rms of an fp32 row (zeros past H): `rmsnorm._norm_row`'s expression, so rstd_o is the one t was made with."""
    return tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)


@triton.jit
def _sum_parts(parts_ptr, row, R, E, T, E_PAD: tl.constexpr, T_BLOCK: tl.constexpr):
    """(A, B) [E_PAD] of a row: parts[t, 0] and parts[t, 1] summed over t in chunks of T_BLOCK in index order, each
    chunk by one fixed tree; both halves in one loop so their loads are in flight together."""
    e = tl.arange(0, E_PAD)
    t_in = tl.arange(0, T_BLOCK)
    a = tl.zeros([E_PAD], tl.float32)
    b = tl.zeros([E_PAD], tl.float32)
    for t0 in range(0, T, T_BLOCK):
        t = t0 + t_in
        ok = (t[:, None] < T) & (e < E)[None, :]
        off = ((t[:, None] * 2) * R + row) * E + e[None, :]
        a += tl.sum(tl.load(parts_ptr + off, mask=ok, other=0.0), axis=0)
        b += tl.sum(tl.load(parts_ptr + off + R * E, mask=ok, other=0.0), axis=0)
    return a, b


@triton.jit
def _fold_logits(a, b, rstd_h, rstd_o, scale):
    """rstd_h * (W' r + s * rstd_o * W' (w_out * o)): the products come from the parts, the norms from the row."""
    return rstd_h * (a + (scale * rstd_o) * b)


@triton.jit
def _add_norm_route_kernel(r_ptr, y_ptr, yw_ptr, nw_ptr, h_ptr, b_ptr, parts_ptr, weights_ptr, experts_ptr,
                           scores_ptr, R, H, E, T, eps, scale, stride_r, stride_y, stride_h, stride_b,
                           BLOCK: tl.constexpr, SCALED: tl.constexpr, E_PAD: tl.constexpr, T_BLOCK: tl.constexpr,
                           TOP_K: tl.constexpr, K_PAD: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                           PDL: tl.constexpr = False):
    RDT: tl.constexpr = h_ptr.dtype.element_ty
    DT: tl.constexpr = b_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK)
    m = i < H
    yw, nw = rmsnorm.tail_weights(yw_ptr, nw_ptr, i, m, True)  # constants: read before the wait
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(y_ptr + row * stride_y + i, mask=m, other=0.0).to(tl.float32)
    res = tl.load(r_ptr + row * stride_r + i, mask=m, other=0.0).to(tl.float32)
    h, b = rmsnorm.sandwich_tail(res, y, yw, nw, eps, scale, H, True, SCALED, RDT, DT)
    tl.store(h_ptr + row * stride_h + i, h.to(RDT), mask=m)
    tl.store(b_ptr + row * stride_b + i, b.to(DT), mask=m)

    # The router's input unrounded: the fold's W' products are of r and o, so their norms must be of t and h before
    # any rounding to a dtype's grid (a scale of 1 multiplies exactly).
    rstd_o = _rstd(y, eps, H)
    h32 = res + scale * (y * rstd_o * yw)
    rstd_h = _rstd(h32, eps, H)
    a, bb = _sum_parts(parts_ptr, row, R, E, T, E_PAD, T_BLOCK)
    logits = _fold_logits(a, bb, rstd_h, rstd_o, scale)
    router.select_experts(logits, row, E, weights_ptr, experts_ptr, scores_ptr, E_PAD, TOP_K, K_PAD, ACCURATE_EXP,
                          router._tie_rank)


# ---- host side ---------------------------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"route_tail: {message}")


def fits(R: int, H: int, E: int, T: int, top_k: int) -> bool:
    """Whether `add_norm_route` takes R rows of H with parts of T tiles over E experts and top_k; otherwise the engine
    runs the unfolded tail and router."""
    return (R >= 1 and rmsnorm.rmsnorm_fits(H) and 1 <= E <= router.MAX_EXPERTS and T >= 1 and 1 <= top_k <= E
            and T * 2 * R * E < 2**31)


def _t_block(T: int, E: int, settings: RouteTailSettings) -> int:
    return max(1, min(triton.next_power_of_2(T), settings.part_chunk // triton.next_power_of_2(E)))


def add_norm_route(residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm_w: torch.Tensor,
                   next_norm_w: torch.Tensor, eps: float, dtype: torch.dtype, parts: torch.Tensor, top_k: int, *,
                   pdl: bool = False, settings: RouteTailSettings = RouteTailSettings()
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, b, weights [R, k] fp32, experts [R, k] int64, scores [R, E] fp32) in one launch: h, b =
    `rmsnorm.add_norm(residual, y, scale, y_norm_w, next_norm_w, eps, dtype)` bit for bit, and the routing of the
    folded logits (`add_norm_route_torch` to rounding). residual [R, H] `dtype` or fp32 (the draft's stream), y
    [R, H] the o-projection's output, y_norm_w (attn_out_norm, required) and next_norm_w (ffn_norm) [H]; parts
    [T, 2, R, E] fp32 contiguous. `pdl`: as kernels/launch.py's. ValueError for what it does not take."""
    _check(isinstance(y_norm_w, torch.Tensor), "y_norm_w (attn_out_norm's weight) is required: the fold's t is "
           "the normalized branch")
    scale = rmsnorm.check_tail("route_tail", residual, y, scale, y_norm_w, next_norm_w, eps, dtype)
    R, H = residual.shape
    _check(isinstance(parts, torch.Tensor) and parts.dim() == 4 and parts.dtype == torch.float32,
           f"parts must be an fp32 [T, 2, R, E] tensor, got {getattr(parts, 'dtype', type(parts))} "
           f"{tuple(getattr(parts, 'shape', ()))}")
    T, two, Rp, E = parts.shape
    _check(two == 2 and Rp == R and T >= 1 and E >= 1, f"parts {tuple(parts.shape)} must be [T >= 1, 2, {R}, E >= 1]")
    _check(parts.is_contiguous(), "parts must be contiguous")
    _check(parts.device == residual.device, f"parts is on {parts.device}, residual on {residual.device}")
    _check(E <= router.MAX_EXPERTS, f"{E} experts: at most {router.MAX_EXPERTS} (router.MAX_EXPERTS)")
    _check(isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= E,
           f"top_k {top_k!r} must be an int in 1..{E} (the expert count)")
    _check(isinstance(settings, RouteTailSettings), f"settings must be a RouteTailSettings, got "
           f"{type(settings).__name__}")
    _check(fits(R, H, E, T, top_k), f"{R} rows of {H} with parts [{T}, 2, {R}, {E}] and top_k {top_k} are not "
           "taken (fits)")

    dev = residual.device
    h = torch.empty((R, H), dtype=residual.dtype, device=dev)
    b = torch.empty((R, H), dtype=dtype, device=dev)
    weights = torch.empty((R, top_k), dtype=torch.float32, device=dev)
    experts = torch.empty((R, top_k), dtype=torch.int64, device=dev)
    scores = torch.empty((R, E), dtype=torch.float32, device=dev)
    e_pad = triton.next_power_of_2(E)
    _add_norm_route_kernel[(R,)](
        residual, y, y_norm_w, next_norm_w, h, b, parts, weights, experts, scores, R, H, E, T, float(eps), scale,
        residual.stride(0), y.stride(0), h.stride(0), b.stride(0), BLOCK=triton.next_power_of_2(H),
        SCALED=scale != 1.0, E_PAD=e_pad, T_BLOCK=_t_block(T, E, settings), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), ACCURATE_EXP=not router.INTERPRETED,
        **rmsnorm.compile_options(rmsnorm.RmsNormSettings()), **launch_options(pdl, dev))
    return h, b, weights, experts, scores


# ---- the torch form ----------------------------------------------------------------------------------------------


def fold_logits_torch(residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm_w: torch.Tensor, eps: float,
                      parts: torch.Tensor) -> torch.Tensor:
    """The folded logits [R, E] fp32 (module docstring), torch's summation orders."""
    y32 = y.float()
    rstd_o = torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)
    h32 = residual.float() + scale * (y32 * rstd_o * y_norm_w.float())
    rstd_h = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    a, b = parts.sum(0).unbind(0)
    return rstd_h * (a + scale * rstd_o * b)


def add_norm_route_torch(residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm_w: torch.Tensor,
                         next_norm_w: torch.Tensor, eps: float, dtype: torch.dtype, parts: torch.Tensor, top_k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `add_norm_route` replaces: `rmsnorm.add_norm_torch`, and the reference routing of the folded logits."""
    h, b = rmsnorm.add_norm_torch(residual, y, scale, y_norm_w, next_norm_w, eps, dtype)
    weights, experts, scores = route(fold_logits_torch(residual, y, scale, y_norm_w, eps, parts), top_k)
    return h, b, weights, experts, scores

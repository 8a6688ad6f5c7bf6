"""The router fold (docs/round.md, "The router fold"): a MoE layer's routing computed without its own logits pass.

The router reads b = ffn_norm(h), h = r + s * t, t = attn_out_norm(o) (docs/model.md, "Forward"; r the layer's
residual, o the o-projection's output). With W' = router * w_ffn (the router's columns scaled by the norm's weight):

    logits = rstd_h * (W' r + s * rstd_o * W' (w_out * o))

The two products are linear in r and o, so the o-projection can make their partial sums per output tile
(kernels/o_proj_router.py) and the sandwich tail, which computes rstd_o and rstd_h anyway, sums them and selects the
experts (kernels/route_tail.py): the router's own launches leave the layer's chain. Nothing of t, h or b is rounded
on the way, so the logits are not an fp32 product of the rounded b the experts read: a numerical change against
routing on b, measured closer to the float64 reference (docs/PERF.md, "The router fold's numerics") and scored by
qualification against this module's `exact_input`.

Here: the fold's torch form (the engine's on every device, and what the kernels' tests are held to) and the exact
input qualification scores it against. The ops layer owns the fold (fast/torch_ops.py): a folded layer's o-projection
is left pending (`PendingProjection`) to the tail that reads it, which has the layer's residual, so the decoder layer
reads as the model's formula. The fold runs where a layer's o-projection output is whole on the rank: TP 1 and rank
slices, not across ranks (each rank's o is then a partial sum, and the pending projection runs as a plain linear).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference.layers import route


class RouterFold(NamedTuple):
    """What one MoE layer's fold reads besides its activations: made once by TorchOps.prepare."""

    router_w: torch.Tensor  # W' = router * w_ffn, fp32 [E, H]
    w_out: torch.Tensor     # the attn_out_norm weight [H]
    top_k: int


class PendingProjection(NamedTuple):
    """A folded layer's o-projection, not yet run: its weight (a fast.weights.Weight) and input, launched by the
    attention's tail with the router's partial logits (parts [T, 2, R, E] fp32, T tiles of its columns: [., 0] of
    W' r, [., 1] of W' (w_out * y))."""

    w: object
    x: torch.Tensor
    fold: RouterFold


def make(router: torch.Tensor, w_ffn: torch.Tensor, w_out: torch.Tensor, top_k: int) -> RouterFold:
    """A layer's fold from its fp32 router [E, H] and its two norm weights."""
    return RouterFold((router.float() * w_ffn.float()).contiguous(), w_out, top_k)


def parts(r: torch.Tensor, y: torch.Tensor, fold: RouterFold) -> torch.Tensor:
    """The partial logits as one tile [1, 2, R, E]: fp32 products of the widened residual and the rounded output."""
    w = fold.router_w
    return torch.stack((r.float() @ w.T, (y.float() * fold.w_out.float()) @ w.T))[None]


def logits(p: torch.Tensor, residual: torch.Tensor, y: torch.Tensor, w_out: torch.Tensor, scale: float,
           eps: float) -> torch.Tensor:
    """The router's fp32 logits [R, E] from the partials p [T, 2, R, E] summed over T in order, and the tail's two
    inverse norms, of the unrounded t (w_out: the attn_out_norm weight the tail normalizes y with) and h."""
    y32 = y.float()
    rstd_o = torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)
    h32 = residual.float() + scale * (y32 * rstd_o * w_out.float())
    rstd_h = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    a, b = p.sum(0).unbind(0)
    return rstd_h * (a + scale * rstd_o * b)


def select(p: torch.Tensor, residual: torch.Tensor, y: torch.Tensor, w_out: torch.Tensor, scale: float, eps: float,
           top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, experts, scores) of the folded logits, routed as the reference routes (softmax, top-k,
    renormalized)."""
    return route(logits(p, residual, y, w_out, scale, eps), top_k)


def exact_input(r: torch.Tensor, o: torch.Tensor, w_out: torch.Tensor, w_ffn: torch.Tensor, scale: float,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fold's logits are an fp32 evaluation of, from the engine's own r and o (float64, nothing rounded):
    (b_fold [R, H] with logits = router @ b_fold, and a bound on its terms' magnitudes [R, H],
    w_ffn * rstd_h * (|r| + |s t|) >= |b_fold|, that qualification's rounding bands are made of)."""
    r, o, w_out, w_ffn = (v.double() for v in (r, o, w_out, w_ffn))
    t = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w_out
    h = r + scale * t
    rstd_h = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w_ffn * h * rstd_h, w_ffn.abs() * rstd_h * (r.abs() + abs(scale) * t.abs())

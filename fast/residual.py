"""The residual stream with a layer's MoE output already added by the MoE's combine kernel, and a norm not yet
computed: the types through which a layer hands its next RMSNorm to the next layer's q/k/v projection (the kernel
plan's fused input norm), instead of a norm launch of its own."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Residual(NamedTuple):
    """The residual stream h = x + a layer's MoE output, added by the MoE's combine kernel (stage norm_qkv), with what
    the next RMSNorm (weight `weight`) needs: g = h * weight rounded, each row's sums of h^2 over tiles of its columns
    (fp32 [R, T]); and the MoE output itself (the taps'). The next layer's q/k/v projection takes g and scales its
    product's rows by 1 / rms, instead of a norm launch."""

    h: torch.Tensor
    g: torch.Tensor
    sumsq: torch.Tensor
    weight: torch.Tensor
    moe_out: torch.Tensor


class PendingNorm(NamedTuple):
    """rmsnorm(residual.h) * residual.weight, not yet computed: what a layer's attention takes in place of its
    normalized rows; a consumer that cannot take it has `ops.normed` compute them."""

    residual: Residual
    eps: float

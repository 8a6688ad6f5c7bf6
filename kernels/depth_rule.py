"""The depth controller's rule after a draft depth, in one launch (docs/round.md, "Depth controller").

After draft d (3 <= d < 7) the round decides on the device whether to draft d + 1: the fitted rule's score over
the depth's features against the logit of its threshold, written as int32 into the flag the next depth's conditional
node reads. `fast.depth_rule.more` is the contract; its torch form is ~20 small kernels (clamps, logs, the entropy's
products and sum, a multiply and an add a feature, the compare), evaluated up to four times a round inside the
captured graph.

Same float32 math as the torch form: logs by libdevice's logf on the GPU (CUDA's, as torch's; NumPy's under the
interpreter), each product and sum one rounding (contraction off), the score summed in the rule's order. The one
difference is the entropy's sum over the K candidates, a tree here and torch's own order there: a few fp32 ulps of
the score, so a decision can differ only for a score that close to the threshold (tests/test_kernel_depth_rule.py
bounds it). A different decision changes how many drafts a round makes, never the distribution of its tokens (the
accept step is lossless).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from ..reference.depth import FEATURES, TINY as LOG_FLOOR
from . import libm
from .launch import launch_options, wait_for_inputs

INTERPRETED = libm.INTERPRETED
MAX_K = 64  # candidates a distribution holds: the sampler's largest top-k (kernels/sample.py)
NUM_WARPS = 1  # at most 64 values and five features: one warp, no cross-warp reduction
TINY = tl.constexpr(LOG_FLOOR)  # the logs' floor


@triton.jit
def _feature(CODE: tl.constexpr, log_product, log_served, entropy, depth):
    """Feature CODE (its index in reference.depth.FEATURES) of this depth."""
    if CODE == 0:
        x = tl.full([], 1.0, tl.float32)  # bias
    elif CODE == 1:
        x = log_product
    elif CODE == 2:
        x = log_served
    elif CODE == 3:
        x = entropy
    else:
        x = depth
    return x


@triton.jit
def score(probs_ptr, K, served_ptr, product_ptr, depth, w0, w1, w2, w3, w4,
          C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
          TERMS: tl.constexpr, KP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The rule's score: sum over its TERMS features (codes C0.., weights w0..) in its order, float32."""
    j = tl.arange(0, KP)
    p = tl.load(probs_ptr + j, mask=j < K, other=0.0)
    plogp = tl.where(p > 0, p * libm.log(tl.maximum(p, TINY), LIBDEVICE), 0.0)
    entropy = -tl.sum(plogp, 0)
    log_product = libm.log(tl.maximum(tl.load(product_ptr), TINY), LIBDEVICE)
    log_served = libm.log(tl.maximum(tl.load(served_ptr), TINY), LIBDEVICE)
    s = _feature(C0, log_product, log_served, entropy, depth) * w0
    if TERMS > 1:
        s = s + _feature(C1, log_product, log_served, entropy, depth) * w1
    if TERMS > 2:
        s = s + _feature(C2, log_product, log_served, entropy, depth) * w2
    if TERMS > 3:
        s = s + _feature(C3, log_product, log_served, entropy, depth) * w3
    if TERMS > 4:
        s = s + _feature(C4, log_product, log_served, entropy, depth) * w4
    return s


@triton.jit
def _more_kernel(probs_ptr, K, served_ptr, product_ptr, more_ptr, depth, logit_threshold, w0, w1, w2, w3, w4,
                 C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                 TERMS: tl.constexpr, KP: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    s = score(probs_ptr, K, served_ptr, product_ptr, depth, w0, w1, w2, w3, w4, C0, C1, C2, C3, C4, TERMS, KP,
              LIBDEVICE)
    tl.store(more_ptr, (s > logit_threshold).to(tl.int32))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"depth_rule: {message}")


def rule_args(weights: Mapping[str, float]) -> tuple[dict, tuple[float, ...]]:
    """The kernel's form of a rule's weights (in their order): the constexpr codes and term count, and five weights
    (unused ones 0.0, never read)."""
    _check(1 <= len(weights) <= len(FEATURES) and set(weights) <= set(FEATURES),
           f"weights must name 1..{len(FEATURES)} of {FEATURES}, got {sorted(weights)}")
    codes = [FEATURES.index(name) for name in weights] + [0] * (len(FEATURES) - len(weights))
    ws = [float(w) for w in weights.values()] + [0.0] * (len(FEATURES) - len(weights))
    return {f"C{i}": c for i, c in enumerate(codes)} | {"TERMS": len(weights)}, tuple(ws)


def more(probs: torch.Tensor, served: torch.Tensor, product: torch.Tensor, out: torch.Tensor, depth: int,
         weights: Mapping[str, float], logit_threshold: float, *, pdl: bool = False) -> None:
    """out[0] = int32 (score > logit_threshold): `fast.depth_rule.more` for probs [K] fp32 (K <= MAX_K), served [1]
    and product [] fp32, all on one device; `weights` the rule's, in its order."""
    _check(all(isinstance(t, torch.Tensor) for t in (probs, served, product, out)), "arguments must be tensors")
    _check(probs.dim() == 1 and 1 <= probs.numel() <= MAX_K and probs.dtype == torch.float32
           and probs.is_contiguous(), f"probs must be contiguous fp32 [K], K in 1..{MAX_K}, got {probs.dtype} "
           f"{tuple(probs.shape)}")
    _check(served.numel() == 1 and served.dtype == torch.float32, "served must be one fp32 value")
    _check(product.numel() == 1 and product.dtype == torch.float32, "product must be one fp32 value")
    _check(out.numel() == 1 and out.dtype == torch.int32, "out must be one int32 value")
    _check(len({t.device for t in (probs, served, product, out)}) == 1, "tensors must share a device")
    _check(isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1,
           f"depth must be an int >= 1, got {depth!r}")
    consts, ws = rule_args(weights)
    K = probs.numel()
    _more_kernel[(1,)](probs, K, served, product, out, float(depth), float(logit_threshold), *ws, **consts,
                       KP=triton.next_power_of_2(K), LIBDEVICE=not INTERPRETED, num_warps=NUM_WARPS,
                       **({} if INTERPRETED else {"enable_fp_fusion": False}), **launch_options(pdl, probs.device))

"""A rank's part of the model's own log-probabilities of a block's tokens, in one launch (docs/round.md, "What a
token's logprob reports").

For each row r of this rank's fp32 logits x [R, Vr] (global tokens [offset, offset + Vr)) and its tokens t [R, m]:

    out[r, 0]     = lse_r = max_j x[r, j] + ln sum_j e^(x[r, j] - max)      this rank's log-normalizer
    out[r, 1 + i] = x[r, t[r, i] - offset] if this rank holds t[r, i], else -inf

each an fp32 stored as its bits in int64 (what the all-gather carries): `fast.sampler.logprob_parts` is the contract,
its torch form ~15 small kernels (max, the shift, exp, sum, log, add, the held mask, the gather, the packing). One
program a row walks its logits once, keeping a running maximum and a sum rescaled when the maximum grows (the online
log-sum-exp), so the sum's order, and its last bits, differ from the torch form's two passes: qualification measures
the logprobs (decode.logprobs). exp and log are libdevice's on the GPU (NumPy's under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import libm
from .launch import launch_options, wait_for_inputs

INTERPRETED = libm.INTERPRETED
BLOCK = 2048  # logits a step: 10 steps over a TP8 rank's 20,000, 16 fp32 values a thread at 4 warps
NUM_WARPS = 4
MAX_TOKENS = 16  # tokens a row: the round asks one (its emitted token); the bound keeps them in registers


@triton.jit
def _logprob_parts_kernel(x_ptr, tok_ptr, out_ptr, Vr, M, offset, stride_x, stride_t, stride_o,
                          BLOCK: tl.constexpr, M_PAD: tl.constexpr, LIBDEVICE: tl.constexpr,
                          PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    c = tl.arange(0, BLOCK)
    peak = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for v0 in range(0, Vr, BLOCK):
        x = tl.load(x_row + v0 + c, mask=v0 + c < Vr, other=float("-inf"))
        new = tl.maximum(peak, tl.max(x, 0))
        total = total * libm.exp(peak - new, LIBDEVICE) + tl.sum(libm.exp(x - new, LIBDEVICE), 0)
        peak = new
    lse = peak + libm.log(total, LIBDEVICE)
    i = tl.arange(0, M_PAD)
    local = tl.load(tok_ptr + row * stride_t + i, mask=i < M, other=-1) - offset
    held = (local >= 0) & (local < Vr) & (i < M)
    values = tl.load(x_row + tl.where(held, local, 0), mask=held, other=float("-inf"))
    o_row = out_ptr + row * stride_o
    tl.store(o_row, lse.to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(o_row + 1 + i, values.to(tl.int32, bitcast=True).to(tl.int64), mask=i < M)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"logprobs: {message}")


def logprob_parts(x: torch.Tensor, tokens: torch.Tensor, vocab_offset: int, *, pdl: bool = False) -> torch.Tensor:
    """`fast.sampler.logprob_parts` in one launch: [R, 1 + m] int64 from x [R, Vr] fp32 (unit column stride) and
    tokens [R, m] int64 (m <= MAX_TOKENS)."""
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1
           and x.shape[1] >= 1, f"x must be fp32 [R, Vr] with unit column stride, got {getattr(x, 'dtype', x)} "
           f"{tuple(getattr(x, 'shape', ()))}")
    _check(isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.dtype == torch.int64
           and tokens.shape[0] == x.shape[0] and 1 <= tokens.shape[1] <= MAX_TOKENS and tokens.stride(1) == 1,
           f"tokens must be int64 [{x.shape[0]}, m] with m in 1..{MAX_TOKENS} and unit column stride")
    _check(tokens.device == x.device, f"devices differ: x {x.device}, tokens {tokens.device}")
    _check(isinstance(vocab_offset, int) and vocab_offset >= 0,
           f"vocab_offset must be an int >= 0, got {vocab_offset!r}")
    R, M = x.shape[0], tokens.shape[1]
    out = torch.empty((R, 1 + M), dtype=torch.int64, device=x.device)
    if R:
        _logprob_parts_kernel[(R,)](x, tokens, out, x.shape[1], M, vocab_offset, x.stride(0), tokens.stride(0),
                                    out.stride(0), BLOCK=BLOCK, M_PAD=max(2, triton.next_power_of_2(M)),
                                    LIBDEVICE=not INTERPRETED, num_warps=NUM_WARPS, **launch_options(pdl, x.device))
    return out

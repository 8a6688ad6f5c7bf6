"""Live-row helpers of the MoE kernels: `load_live` (in a kernel), `check_live` (in a wrapper), and the pair
capacity MAX_PAIRS of one moe call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PAIRS = 128  # R * k a moe call takes (its programs' pair vectors); TritonOps splits longer blocks


@triton.jit
def load_live(live_ptr, rows, R, LIVE_COUNT: tl.constexpr):
    """Liveness of `rows`: a bool/uint8 mask [R], or (LIVE_COUNT) rows < a device int count."""
    if LIVE_COUNT:
        n = tl.load(live_ptr).to(tl.int32)
        return rows < n
    return tl.load(live_ptr + rows, mask=rows < R, other=0) != 0


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"moe: {message}")


def check_live(live: torch.Tensor, R: int, device: torch.device) -> bool:
    """Validates `live` (bool [R] mask, or an integer count of leading live rows: 0-d or [1]);
    returns True when it is a count."""
    _check(live.device == device, f"live is on {live.device}, experts on {device}")
    if live.dtype == torch.bool:
        _check(tuple(live.shape) == (R,) and live.is_contiguous(), f"live mask must be [{R}], got {tuple(live.shape)}")
        return False
    _check(live.dtype in (torch.int32, torch.int64) and live.numel() == 1,
           f"live must be a bool mask [{R}] or one int32/int64 count, got {live.dtype} {tuple(live.shape)}")
    return True

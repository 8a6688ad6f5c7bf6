"""What the kernel wrappers ask of the device: the float dtypes they take, the SM count their grids are sized by (8
off the GPU, where only the interpreter runs them), and the check of a row-grouped float input."""

from __future__ import annotations

import functools

import torch

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)  # asked on every launch of some wrappers
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def row_groups(x: torch.Tensor, group: int, op: str) -> tuple[int, int]:
    """(M, N) of a contiguous float x [M, N] cut into groups of `group` columns (a power of two >= 16 dividing N),
    as the per-row-group kernels (act_quant, f16 rows) take it; ValueError naming `op` otherwise."""
    if not (x.dim() == 2 and x.is_contiguous() and x.dtype in FLOATS):
        raise ValueError(f"{op}: x must be a contiguous float [M, N]")
    M, N = x.shape
    if not (group >= 16 and group & (group - 1) == 0 and N % group == 0):
        raise ValueError(f"{op}: group {group} must be a power of two >= 16 dividing N = {N}")
    return M, N


def is_pow2(n, least: int = 1) -> bool:
    """Is n an int (not a bool), a power of two, at least `least`? (tile sizes, warps, splits)"""
    return isinstance(n, int) and not isinstance(n, bool) and n >= least and n & (n - 1) == 0


U32 = 2.0 ** -24  # fp32 unit roundoff


def logit_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[R, N]: how far two fp32 products x @ w.T (x [R, K], w [N, K]) summed in different orders may be apart, e.g. a
    kernel's and torch's. Each is within gamma_K sum_k |x_k w_nk| of the exact value (Higham, Thm 3.1: gamma_K =
    K u / (1 - K u), u = 2^-24, any order, with or without FMAs), so twice that bounds their difference."""
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    return 2 * gamma * (x.double().abs() @ w.double().abs().T)

"""What the kernel wrappers ask of the device: the float dtypes they take, and the SM count their grids are sized
by (8 off the GPU, where only the interpreter runs them)."""

from __future__ import annotations

import functools

import torch

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)  # asked on every launch of some wrappers
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8

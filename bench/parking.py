"""The latency of one dependent step as the engine launches it: the unit of `bench step`'s step-and-byte bound.

A chain of small kernels on every SM, each launched with PDL (chained: it waits, then lets the next one launch) and
reading what the previous one wrote, as the round's norms, rotary, attention combine and router select do, captured
in one CUDA graph and timed with CUDA events: the least any kernel of the round's chain can cost. (The probe that
gave this module its name, programs parked at a PDL wait beside a weight stream, measured a closed direction and
left the tree after b414030: docs/PERF.md.)
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from ..kernels.device import sm_count
from ..kernels.launch import launch_options, wait_for_inputs
from .timing import replay_times


@triton.jit
def _step_kernel(out_ptr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.load(out_ptr + tl.program_id(0)) + 1)  # a true dependency on the last


def dependent_step_us(device: torch.device, steps: int = 100, repeats: int = 9) -> float:
    """Median us of one dependent step: a PDL-chained small kernel on every SM that reads what the previous one
    wrote, `steps` of them in one graph, `repeats` replays."""
    out = torch.zeros(sm_count(device), dtype=torch.int32, device=device)
    launch = launch_options(True, device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            _step_kernel[(out.numel(),)](out, num_warps=4, **launch)
    return statistics.median(replay_times(g, steps, repeats, warmup=1))

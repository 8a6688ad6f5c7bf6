"""The two timings the benchmarks share: a decode chunk by wall clock, a CUDA graph replay by CUDA events.

Callers keep their own warm-up and repeat schedule (alternating variants, rotating graphs, lockstep ranks);
these time one measurement the same way everywhere.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..fast.rank import RankEngine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_chunk(engine: RankEngine, decode: Callable[[], object], device: torch.device,
               before: Callable[[], object] | None = None) -> dict:
    """Wall time of `decode()` (one decode chunk of `engine`) and the rounds and tokens it added to the engine's
    state: {"seconds", "rounds", "tokens", "round_us"}. `before` runs after the device is idle and just before
    the clock starts (a barrier, so ranks start together)."""
    st = engine.state
    rounds0, emitted0 = int(st.rounds), int(st.emitted)
    sync(device)  # the device work queued before the chunk is not the chunk's
    if before is not None:
        before()
    start = time.perf_counter()
    decode()
    sync(device)
    dt = time.perf_counter() - start
    rounds, tokens = int(st.rounds) - rounds0, int(st.emitted) - emitted0
    return {"seconds": dt, "rounds": rounds, "tokens": tokens, "round_us": dt / max(rounds, 1) * 1e6}


def replay_times(graph: torch.cuda.CUDAGraph, calls: int, repeats: int, warmup: int = 0,
                 before: Callable[[], object] | None = None) -> list[float]:
    """Per-call microseconds of `repeats` replays of `graph` (holding `calls` calls), each replay timed alone with
    CUDA events, after `warmup` untimed replays. `before` runs before every replay (a barrier between ranks)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3 / calls)
    return times

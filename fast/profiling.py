"""Profiler labels on the engine's stages, for the per-stage breakdown of `iquest bench step`."""

from __future__ import annotations

import functools

import torch


def stage(name: str):
    """Profiler label on a stage, opened only while a profiler runs: it is host-side only, so captured graphs and
    unprofiled runs are unaffected (bench/full_step.py).

    The label is an op of function scope (`_RecordFunctionFast`, as Inductor wraps its Triton launches), not a
    `torch.profiler.record_function` range: the profiler ties a device kernel to the innermost op open on the host
    when it was launched, and a record_function range is a user annotation, which takes no kernels. A torch op's
    kernels reached their stage through the op's parents either way, but a Triton kernel is launched from Python
    with no op open, so inside a record_function range it was tied to nothing and counted as "other" (on the H200,
    torch 2.11: every Triton kernel of the eager round, launched with or without PDL)."""
    def wrap(fn):
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with torch._C._profiler._RecordFunctionFast(name):
                return fn(*args, **kwargs)
        return labelled
    return wrap

"""Profiler labels on the engine's stages, for the per-stage breakdown of `iquest bench step`."""

from __future__ import annotations

import functools

import torch


def stage(name: str):
    """Profiler label on a stage (`torch.profiler.record_function`), opened only while a profiler runs:
    it is host-side only, so captured graphs and unprofiled runs are unaffected (bench/full_step.py)."""
    def wrap(fn):
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return labelled
    return wrap

"""Timing-only ablation of the fast engine's ops (`--kernels triton~moe`, for `iquest bench step`): where a round's
time goes on its critical path.

A kernel's eager duration is not its share of a captured round: under programmatic dependent launch part of it
overlaps its neighbours, and moving a kernel's work into another one can move its latency with it (docs/PERF.md,
`qkv_rope`: one launch fewer saved 0.3 us, not the 1.9 us the removed kernel took eagerly). Removing an op from the
round and timing the rest measures what the op adds to the round.

An ablated op runs once per argument shape (the capture's eager warm-up) and its outputs are kept; every later call
returns those same tensors and launches nothing. The model's values are then wrong, by design, but stay finite (they
are real outputs of the op), so the routing still picks real experts; an op given `out=` copies the kept value
there (one torch copy). Never for decoding: only benchmark variants name it.
"""

from __future__ import annotations

from typing import Callable

import torch

# ablation name -> the ops.TorchOps methods it stubs
ABLATABLE: dict[str, tuple[str, ...]] = {
    "norm": ("norm", "residual_norm", "add_norm"),
    "qkv": ("qkv",),
    "rope": ("rope_write",),
    "attention": ("attention",),
    "linear": ("linear",),       # o_proj and the draft layer's eh_proj
    "route": ("route",),         # router logits and selection
    "moe": ("moe",),             # Gate/Up, finalize, Down, combine
    "lm_head": ("lm_head",),
}


def _key(args: tuple, kwargs: dict) -> tuple:
    """The call's argument shapes and dtypes (what its outputs' shapes depend on)."""
    def one(a):
        return (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()) if k != "out")


def _kept(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_kept(v) for v in value)
    return value


def _stub(method: Callable, calls: dict) -> Callable:
    kept: dict[tuple, object] = {}

    def run(*args, **kwargs):
        key = _key(args, kwargs)
        if key not in kept:
            kept[key] = _kept(method(*args, **kwargs))
            return kept[key]
        calls[method.__name__] = calls.get(method.__name__, 0) + 1
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            out.copy_(kept[key])
            return out
        return kept[key]
    return run


def ablate(ops, names: set[str]) -> None:
    """Stub the named ops on this `ops` instance; `ops.ablated_calls` counts the calls that launched nothing."""
    unknown = set(names) - set(ABLATABLE)
    if unknown:
        raise ValueError(f"unknown ablation {sorted(unknown)}: choose from {sorted(ABLATABLE)}")
    ops.ablated = frozenset(names)
    ops.ablated_calls = {}
    for name in names:
        for method in ABLATABLE[name]:
            setattr(ops, method, _stub(getattr(ops, method), ops.ablated_calls))

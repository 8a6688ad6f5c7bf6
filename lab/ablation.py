"""Timing-only ablation of the fast engine's ops (`iquest bench step --kernels triton~moe`): where a round's time goes
on its critical path. Lab code: benchmarks import it (bench/variants.py), the product never does.

A kernel's eager duration is not its share of a captured round: under programmatic dependent launch part of it
overlaps its neighbours, and moving a kernel's work into another one can move its latency with it (docs/PERF.md,
`qkv_rope`: one launch fewer saved 0.3 us, not the 1.9 us the removed kernel took eagerly). Removing an op from the
round and timing the rest measures what the op adds to the round. The ops are the methods of fast/torch_ops.TorchOps
(fast/triton_ops.TritonOps overrides some of them with kernels): whichever implementation the variant runs is
stubbed.

An ablated op runs once per argument shape (the capture's eager warm-up) and its outputs are kept; every later call
returns those same tensors and launches nothing. The model's values are then wrong, by design, but stay finite (they
are real outputs of the op), so the routing still picks real experts; an op given `out=` copies the kept value
there (one torch copy). Never for decoding: only benchmark variants name it.
"""

from __future__ import annotations

from typing import Callable

import torch

# ablation name -> the fast.torch_ops.TorchOps methods it stubs
ABLATABLE: dict[str, tuple[str, ...]] = {
    "norm": ("norm", "add_norm"),  # every RMSNorm: the sandwich tails, the draft's enorm/hnorm, the first layer's input
    "qkv": ("qkv", "qkv_rope_write"),  # the q/k/v projections (with the q/k norm, RoPE and KV write where fused)
    "rope": ("qk_rope_write",),  # q/k norms, partial RoPE of q and k, and the KV write
    "attention": ("attention",),
    "linear": ("linear",),       # o_proj, eh_proj, the dense MLP (and q/k/v where qkv runs them as linears)
    "route": ("route",),         # the fp32 router logits and the selection
    "moe": ("moe",),             # the routed experts
    "lm_head": ("lm_head",),
}


def _key(args: tuple, kwargs: dict) -> tuple:
    """The call's argument shapes and dtypes (what its outputs' shapes depend on)."""
    def one(a):  # a tuple by its parts, None apart from other values
        if isinstance(a, torch.Tensor):
            return tuple(a.shape), a.dtype
        return tuple(one(v) for v in a) if isinstance(a, tuple) else a is None
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()) if k != "out")


def _kept(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):  # a NamedTuple keeps its type
        items = [_kept(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _stub(method: Callable, calls: dict, keep: Callable = _kept) -> Callable:
    """`method` run once per argument shape, `keep` of its result returned from then on (those calls counted)."""
    kept: dict[tuple, object] = {}

    def run(*args, **kwargs):
        key = _key(args, kwargs)
        if key not in kept:
            kept[key] = keep(method(*args, **kwargs))
            return kept[key]
        calls[method.__name__] = calls.get(method.__name__, 0) + 1
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            out.copy_(kept[key])
            return out
        return kept[key]
    return run


def pinned_experts(rows: int, k: int, distinct: int, like: torch.Tensor) -> torch.Tensor:
    """experts[r, j] = (r k + j) mod distinct: each row's k choices distinct (distinct >= k), the block's `distinct`
    experts in all (min(distinct, rows k)), as `like`'s dtype and device."""
    r = torch.arange(rows, device=like.device)[:, None] * k + torch.arange(k, device=like.device)[None, :]
    return (r % distinct).to(like.dtype)


def _pinned(distinct: int) -> Callable:
    """route's `keep`: fixed experts (`pinned_experts`) with equal weights instead of the ones it chose, so that the
    MoE after it reads the same bytes whatever the values."""
    def keep(routed: tuple) -> tuple:
        weights, experts, scores = routed
        rows, k = experts.shape
        return torch.full_like(weights, 1.0 / k), pinned_experts(rows, k, distinct, experts), scores.clone()
    return keep


def unreached(ops) -> list[str]:
    """The ablations of `ops` none of whose stubs has returned a kept value yet: after a decode, an op that is not on
    the variant's path (e.g. ~route or ~moe on a model without MoE layers), so removing it measured nothing."""
    calls = getattr(ops, "ablated_calls", {})
    return sorted(n for n in getattr(ops, "ablated", ()) if not any(calls.get(m) for m in ABLATABLE[n]))


def check_reached(ops, variant: str) -> None:
    """Refuse a benchmark variant (after its decode) whose ablation removed nothing: it timed the unablated round."""
    missing = unreached(ops)
    if missing:
        raise ValueError(f"variant {variant!r}: ablated {', '.join(missing)} never ran on its path, so removing it "
                         "measures nothing")


def ablate(ops, names: set[str]) -> None:
    """Stub the named ops on this `ops` instance; `ops.ablated_calls` counts the calls that launched nothing.
    "route:D" pins the routing to D distinct experts a block (`_pinned`) instead of keeping its first result:
    the other ablations change the values, hence the routing, hence the MoE's bytes, so they are compared with it."""
    parsed = {n.partition(":")[0]: n.partition(":")[2] for n in names}
    unknown = set(parsed) - set(ABLATABLE)
    if unknown or any(v and (n != "route" or not v.isdigit() or int(v) < 1) for n, v in parsed.items()):
        raise ValueError(f"unknown ablation {sorted(names)}: choose from {sorted(ABLATABLE)} (route:D with D >= 1 "
                         f"distinct experts)")
    ops.ablated = frozenset(parsed)
    ops.ablated_calls = {}
    for name, arg in parsed.items():
        # the experts' outputs kept as computed (a Down left pending to the op after it runs now, once), so that the
        # stub removes the whole MoE, not only its Gate/Up
        keep = _pinned(int(arg)) if arg else (lambda v: _kept(ops.expert_outputs(v))) if name == "moe" else _kept
        for method in ABLATABLE[name]:
            setattr(ops, method, _stub(getattr(ops, method), ops.ablated_calls, keep))

"""Control variants of the round's folds (`iquest bench step --kernels triton,triton^moe_combine`): each puts back
the launches one fold removed, from the product's own unfused pieces, so a benchmark times the round before and after
the fold in one process, side by side (issue 52's paired evidence). Lab code: benchmarks import it
(bench/variants.py), the product never does.

An unfolded variant computes the same bits as the folded one (each fold is bit-exact by its tests), so the two rounds
differ only in their launches; `unfolded_calls` counts the substitutions, so a variant whose fold is not on its path
(e.g. ^moe_combine on a model without MoE layers) is refused instead of timing the folded round twice.
"""

from __future__ import annotations

from ..fast.torch_ops import TorchOps

# unfold name -> what it puts back
UNFOLDS: dict[str, str] = {
    "moe_combine": "the MoE's own Down, combine and cast launches before the sandwich tail (kernels/moe.py `down`, "
                   "`combine`)",
    "peer_tail": "at TP > 1, the plain peer all-reduce then `add_norm` (two launches a reduction point), and with it "
                 "the MoE's combine",
    "qkv_rope": "the q/k/v projection and the q/k norm + RoPE + KV write as two launches (kernels/fp8_linear.py, "
                "kernels/qk_rope_kv.py)",
}


def unfold(ops, names: set[str]) -> None:
    """Substitute the unfused pieces of the named folds on this `ops` instance."""
    unknown = set(names) - set(UNFOLDS)
    if unknown:
        raise ValueError(f"unknown unfold {sorted(unknown)}: choose from {sorted(UNFOLDS)}")
    ops.unfolded = frozenset(names)
    ops.unfolded_calls = {}
    if "moe_combine" in names:
        moe = ops.moe

        def combined(*args, **kwargs):
            out = moe(*args, **kwargs)
            tensor = ops.combined(out)
            if tensor is not out:  # an uncombined output (a plan with the MoE's kernels), now combined here
                ops.unfolded_calls["moe_combine"] = ops.unfolded_calls.get("moe_combine", 0) + 1
            return tensor
        ops.moe = combined
    if "qkv_rope" in names:
        def apart(attn, a, kv, eps, cos, sin, positions, live):
            folds = getattr(ops, "folds_qkv_rope", None)
            if folds is not None and folds(attn, kv, cos) is not None:
                ops.unfolded_calls["qkv_rope"] = ops.unfolded_calls.get("qkv_rope", 0) + 1
            return TorchOps.qkv_rope_write(ops, attn, a, kv, eps, cos, sin, positions, live)
        ops.qkv_rope_write = apart
    if "peer_tail" in names:
        def unfused(par, partial, *rest):
            if par.peers is not None:
                ops.unfolded_calls["peer_tail"] = ops.unfolded_calls.get("peer_tail", 0) + 1
            return TorchOps.reduce_add_norm(ops, par, ops.combined(partial), *rest)
        ops.reduce_add_norm = unfused


def check_unfolded(ops, variant: str) -> None:
    """Refuse a variant (after its decode) whose unfold never substituted anything: it timed the folded round."""
    missing = sorted(n for n in getattr(ops, "unfolded", ()) if not getattr(ops, "unfolded_calls", {}).get(n))
    if missing:
        raise ValueError(f"variant {variant!r}: {', '.join(missing)} was never folded on its path, so unfolding it "
                         "measures nothing")

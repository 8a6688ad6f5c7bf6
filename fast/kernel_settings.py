"""The launch settings the Triton dispatcher passes each kernel: every kernel file's frozen settings dataclass, at the
product's values below (the kernel file's defaults unless an op measured better), or with fields replaced
(EngineOptions.kernel_settings) so that a bench variant times a tuned setting in the whole round
(`triton@linear.num_stages=3`) and qualification judges a numerical form before it becomes a default
(`iquest qualify --kernel-setting moe.gate_up_split=8`).

Imports triton (through the kernel files): fast/rank.py reaches it only for a plan with kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kernels import decode_attention as da, fp8_linear as fl, lm_head as lh, moe as mo, o_proj_router as opr, \
    topk as tk
from .plan import KernelPlan
from .rank import KernelSetting
from .setting_ops import GROUP


@dataclass(frozen=True)
class KernelSettings:
    """Each op's launch settings: a field an op, its kernel file's settings dataclass."""

    # The FP8 linear's settings differ by op: two pipeline stages for the plain linears and the o-projection, eight
    # warps for the q/k/v fold; with the head's 8-row tiles (kernels/lm_head.py) they make the round faster with the
    # same bits (docs/PERF.md, "Current state", the same-bits tunes). The o-projection's K in one program (no split
    # partials to sum), the q/k/v fold's K over 8 programs a head (3 K tiles each) and the head's 128-column steps
    # change the sums' order: each was qualified at TP 1 and paired in the round before it became a default, and all
    # of them at TP 2 with the last (docs/PERF.md, "Current state", the candidates of 17fb4ea and 9c6eda1). The
    # o-projection's calls run the direct kernel (kernels/fp8_linear_direct.py): the same bits, the round 0.9628x
    # (docs/PERF.md, "Current state").
    moe: mo.MoESettings = mo.MoESettings()                          # Gate/Up, Down, the combine
    linear: fl.LinearSettings = fl.LinearSettings(num_stages=2)     # dense MLP, eh_proj, q/k/v unfolded
    o_proj: fl.LinearSettings = fl.LinearSettings(num_stages=2, split_k=1, direct=True)  # folded or not
    o_proj_router: opr.PartsSettings = opr.PartsSettings()          # the router fold's partial logits
    qkv_rope_kv: fl.LinearSettings = fl.LinearSettings(num_warps=8, split_k=8)  # q/k/v + q/k norm + RoPE + KV write
    lm_head: lh.LMHeadSettings = lh.LMHeadSettings()                # the target's and the draft's heads
    attention_full: da.AttentionSettings = da.FULL                  # split-KV attention, full layers
    attention_sliding: da.AttentionSettings = da.SLIDING            # sliding layers and the draft's window
    topk: tk.TopKSettings = tk.TopKSettings()                       # each rank's vocabulary top-k before the gather


assert set(GROUP) == {f.name for f in dataclasses.fields(KernelSettings)}


def build(plan: KernelPlan, triples: tuple[KernelSetting, ...]) -> KernelSettings:
    """KernelSettings with each (op, field, value) replacing that op's default; ValueError for an unknown op or field,
    or settings of an op whose group runs its torch form."""
    chosen: dict[str, dict] = {}
    for op, field, value in triples:
        if op not in GROUP:
            raise ValueError(f"kernel setting {op}.{field}: unknown op {op!r}; settable: {', '.join(GROUP)}")
        if not getattr(plan, GROUP[op]):
            raise ValueError(f"kernel setting {op}.{field} needs the {GROUP[op]} kernels: the plan runs its torch form")
        chosen.setdefault(op, {})[field] = value
    defaults = KernelSettings()
    out = {}
    for op, fields in chosen.items():
        try:
            out[op] = dataclasses.replace(getattr(defaults, op), **fields)
        except TypeError as e:  # an unknown field
            raise ValueError(f"kernel settings of {op} {fields}: {e}") from None
    return dataclasses.replace(defaults, **out)

"""The kernel plan: which of the engine's op groups run as the Triton kernels of `kernels/`, and which of the
numerical variants that passed qualification are on. One frozen value per engine, built from the device by default.

The Triton kernels always launch the way the measurements picked (docs/PERF.md, "Decisions kept"): programmatic
dependent launch, constant weights read before the wait, fp16 MoE operands from the norm, tensor-descriptor weight
loads, the FP8 linears' direct register loads, the q/k/v split-K partials summed by the rotary kernel. Those give
the same bits as the plainer forms they replaced, so they are not choices here; where a shape does not fit a kernel
(the micro preset's 8-wide blocks, long prefill blocks) that one call runs the torch form and is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

GROUPS = ("linear", "attention", "norm", "moe", "lm_head", "sampling", "glue")
VARIANTS = ("fp8_down", "fused_input_norm")
CHOICES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelPlan:
    linear: bool = False      # the FP8 linears: q/k/v as one weight, o_proj, eh_proj
    attention: bool = False   # rotary + KV write, split-KV decode attention
    norm: bool = False        # the RMSNorms, the residual add folded into the next one
    moe: bool = False         # the router and the routed experts
    lm_head: bool = False     # the vocabulary-parallel LM head
    sampling: bool = False    # local top-k, the global distribution and its draws, the accept step, Philox
    glue: bool = False        # the embedding lookup, the settle step
    # Numerical changes, each qualified against the reference before it became a default (docs/PERF.md):
    fp8_down: bool = False          # Down multiplies E4M3 activations and weights on the tensor cores (3594ef6)
    fused_input_norm: bool = False  # a layer's input norm formed by the previous MoE combine and its q/k/v (d521403)

    @classmethod
    def torch(cls) -> "KernelPlan":
        return cls()

    @classmethod
    def triton(cls) -> "KernelPlan":
        return cls(**{f.name: True for f in fields(cls)})

    @classmethod
    def choose(cls, choice: str, device: torch.device | str) -> "KernelPlan":
        """`--kernels`: auto (Triton on CUDA, torch elsewhere), torch or triton."""
        if choice not in CHOICES:
            raise ValueError(f"--kernels must be one of {', '.join(CHOICES)}, got {choice!r}")
        device = torch.device(device)
        if choice == "auto":
            choice = "triton" if device.type == "cuda" else "torch"
        return cls.triton() if choice == "triton" else cls.torch()

    @property
    def uses_triton(self) -> bool:
        return any(getattr(self, g) for g in GROUPS)

    @property
    def name(self) -> str:
        """"torch", "triton", or the groups and variants that run as kernels (a debugging plan)."""
        if self == KernelPlan.torch():
            return "torch"
        if self == KernelPlan.triton():
            return "triton"
        return "+".join(f.name for f in fields(self) if getattr(self, f.name)) or "torch"

"""The kernel plan: which of the engine's op groups run as the Triton kernels of `kernels/`. One frozen value per
engine, built from the device by default.

The groups (`GROUPS`): the FP8 linears (plain projections), attention (q/k norm + partial RoPE + KV write in one
launch; split-KV attention with the sink key), the norms (RMSNorm and the sandwich tails), the router and the routed
experts, the LM heads (fp32 products), the vocabulary-parallel sampling (top-k, distributions, draws, the accept step,
Philox) and the glue (embedding lookup, settle step). A group left off a plan runs its torch form, and the run's
summary names it. Where a shape does not fit a kernel that call runs the torch form and is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

GROUPS = ("linear", "attention", "norm", "moe", "lm_head", "sampling", "glue")
CHOICES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelPlan:
    linear: bool = False      # the FP8 linears: q/k/v as one weight, o_proj, eh_proj, the dense MLP
    attention: bool = False   # q/k norm + partial RoPE + KV write; split-KV attention with the sink key
    norm: bool = False        # RMSNorm (the first layer's input, the draft's enorm/hnorm) and the sandwich tails
    moe: bool = False         # the fp32 router and the routed experts (Gate/Up, Down, the weighted combine)
    lm_head: bool = False     # the fp32 vocabulary-parallel heads (the target's, the draft's own)
    sampling: bool = False    # local top-k, the global distribution and its draws, the accept step, Philox
    glue: bool = False        # the embedding lookups, the settle step

    def __post_init__(self) -> None:
        assert tuple(f.name for f in fields(self)) == GROUPS, "a plan holds exactly the op groups"

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
    def torch_groups(self) -> tuple[str, ...]:
        """The op groups that run their torch forms under this plan."""
        return tuple(g for g in GROUPS if not getattr(self, g, False))

    @property
    def name(self) -> str:
        """"torch", or "triton" with the groups still on their torch forms named (a debugging plan: its groups)."""
        if self == KernelPlan.torch():
            return "torch"
        on = "+".join(g for g in GROUPS if getattr(self, g))
        if self == KernelPlan.triton():
            on = "triton"
        return f"{on} (torch forms: {', '.join(self.torch_groups)})"

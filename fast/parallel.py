"""Tensor-parallel context: which rank this process is, and the two collectives the model uses.

Passed explicitly to every layer (no module-level rank or backend). A single process is `Parallel.single()`,
whose collectives are identities. MODEL.md's TP layout: two all-reduces per decoder layer (after the
row-parallel o_proj and Down), one after the vocabulary-parallel embedding and eh_proj, and one
all-gather of sampling candidates per sampled row block.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    rank: int
    world: int
    device: torch.device
    group: Any = field(default=None, compare=False)
    local_collectives: bool = False  # rank-slice benchmarks: collectives replaced by local no-ops

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "Parallel":
        return cls(0, 1, torch.device(device))

    @property
    def active(self) -> bool:
        return self.world > 1 and not self.local_collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer over ranks (in place)."""
        if self.active:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.active:
            dist.broadcast(x, src=src, group=self.group)
        return x


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process(rank: int, world: int, port: int, device_kind: str) -> Parallel:
    """Join the process group of `world` ranks on this host: NCCL on GPUs, gloo on CPU."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world > 1:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device if device_kind == "cuda" else None)
    return Parallel(rank, world, device, group=dist.group.WORLD if world > 1 else None)

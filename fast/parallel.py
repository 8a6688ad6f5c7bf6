"""Tensor-parallel context: which rank this process is, and the two collectives the model uses.

Passed explicitly to every layer (no module-level rank or backend). A single process is `Parallel.single()`,
whose collectives are identities. On CPU the collectives are torch's over gloo; on GPUs they are our own kernels over
peer memory (fast/collectives.py), with gloo only to bootstrap them and for the host's per-chunk flag, so no NCCL
call is on the decode path and the TP round is captured in the decode-loop graph.
docs/model.md's TP layout: two all-reduces per decoder layer (after the row-parallel o_proj and Down), one after the vocabulary-parallel embedding and eh_proj, and one
all-gather of sampling candidates per sampled row block.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
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
    peers: Any = field(default=None, compare=False)  # fast.collectives.PeerCollectives on GPUs (with_peers)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "Parallel":
        return cls(0, 1, torch.device(device))

    @property
    def active(self) -> bool:
        return self.world > 1 and not self.local_collectives

    @property
    def group_size(self) -> int:
        """The processes the collectives run among: the TP degree (a benchmark's partial layout may run fewer)."""
        return self.world

    @property
    def capturable(self) -> bool:
        """Whether a round's collectives may be captured in a CUDA graph: none, or our peer-memory kernels."""
        return not self.active or self.peers is not None

    def with_peers(self, hidden: int, candidates: int, dtype: torch.dtype) -> "Parallel":
        """This context with its peer-memory collectives (GPUs, TP > 1), built collectively by every rank."""
        if not self.active or self.device.type != "cuda" or self.peers is not None:
            return self
        from .collectives import PeerCollectives

        return replace(self, peers=PeerCollectives(self.group, self.rank, self.group_size, hidden, candidates, dtype,
                                                   self.device))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer over ranks (rank order with the peer kernels)."""
        if self.peers is not None:
            return self.peers.all_reduce(x)
        if self.active:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.peers is not None:
            return self.peers.all_gather_last(x)
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """A host-level value (the per-chunk continue flag) from `src`: through the host, as gloo takes it."""
        if self.active:
            host = x.cpu()
            dist.broadcast(host, src=src, group=self.group)
            x.copy_(host)
        return x

    def check(self) -> None:
        """Raise if a peer collective gave up waiting (fast/collectives.py)."""
        if self.peers is not None:
            self.peers.check()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process(rank: int, world: int, port: int, device_kind: str, shared_gpu: bool = False) -> Parallel:
    """Join the process group of `world` ranks on this host (gloo: on GPUs it only bootstraps the peer collectives).
    `shared_gpu`: every rank on GPU 0 (testing TP on one GPU, under an MPS daemon so the ranks run side by side)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if device_kind == "cuda":
        index = 0 if shared_gpu else rank
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return Parallel(rank, world, device, group=dist.group.WORLD if world > 1 else None)

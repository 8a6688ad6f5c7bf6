"""Tensor-parallel collectives on GPUs as our own kernels over peer memory (kernels/allreduce.py), so that a TP round
is captured in the decode-loop graph as a TP=1 round is: no NCCL call on the decode path.

Each rank allocates its communication buffers once, shares them by CUDA IPC (`reduce_tensor`, exchanged over the
process group: gloo is enough, it only bootstraps) and keeps every peer's view; the same works for ranks on
different GPUs (over NVLink, peer access opened by the IPC mapping) and for several ranks on one GPU (under an MPS
daemon, so their kernels run side by side). NVLink multicast is not used. A call that waits for a peer past the
timeout sets a device error flag that ends the decode loop (fast/state.py); `check()` turns it into one error naming
the rank and the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

ROWS = 64  # rows a call takes: the largest block (a prefill block of fast/rank.py's PREFILL_BLOCK)
TAGS = ("all_reduce", "all_reduce_add_norm", "all_gather")
# A peer that has not written after this long has stopped: long enough for the ranks' first calls, which may each wait
# on another rank still compiling its kernels (seconds under load), short enough that a dead rank ends the decode.
TIMEOUT_NS = 60_000_000_000


class CollectiveError(RuntimeError):
    """A peer's data never arrived: the rank and the collective are named."""


class PeerBuffer:
    """One kind of collective's buffer, [3 slots, world lanes, ROWS, width], on this rank and mapped from every peer,
    with this rank's call counter (fresh calls start at slot 0 on every rank)."""

    def __init__(self, group, rank: int, world: int, width: int, dtype: torch.dtype, device: torch.device):
        from ..kernels.allreduce import SLOTS, arm

        self.own = arm(torch.empty((SLOTS, world, ROWS, width), dtype=dtype, device=device))
        self.state = torch.zeros(8, dtype=torch.int32, device=device)  # call, arrivals, rows and width used per slot
        torch.cuda.synchronize(device)  # armed before any peer can map it
        handles: list = [None] * world
        gpu = str(torch.cuda.get_device_properties(device).uuid)
        dist.all_gather_object(handles, (reduce_tensor(self.own), gpu), group=group)
        self.views = [self.own if p == rank else rebuild(*args) for p, ((rebuild, args), _) in enumerate(handles)]
        self.shared_gpu = len({g for _, g in handles}) < world  # several ranks on one GPU (under MPS)
        self.peers = torch.tensor([v.data_ptr() for v in self.views], dtype=torch.int64, device=device)

    def release(self) -> None:
        self.views = []


class PeerCollectives:
    """This rank's peer-memory collectives: the plain all-reduce (embedding, eh_proj), the all-reduce ending in the
    sandwich tail (a layer's two reduction points) and the all-gather of sampling candidates."""

    def __init__(self, group, rank: int, world: int, hidden: int, candidates: int, dtype: torch.dtype,
                 device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.reduce = PeerBuffer(group, rank, world, hidden, dtype, device)
        self.gather = PeerBuffer(group, rank, world, candidates, torch.int64, device)
        self.error = torch.zeros((), dtype=torch.int32, device=device)  # the decode loop's halt flag (fast/state.py)
        # Ranks sharing a GPU: a collective lets the next kernel launch only once its data arrived (kernels/allreduce.py)
        self.hold = self.reduce.shared_gpu
        dist.barrier(group=group)  # every rank holds every view before any pushes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.allreduce import all_reduce

        b = self.reduce
        return all_reduce(x.contiguous(), b.peers, b.own, b.state, self.error, self.rank, tag=0,
                          timeout_ns=TIMEOUT_NS, pdl=True, hold=self.hold)

    def all_reduce_add_norm(self, partial, residual: torch.Tensor, scale: float, y_norm: torch.Tensor | None,
                            next_norm: torch.Tensor, eps: float,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the sum over ranks, h, b): the reduction ending in the sandwich tail (kernels/rmsnorm.py's `add_norm` on
        the sum), in one launch. `partial`: a tensor, or the MoE's uncombined kernels.moe.ExpertOutputs."""
        from ..kernels.allreduce import Tail, all_reduce

        b = self.reduce
        partial = partial.contiguous() if isinstance(partial, torch.Tensor) else partial
        return all_reduce(partial, b.peers, b.own, b.state, self.error, self.rank, tag=1,
                          timeout_ns=TIMEOUT_NS, tail=Tail(residual, scale, y_norm, next_norm, eps, dtype), pdl=True,
                          hold=self.hold)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.allreduce import all_gather

        b = self.gather
        return all_gather(x.contiguous(), b.peers, b.own, b.state, self.error, self.rank, tag=2,
                          timeout_ns=TIMEOUT_NS, pdl=True, hold=self.hold)

    def check(self) -> None:
        """Raise if a poll of this rank gave up waiting for a peer (one device read)."""
        code = int(self.error)
        if code:
            tag, lane = divmod(code, 1024)
            raise CollectiveError(f"rank {self.rank}: the {TAGS[tag - 1]} collective waited past "
                                  f"{TIMEOUT_NS / 1e9:.0f} s for rank {lane}'s data (that rank stopped or never "
                                  f"wrote); the decode was ended")

    def release(self) -> None:
        """Drop the peers' views (before the process exits: a producer gone before its consumers warns)."""
        self.reduce.release()
        self.gather.release()

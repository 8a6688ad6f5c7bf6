"""The broken pieces of the peer collectives' negative controls (tests/test_tp_collectives.py), each a stand-in for
one piece of kernels/allreduce.py's protocol that `_all_reduce` takes: a poll that does not wait for the data, a
re-arm that never re-arms, a reduction in each rank's own order. Module-level jit functions: Triton reads a kernel's
globals from its module."""

import triton
import triton.language as tl

from iquest.kernels.allreduce import _advance


@triton.jit
def poll_without_waiting(own_ptr, slot, p, row, W, S, error_ptr, timeout_ns, tag, start, WORLD: tl.constexpr,
                         CAP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    i = tl.arange(0, BLOCK)
    return tl.load(own_ptr + ((slot * WORLD + p) * CAP + row).to(tl.int64) * S + i, mask=i < W, volatile=True)


@triton.jit
def never_rearm(own_ptr, state_ptr, call, slot, first, P, R, W, S, WORLD: tl.constexpr, CAP: tl.constexpr,
                BLOCK: tl.constexpr, BITS: tl.constexpr):
    _advance(state_ptr, call, slot, P, R)


@triton.jit
def own_order(step, rank, WORLD: tl.constexpr):
    return (step + rank) % WORLD


BROKEN = {"poll": poll_without_waiting, "rearm": never_rearm, "order": own_order}

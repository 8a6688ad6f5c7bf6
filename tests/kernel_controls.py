"""The broken pieces of the kernels' negative controls, each a stand-in for one jit piece of a product kernel, so the
product files carry no switch for a defect. Module-level jit functions: Triton reads a kernel's globals from its
module.

- The peer collectives (tests/test_tp_collectives.py), pieces `_all_reduce` takes: a poll that does not wait for the
  data, a re-arm that never re-arms, a reduction in each rank's own order (`BROKEN`).
- moe (tests/test_kernel_moe.py), put into copies of its kernels by `kernels.testing.substituted` (`MOE`): an owner
  rule without the dedup (every live pair's program works), a split sum that drops the last split.
- The router's select (tests/test_kernel_router.py, `ROUTER`): ties to the higher index.
- The FP8 linears (tests/test_bench_sass.py, tests/test_kernel_fp8_linear_direct.py): the preloaded weight tiles
  used without the opaque move after the wait (`LINEAR_TRANSPARENT`), the direct kernel's K tiles summed last to
  first (`DIRECT_REVERSED`).
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from iquest.kernels.allreduce import _advance
from iquest.kernels.moe_route import load_live


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


@triton.jit
def owner_without_dedup(experts_ptr, live_ptr, p, R, K_TOP: tl.constexpr, P_PAD: tl.constexpr,
                        LIVE_COUNT: tl.constexpr):
    return tl.load(experts_ptr + p), load_live(live_ptr, p // K_TOP, R, LIVE_COUNT)


@triton.jit
def split_sum_dropping_last(part_ptr, pair, n, ok, P, I, SPLIT: tl.constexpr):
    src = part_ptr + (pair * 2)[:, None] * I + n[None, :]
    g = tl.zeros([pair.shape[0], n.shape[0]], tl.float32)
    u = tl.zeros([pair.shape[0], n.shape[0]], tl.float32)
    summed = 0
    for s in tl.static_range(SPLIT - 1):
        g += tl.load(src + s * P * 2 * I, mask=ok[:, None], other=0.0)
        u += tl.load(src + s * P * 2 * I + I, mask=ok[:, None], other=0.0)
        summed += 1
    return g, u, summed


MOE = {"no_dedup": {"_moe_gate_up_kernel": {"_expert_owner": owner_without_dedup},
                    "_moe_down_kernel": {"_expert_owner": owner_without_dedup}},
       "drop_last_split": {"_moe_finalize_kernel": {"_split_sum": split_sum_dropping_last}}}


@triton.jit
def ranked_high(idx, E_PAD: tl.constexpr):
    return E_PAD - 1 - idx


ROUTER = {"_router_select_kernel": {"_tie_rank": ranked_high}}


@triton.jit
def after_wait_transparent(w, PDL: tl.constexpr):
    return w


LINEAR_TRANSPARENT = {"_after_wait": after_wait_transparent}


@gluon.jit
def sum_reversed(acc, ps, STEPS: gl.constexpr, G: gl.constexpr, acc_l: gl.constexpr):
    for j in gl.static_range(STEPS):  # the last step first, and within a step the second tile first
        p, s = ps[STEPS - 1 - j]
        if G == 2:
            a, b = gl.split(p)
            sa, sb = gl.split(s)
            acc = acc + gl.convert_layout(b, acc_l) * gl.convert_layout(sb, acc_l)
            acc = acc + gl.convert_layout(a, acc_l) * gl.convert_layout(sa, acc_l)
        else:
            acc = acc + gl.sum(p, axis=2) * gl.sum(s, axis=2)
    return acc


DIRECT_REVERSED = {"_fp8_linear_direct_kernel": {"_ordered_sum": sum_reversed}}

"""Tensor-parallel collectives as kernels over peer memory: the data itself is the readiness signal.

Every rank owns a buffer of 3 slots x WORLD lanes x CAP rows, mapped into every peer by CUDA IPC (fast/collectives.py
exchanges the handles once). A call takes the next slot s of this rank's call counter (a device int, so graph
replays and device-chosen draft depths keep the sequence): each program stores its partial rows into lane `rank` of
slot s in every peer's buffer, then polls its own buffer's lanes of those rows with volatile loads until no element
holds the sentinel, and reduces them in rank order 0, 1, ..., WORLD-1 in fp32, so every rank computes the
same bits by construction. It then re-arms (fills with the sentinel) the rows and width the previous call used in slot
s - 1 of its own buffer: every peer finished writing that slot before this rank could have read it, and no peer
writes it again before this rank's next call has pushed (three slots make the order safe). The call's last
program to arrive advances the counter.

A call launches at most PROGRAMS programs (one row each at decode, where blocks have <= 8 rows; rows pid, pid + P, ...
in a prefill block), and each pushes all its rows before it polls any: so a call completes once its programs are
resident, never needing one row's program to wait for the SMs another holds while polling. This matters where ranks
share one GPU (several ranks under MPS: the sum of their programs must fit at once) and bounds what a call holds on
its own GPU.

The sentinel is -0.0 (TensorRT-LLM's choice), and a pushed -0.0 is stored as +0.0: then a NaN a rank produces flows
into the sum as it would through NCCL instead of reading as "not written yet", and the only value changed is the
sign of a zero (a sum of zeros comes out +0.0). Candidate keys (int64, the all-gather of vocabulary-parallel
sampling) use INT64_MIN, which no key holds (its id part would be 2^32 - 1).

A poll that waits past `timeout_ns` (the GPU's global timer) gives up: it records (tag, lane) in the error flag and
the kernel completes with a wrong value; the decode loop's condition reads the flag and ends, and the host raises
naming the rank and the collective (fast/collectives.py). A poll that finds the flag already set gives up at once, so
the collectives left in an eager round (tens of them) end within the one timeout, not one each. A rank that never
writes cannot hang its peers.

`HOLD` (ranks sharing one GPU) lets the next kernel launch only once this call's data has arrived, not at the start:
its programs, resident early and waiting, would otherwise take the SMs a peer on the same GPU needs to push.

A `Tail` ends the all-reduce in the published layer's sandwich tail (docs/model.md, "Forward"), so a layer's two
reduction points cost one launch each, not two: the sum rounded to its dtype, then kernels/rmsnorm.py's
`sandwich_tail` on it (the branch norm when given, the scale, the residual add, the next norm): the same definition
`add_norm` runs, built alike (`rmsnorm.compile_options`), so the fused call has the bits of the all-reduce followed
by `add_norm`. Its input may be the MoE's uncombined `ExpertOutputs` (kernels/moe.py): each row is then combined
(`moe.weighted_sum`) and rounded to the buffer's dtype as it is pushed, the bits of `moe.combine`, the cast and the
plain all-reduce.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import moe, rmsnorm
from .launch import launch_options, release_dependents, wait_for_inputs, wait_holding_dependents
from .moe_route import load_live

SLOTS = 3
PROGRAMS = 8
INT64_MIN = -(2 ** 63)


@triton.jit
def _now(after):
    """The GPU's global nanosecond timer, read once `after` is available."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _sentinel_of(v, BITS: tl.constexpr):
    """Where `v` holds the sentinel: -0.0 for floats (BITS 16 or 32), INT64_MIN for keys (BITS 64)."""
    if BITS == 16:
        return v.to(tl.int16, bitcast=True) == -32768
    elif BITS == 32:
        return v.to(tl.int32, bitcast=True) == -2147483648
    else:
        return v == -9223372036854775807 - 1


@triton.jit
def _sentinel(v, BITS: tl.constexpr):
    if BITS == 16:
        return tl.full(v.shape, -32768, tl.int16).to(v.dtype, bitcast=True)
    elif BITS == 32:
        return tl.full(v.shape, -2147483648, tl.int32).to(v.dtype, bitcast=True)
    else:
        return tl.full(v.shape, -9223372036854775807 - 1, tl.int64)


@triton.jit
def _push(v, row, W, S, peers_ptr, own_ptr, slot, rank, WORLD: tl.constexpr, CAP: tl.constexpr,
          BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Store this row `v` [BLOCK] (W valid; the buffer's rows are S wide) into lane `rank` of slot `slot` in every
    peer's buffer (this rank's own included)."""
    i = tl.arange(0, BLOCK)
    ok = i < W
    if BITS != 64:  # -0.0 is the sentinel: push +0.0 for it (equal in every later operation)
        v = tl.where(_sentinel_of(v, BITS), tl.zeros_like(v), v)
    lane = ((slot * WORLD + rank) * CAP + row).to(tl.int64) * S
    for p in tl.static_range(WORLD):
        peer = tl.load(peers_ptr + p).to(tl.pointer_type(own_ptr.dtype.element_ty))
        tl.store(peer + lane + i, v, mask=ok)


@triton.jit
def _poll(own_ptr, slot, p, row, W, S, error_ptr, timeout_ns, tag, start,
          WORLD: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Lane p of this row in slot `slot` of the own buffer, once no element holds the sentinel (or the timeout)."""
    i = tl.arange(0, BLOCK)
    ok = i < W
    ptr = own_ptr + ((slot * WORLD + p) * CAP + row).to(tl.int64) * S + i
    got = tl.load(ptr, mask=ok, volatile=True)
    waiting = tl.sum((_sentinel_of(got, BITS) & ok).to(tl.int32), axis=0)
    late = waiting * 0
    while (waiting > 0) & (late == 0):
        got = tl.load(ptr, mask=ok, volatile=True)
        waiting = tl.sum((_sentinel_of(got, BITS) & ok).to(tl.int32), axis=0)
        gave_up = tl.load(error_ptr, volatile=True) != 0  # an earlier poll of this rank timed out
        late = ((_now(waiting) - start > timeout_ns) | gave_up).to(tl.int32)
    if waiting > 0:  # the first timeout is kept: (tag + 1) * 1024 + the lane that never arrived
        tl.atomic_cas(error_ptr, 0, (tag + 1) * 1024 + p)
    return got


@triton.jit
def _rearm_and_advance(own_ptr, state_ptr, call, slot, first, P, R, W, S, WORLD: tl.constexpr, CAP: tl.constexpr,
                       BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Fill what the previous call wrote into the own buffer (its rows and its width: calls of one buffer may differ
    in width, as the sampling and logprob gathers do) with the sentinel, this program's share (rows first, first + P,
    ... of P programs), then `_advance`."""
    i = tl.arange(0, BLOCK)
    prev = (call + 2) % 3
    prev_rows = tl.load(state_ptr + 2 + prev)
    prev_width = tl.load(state_ptr + 5 + prev)
    sentinel = _sentinel(tl.zeros([BLOCK], dtype=own_ptr.dtype.element_ty), BITS)
    r = first
    while r < prev_rows:
        for p in tl.static_range(WORLD):
            row = own_ptr + ((prev * WORLD + p) * CAP + r).to(tl.int64) * S
            for c in range(0, prev_width, BLOCK):
                tl.store(row + c + i, sentinel, mask=c + i < prev_width)
        r += P
    _advance(state_ptr, call, slot, P, R, W)


@triton.jit
def _advance(state_ptr, call, slot, P, R, W):
    """Count this program in; the call's last of P programs records its R rows and width W and advances the call
    counter."""
    ticket = tl.atomic_add(state_ptr + 1, 1)
    if ticket == P - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr + 2 + slot, R)
        tl.store(state_ptr + 5 + slot, W)
        tl.store(state_ptr, call + 1)


@triton.jit
def _start_call(state_ptr, HOLD: tl.constexpr, PDL: tl.constexpr):
    """After the wait for the inputs (the next kernel released now, or with HOLD once the data arrived): this call's
    number and slot."""
    if HOLD:
        wait_holding_dependents(PDL)
    else:
        wait_for_inputs(PDL)
    call = tl.load(state_ptr)
    return call, call % 3


@triton.jit
def _rank_order(step, rank, WORLD: tl.constexpr):
    """The lane a reduction adds at `step`: the same order, 0, 1, ..., on every rank."""
    return step


@triton.jit
def _all_reduce_kernel(x_ptr, rw_ptr, live_ptr, peers_ptr, own_ptr, state_ptr, error_ptr, sum_ptr, res_ptr, yw_ptr,
                       nw_ptr, h_ptr, b_ptr, R, H, S, rank, eps, scale, timeout_ns, tag, stride_x, stride_sum,
                       stride_res, stride_h, stride_b,
                       WORLD: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                       COMBINE: tl.constexpr, K_TOP: tl.constexpr, LIVE_COUNT: tl.constexpr,
                       TAIL: tl.constexpr, Y_NORM: tl.constexpr, SCALED: tl.constexpr,
                       POLL: tl.constexpr, REARM: tl.constexpr, ORDER: tl.constexpr,
                       HOLD: tl.constexpr, PDL: tl.constexpr = False):
    # COMBINE: x is the experts' outputs [R * K_TOP, H] (rw their routing weights, live the rows), combined here
    # POLL, REARM, ORDER: the pieces of the protocol (_poll, _rearm_and_advance, _rank_order); the tests' negative
    # controls pass broken ones to show that their checks fail
    first = tl.program_id(0)
    P = tl.num_programs(0)
    i = tl.arange(0, BLOCK)
    ok = i < H
    RDT: tl.constexpr = h_ptr.dtype.element_ty
    DT: tl.constexpr = b_ptr.dtype.element_ty
    if TAIL:  # the norms' weights are constant: read before the wait
        yw, nw = rmsnorm.tail_weights(yw_ptr, nw_ptr, i, ok, Y_NORM)
    call, slot = _start_call(state_ptr, HOLD, PDL)
    for row in range(first, R, P):  # every row of this program pushed before any poll
        if COMBINE:
            live = load_live(live_ptr, row, R, LIVE_COUNT)
            v = tl.where(live, moe.weighted_sum(x_ptr, rw_ptr, row, i, ok, live, H, K_TOP), 0.0)
            v = v.to(own_ptr.dtype.element_ty)
        else:
            v = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0)
        _push(v, row, H, S, peers_ptr, own_ptr, slot, rank, WORLD, CAP, BLOCK, BITS)
    start = _now(first)
    for row in range(first, R, P):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for step in tl.static_range(WORLD):  # rank order: the same sum on every rank
            acc += POLL(own_ptr, slot, ORDER(step, rank, WORLD), row, H, S, error_ptr, timeout_ns, tag, start, WORLD,
                        CAP, BLOCK, BITS).to(tl.float32)
        s = acc.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + i, s, mask=ok)
        if TAIL:  # on the rounded sum, as add_norm reads it
            res = tl.load(res_ptr + row * stride_res + i, mask=ok, other=0.0).to(tl.float32)
            h, b = rmsnorm.sandwich_tail(res, s.to(tl.float32), yw, nw, eps, scale, H, Y_NORM, SCALED, RDT, DT)
            tl.store(h_ptr + row * stride_h + i, h.to(RDT), mask=ok)
            tl.store(b_ptr + row * stride_b + i, b.to(DT), mask=ok)
    if HOLD:
        release_dependents(PDL)
    REARM(own_ptr, state_ptr, call, slot, first, P, R, H, S, WORLD, CAP, BLOCK, BITS)


@triton.jit
def _all_gather_kernel(x_ptr, peers_ptr, own_ptr, state_ptr, error_ptr, out_ptr, R, K, S, rank, timeout_ns, tag,
                       stride_x, stride_out, WORLD: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                       HOLD: tl.constexpr, PDL: tl.constexpr = False):
    first = tl.program_id(0)
    P = tl.num_programs(0)
    i = tl.arange(0, BLOCK)
    ok = i < K
    call, slot = _start_call(state_ptr, HOLD, PDL)
    for row in range(first, R, P):
        v = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0)
        _push(v, row, K, S, peers_ptr, own_ptr, slot, rank, WORLD, CAP, BLOCK, 64)
    start = _now(first)
    for row in range(first, R, P):
        for p in tl.static_range(WORLD):  # the ranks' candidates concatenated in rank order
            got = _poll(own_ptr, slot, p, row, K, S, error_ptr, timeout_ns, tag, start, WORLD, CAP, BLOCK, 64)
            tl.store(out_ptr + row * stride_out + p * K + i, got, mask=ok)
    if HOLD:
        release_dependents(PDL)
    _rearm_and_advance(own_ptr, state_ptr, call, slot, first, P, R, K, S, WORLD, CAP, BLOCK, 64)


# ---- wrappers ----------------------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"allreduce: {message}")


def sentinel_bits(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32, torch.int64: 64}[dtype]


def arm(buffer: torch.Tensor) -> torch.Tensor:
    """Fill a communication buffer with its sentinel (-0.0, or INT64_MIN for keys), in place."""
    if buffer.dtype == torch.int64:
        return buffer.fill_(INT64_MIN)
    return buffer.fill_(-0.0)


def _check_buffer(x: torch.Tensor, peers: torch.Tensor, own: torch.Tensor, state: torch.Tensor,
                  error: torch.Tensor, rank: int) -> tuple[int, int]:
    world = peers.numel()
    _check(own.dim() == 4 and own.shape[0] == SLOTS and own.shape[1] == world and own.is_contiguous(),
           f"the buffer must be contiguous [{SLOTS}, {world}, CAP, width], got {tuple(own.shape)}")
    _check(0 <= rank < world, f"rank {rank} outside the {world} lanes")
    _check(x.dim() == 2 and x.shape[0] <= own.shape[2] and x.shape[1] <= own.shape[3] and x.stride(-1) == 1,
           f"rows [R <= {own.shape[2]}, <= {own.shape[3]}] with unit stride expected, got {tuple(x.shape)}")
    _check(x.dtype == own.dtype, f"rows are {x.dtype}, the buffer {own.dtype}")
    _check(peers.dtype == torch.int64 and state.dtype == torch.int32 and state.numel() >= 8
           and error.dtype == torch.int32, "peers int64 [world], state int32 [>= 8], error int32")
    _check(all(t.device == x.device for t in (peers, own, state, error)), "tensors on several devices")
    return world, x.shape[0]


class Tail(NamedTuple):
    """The sandwich tail an all-reduce may end in: kernels/rmsnorm.py's `add_norm` arguments after its branch output
    (the sum): h = residual + branch * scale, b = next_norm(h) rounded to `dtype`."""

    residual: torch.Tensor          # [R, H], the stream's dtype (the draft's is fp32)
    scale: float
    y_norm: torch.Tensor | None     # the branch norm's weight [H], or None (the branch added as it is)
    next_norm: torch.Tensor         # [H]
    eps: float
    dtype: torch.dtype              # b's


def all_reduce(x: torch.Tensor | moe.ExpertOutputs, peers: torch.Tensor, own: torch.Tensor, state: torch.Tensor,
               error: torch.Tensor, rank: int, *, tag: int = 0, timeout_ns: int = 2_000_000_000,
               out: torch.Tensor | None = None, tail: Tail | None = None, pdl: bool = False, hold: bool = False):
    """sum over ranks of x [R, H] (rank order, fp32, rounded to x's dtype), into `out`; x may be the MoE's
    `ExpertOutputs`, combined and rounded to their compute dtype first. `peers` int64 [world]: every
    rank's buffer address (this rank's own at index rank); `own` this rank's buffer [3, world, CAP, H] in x's dtype
    (armed); `state` int32 [8] this rank's call counter, arrival count, rows and width per slot (zeroed at the start);
    `error` int32 [>= 1]: 0, or (tag + 1) * 1024 + the lane a poll gave up on.
    `tail`: also the sandwich tail on the sum; returns (sum, h, b) then, else the sum. `hold`: the next kernel
    launches once the data arrived (ranks sharing a GPU)."""
    return _all_reduce(x, peers, own, state, error, rank, tag, timeout_ns, out, tail, pdl, hold=hold)


def _all_reduce(x, peers, own, state, error, rank, tag, timeout_ns, out, tail, pdl,
                poll=_poll, rearm=_rearm_and_advance, order=_rank_order, hold=False):
    """all_reduce with the protocol's pieces given: the negative controls of tests/test_tp_collectives.py."""
    experts = x if isinstance(x, moe.ExpertOutputs) else None
    if experts is not None:  # the sum's buffer stands for the rows in the checks; the kernel reads y, weights, live
        if out is None:
            out = torch.empty((experts.rows, experts.y.shape[1]), dtype=experts.dtype, device=experts.y.device)
        x = out
    world, R = _check_buffer(x, peers, own, state, error, rank)
    H = x.shape[1]
    out = torch.empty_like(x) if out is None else out
    _check(out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1, "out must be like x")
    options = rmsnorm.compile_options(rmsnorm.RmsNormSettings())  # the tail's build; the sum's adds are unaffected
    if tail is not None:
        scale = rmsnorm.check_tail("all_reduce", tail.residual, x, tail.scale, tail.y_norm, tail.next_norm,
                                   tail.eps, tail.dtype)
        res = tail.residual
        h = torch.empty((R, H), dtype=res.dtype, device=x.device)
        b = torch.empty((R, H), dtype=tail.dtype, device=x.device)
        yw = tail.next_norm if tail.y_norm is None else tail.y_norm
        args = (res, yw, tail.next_norm, h, b, float(tail.eps), scale)
        strides = (res.stride(0), h.stride(0), b.stride(0))
    else:
        scale = 1.0
        args, strides = (out, out, out, out, out, 1.0, 1.0), (0, 0, 0)
    res_, yw_, nw_, h_, b_, eps_, scale_ = args
    if R:
        src = (x, x, x) if experts is None else (experts.y, experts.weights, experts.live)
        _all_reduce_kernel[(min(R, PROGRAMS),)](
            *src, peers, own, state, error, out, res_, yw_, nw_, h_, b_, R, H, own.shape[3], rank, eps_, scale_,
            timeout_ns, tag, x.stride(0), out.stride(0), *strides, WORLD=world, CAP=own.shape[2],
            BLOCK=triton.next_power_of_2(H), BITS=sentinel_bits(x.dtype), COMBINE=experts is not None,
            K_TOP=1 if experts is None else experts.weights.shape[1],
            LIVE_COUNT=experts is not None and experts.count, TAIL=tail is not None,
            Y_NORM=tail is not None and tail.y_norm is not None, SCALED=scale != 1.0, POLL=poll, REARM=rearm,
            ORDER=order, HOLD=hold, **options, **launch_options(pdl, x.device))
    return out if tail is None else (out, h_, b_)


def all_gather(x: torch.Tensor, peers: torch.Tensor, own: torch.Tensor, state: torch.Tensor, error: torch.Tensor,
               rank: int, *, tag: int = 0, timeout_ns: int = 2_000_000_000, pdl: bool = False,
               hold: bool = False) -> torch.Tensor:
    """Every rank's int64 x [R, K] concatenated along the last dimension in rank order: [R, world * K]."""
    world, R = _check_buffer(x, peers, own, state, error, rank)
    _check(x.dtype == torch.int64, "the gather takes int64 keys")
    K = x.shape[1]
    out = torch.empty((R, world * K), dtype=torch.int64, device=x.device)
    if R:
        _all_gather_kernel[(min(R, PROGRAMS),)](x, peers, own, state, error, out, R, K, own.shape[3], rank, timeout_ns, tag,
                                 x.stride(0),
                                 out.stride(0), WORLD=world, CAP=own.shape[2], BLOCK=max(16, triton.next_power_of_2(K)),
                                 HOLD=hold, num_warps=1, **launch_options(pdl, x.device))
    return out

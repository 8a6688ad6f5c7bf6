"""What programs that wait cost a bandwidth-bound kernel running beside them (`iquest bench parking`).

Stage cascade (kernels/launch.Pdl.CASCADE) lets kernels launch many launches ahead and park at their PDL wait, and it
made the full-size round slower (docs/PERF.md). A persistent layer kernel would keep programs waiting on flags beside
the ones that stream weights. This probe separates three costs on one GPU, each timed with CUDA events, medians over
repeats, variants alternated:

* `parked`: the time of back-to-back weight-stream kernels (a copy through HBM) while G programs of another stream sit
  at `griddepcontrol.wait` (behind a one-program kernel that spins on the GPU timer): what the hardware wait costs.
* `spinning`: the same with G programs polling a flag in global memory (what a software-scheduled persistent kernel
  does while it waits).
* `chain`: a CUDA graph of [stream, N small kernels] x ITER, all launched with PDL, CHAINED against CASCADE: the round's
  pattern, where the small kernels are latency and the stream is bytes.
* `dependent step`: 10 N small kernels that each read what the previous one wrote, as plain, chained and cascaded
  launches, and the same steps inside one launch of co-resident programs behind three kinds of grid barrier: what one
  dependency costs, the unit of `bench step`'s step-and-byte bound (`dependent_step_us`).
"""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from ..kernels.device import sm_count
from ..kernels.launch import Pdl, launch_options, wait_for_inputs

COPY_BLOCK = 4096  # fp32 elements a program copies per step


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    start = tl.program_id(0) * per_program
    for i in range(start, tl.minimum(start + per_program, n), BLOCK):
        o = i + tl.arange(0, BLOCK)
        tl.store(dst_ptr + o, tl.load(src_ptr + o, mask=o < n), mask=o < n)


@triton.jit
def _small_kernel(out_ptr, DEPENDENT: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    if DEPENDENT:  # a true dependency on the previous kernel, as each of the round's small kernels has
        tl.store(out_ptr + tl.program_id(0), tl.load(out_ptr + tl.program_id(0)) + 1)
    else:
        tl.store(out_ptr + tl.program_id(0), tl.program_id(0))


@triton.jit
def _hold_kernel(ns, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t0 = globaltimer()
    while globaltimer() - t0 < ns:
        pass


@triton.jit
def _wait_count(ptr, target):
    """Every thread polls `ptr` (acquire, GPU scope) until it holds >= target: no block barrier per poll, as the scalar
    atomic's broadcast through shared memory would add."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; spin${:uid}: ld.global.acquire.gpu.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra spin${:uid}; }",
        "=r,l,r", [ptr, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier_chain_kernel(out_ptr, sync_ptr, steps, G, BARRIER: tl.constexpr, G_PAD: tl.constexpr = 1):
    """`steps` dependent steps inside one launch of G co-resident programs (GPU only: the programs spin on each
    other): step i waits until all G programs finished step i - 1, reads a neighbour's value of that step and writes
    its own, then publishes itself. What a persistent kernel pays per dependency where the round pays a kernel
    boundary. BARRIER: "atomic", one counter a step (release add; a scalar acquire poll); "asm", the same counters
    with every thread polling in PTX (`_wait_count`); "flags", one flag a program (a release store of the step done;
    the waiter polls all G flags, G_PAD >= G, with volatile loads, then an acquire fence): no atomics queueing at
    one address."""
    pid = tl.program_id(0)
    offs = tl.arange(0, G_PAD)
    for i in range(steps):
        if i > 0:
            if BARRIER == "flags":
                seen = tl.min(tl.load(sync_ptr + offs, mask=offs < G, other=steps, volatile=True), axis=0)
                while seen < i:
                    seen = tl.min(tl.load(sync_ptr + offs, mask=offs < G, other=steps, volatile=True), axis=0)
                tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
            elif BARRIER == "asm":
                _wait_count(sync_ptr + i - 1, G)
            else:
                while tl.atomic_add(sync_ptr + i - 1, 0, sem="acquire") < G:
                    pass
        v = tl.load(out_ptr + (i % 2) * G + (pid + 1) % G, volatile=True)
        tl.store(out_ptr + ((i + 1) % 2) * G + pid, v + 1)
        if BARRIER == "flags":
            tl.atomic_xchg(sync_ptr + pid, i + 1, sem="release")
        else:
            tl.atomic_add(sync_ptr + i, 1, sem="release")


@triton.jit
def _spin_kernel(flag_ptr):
    while tl.load(flag_ptr, volatile=True) == 0:
        pass


class Streams:
    """Buffer pairs of `mb` MB each, used in rotation so that every copy reads from HBM, not L2."""

    def __init__(self, mb: int, pairs: int, device: torch.device) -> None:
        n = mb * 2**20 // 4
        self.bufs = [(torch.randn(n, device=device), torch.empty(n, device=device)) for _ in range(pairs)]
        self.n, self.i = n, 0
        self.programs = 2 * sm_count(device)
        self.per_program = triton.cdiv(triton.cdiv(n, self.programs), COPY_BLOCK) * COPY_BLOCK

    def copy(self, pdl: Pdl = Pdl.OFF) -> None:
        src, dst = self.bufs[self.i % len(self.bufs)]
        self.i += 1
        _copy_kernel[(self.programs,)](src, dst, self.n, self.per_program, BLOCK=COPY_BLOCK, num_warps=4,
                                       **launch_options(pdl, src.device))

    def bytes(self) -> int:
        return 2 * self.n * 4  # read + written


def _events_us(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def beside(streams: Streams, waiters: int, how: str, iters: int) -> float:
    """us per copy while `waiters` programs wait on a side stream (`how`: parked at the PDL wait, or spinning)."""
    dev = streams.bufs[0][0].device
    side = torch.cuda.Stream(dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    sink = torch.empty(max(waiters, 1), dtype=torch.int32, device=dev)  # a slot per parked program; launches nothing
    hold_ns = 20_000_000  # far longer than the timed copies; the spinners are released by the flag
    if waiters:
        with torch.cuda.stream(side):
            if how == "parked":  # a PDL kernel itself, so it signals the waiters' launch at once, then holds them
                _hold_kernel[(1,)](hold_ns, num_warps=1, **launch_options(Pdl.CHAINED, dev))
                _small_kernel[(waiters,)](sink, num_warps=4, **launch_options(Pdl.CHAINED, dev))
            else:
                _spin_kernel[(waiters,)](flag, num_warps=4)
        torch.cuda._sleep(2_000_000)  # let the side programs take their places before the timed copies
    us = _events_us(lambda: [streams.copy() for _ in range(iters)], iters)
    if how == "spinning" and waiters:
        flag.fill_(1)
    torch.cuda.synchronize(dev)
    return us


def chain_graph(streams: Streams | None, small: int, pdl: Pdl, iters: int, out: torch.Tensor,
                dependent: bool = False) -> torch.cuda.CUDAGraph:
    """[copy (unless `streams` is None), `small` small kernels] x iters, every launch with `pdl`."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            if streams is not None:
                streams.copy(pdl)
            for _ in range(small):
                _small_kernel[(sm_count(out.device),)](out, DEPENDENT=dependent, num_warps=4,
                                                       **launch_options(pdl, out.device))
    return g


def dependent_step_us(device: torch.device, steps: int = 100, repeats: int = 9) -> float:
    """Median us of one dependent step as the engine launches it (a PDL-chained small kernel on every SM that reads
    what the previous one wrote): the least any kernel of the round's chain can cost."""
    out = torch.zeros(sm_count(device), dtype=torch.int32, device=device)
    g = chain_graph(None, steps, Pdl.CHAINED, 1, out, dependent=True)
    g.replay()
    torch.cuda.synchronize(device)
    return statistics.median(_events_us(g.replay, steps) for _ in range(repeats))


def run(out_path: str | None, repeats: int = 9, mb: int = 32, small: int = 10, iters: int = 20) -> dict:
    dev = torch.device("cuda")
    streams = Streams(mb, 8, dev)
    sms = sm_count(dev)
    streams.copy()
    torch.cuda.synchronize()
    report = {"bench": "parking", "device": torch.cuda.get_device_name(dev), "sms": sms, "copy_mb": mb,
              "copy_bytes": streams.bytes(), "copy_programs": streams.programs, "repeats": repeats}
    variants = [("none", 0)] + [(how, w) for how in ("parked", "spinning") for w in (sms, 4 * sms)]
    for how, w in variants:  # warm up (compiles) each side kernel once, untimed
        beside(streams, w, how, 2)
    times = {f"{how}:{w}": [] for how, w in variants}
    for _ in range(repeats):
        for how, w in variants:
            times[f"{how}:{w}"].append(beside(streams, w, how, iters))
    report["beside_us_per_copy"] = {k: {"median": statistics.median(v), "all": v} for k, v in times.items()}
    base = statistics.median(times["none:0"])
    report["copy_tb_s"] = streams.bytes() / base / 1e6
    out = torch.zeros(sms, dtype=torch.int32, device=dev)
    graphs = {mode.name: chain_graph(streams, small, mode, iters, out) for mode in (Pdl.CHAINED, Pdl.CASCADE)}
    alone = {"copies": chain_graph(streams, 0, Pdl.CHAINED, iters, out)}
    # The latency of one dependent step with nothing else to hide it: small kernels that each read what the previous
    # one wrote (the round's chain of norms, rotary, attention combine, router select...), per launch mode.
    steps = 10 * small if small else 10
    graphs.update({f"dependent {mode.name}": chain_graph(None, steps, mode, 1, out, dependent=True)
                   for mode in (Pdl.OFF, Pdl.CHAINED, Pdl.CASCADE)})
    count = torch.zeros(max(steps, sms), dtype=torch.int32, device=dev)  # the counters, or one flag a program
    pair = torch.zeros(2 * sms, dtype=torch.int32, device=dev)

    for name, barrier in (("in-kernel", "atomic"), ("in-kernel-asm", "asm"), ("in-kernel-flags", "flags")):
        def launch(barrier=barrier):
            count.zero_()
            _barrier_chain_kernel[(sms,)](pair, count, steps, sms, BARRIER=barrier, G_PAD=triton.next_power_of_2(sms),
                                          num_warps=4)

        launch()  # compile
        graphs[f"dependent {name}"] = SimpleNamespace(replay=launch)  # one launch, not a graph: timed alike
    chain = {k: [] for k in list(graphs) + list(alone)}
    for g in list(graphs.values()) + list(alone.values()):
        g.replay()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for k, g in {**graphs, **alone}.items():
            chain[k].append(_events_us(g.replay, iters))
    for k in [k for k in chain if k.startswith("dependent")]:  # one graph of `steps` kernels: us a step
        chain[k] = [t * iters / steps for t in chain[k]]
    report["chain"] = {"small_kernels": small, "iters": iters, "dependent_steps": steps,
                       "us_per_iter": {k: {"median": statistics.median(v), "all": v} for k, v in chain.items()
                                       if not k.startswith("dependent")},
                       "us_per_dependent_step": {k.split()[1]: {"median": statistics.median(v), "all": v}
                                                 for k, v in chain.items() if k.startswith("dependent")}}
    print(f"copy of {mb} MB (read) through HBM, {streams.programs} programs: {base:.1f} us, "
          f"{report['copy_tb_s']:.2f} TB/s (read + written)")
    for k, v in report["beside_us_per_copy"].items():
        print(f"  beside {k:>14} waiting programs: {v['median']:8.1f} us a copy ({v['median'] / base:.3f}x)")
    for k, v in report["chain"]["us_per_iter"].items():
        print(f"  chain [copy + {small} small] {k:>8}: {v['median']:8.1f} us an iteration")
    for k, v in report["chain"]["us_per_dependent_step"].items():
        print(f"  {steps} dependent small kernels, {k:>8}: {v['median']:6.2f} us a step")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    return report

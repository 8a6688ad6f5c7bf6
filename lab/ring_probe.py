"""Does a persistent chain whose programs keep many ops' weights in flight (TMA into a ring of shared memory) come
near the flat read? Issue 37's structural question, the form the overlap probe (`lab/overlap_probe.py`) left open.

The overlap probe found a persistent kernel with readiness counters no faster than one kernel per op under PDL
(205 against 181 us for four layers whose flat read takes 69 us), with at most one op's first 32 KB in flight a
program while it waited. Here each program (one a SM) owns one contiguous stream: its share of every op of the
chain, in chain order (so an op's last chunk may also hold the next op's first rows). Its TMA unit copies that stream
into a ring of STAGES chunks of shared memory, BOX_R KB each (up to ~208 KB a SM, ~27 MB over the GPU: a third of a
layer), and refills a stage as soon as its chunk is read, whatever op the next chunk belongs to. The program reads
its chunks in order; an op first waits on the readiness counter of the op before it (every program counts itself in
after its store), then reads that op's activation (every program's result of the op before), so the dependencies are
those of `overlap_probe`'s chain: the same ops, bytes and bare ops, with no arithmetic beyond xor folds.

  * `ring`: as the round could do it. The experts' chunks (Gate/Up and Down) are not copied before the wait of
    Gate/Up (the select's result) has passed, since their addresses come from the router; the copies stop at the
    first such chunk until then;
  * `ring-oracle`: every chunk as soon as a stage is free (as if the experts were known a layer earlier);
  * `ring-nowait`: no counter waits: the negative control of the result check (its results must differ);
  * `floor`: the ring's bytes as one flat read (`bench stream-probe`'s best form).

Beside them, in the same process, the overlap probe's two best forms on its own layout of the same streams
(`chain-pdl-preload` at 2 programs a SM, `persistent-prefetch` at 1 a SM). Each ring form's results are checked
against a torch computation of the chain. Timed as `overlap_probe` times: CUDA graphs of calls back to back over
distinct weight copies, CUDA events, medians. GPU only (Gluon); a lab probe the product never imports.

    python3 -m iquest.lab.ring_probe OUT.json [--distinct D] [--no-tiny]   (on the device, PYTHONPATH as ci/gpu.sh
    sets it; --distinct 38 streams the experts of real-request routing)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..bench import tune
from ..bench.kernels_micro import FULL_CONFIG, graph_times
from ..bench.stream_probe import round_streams
from ..provenance import commit
from ..reference.config import Config
from .overlap_probe import LAYERS, SMALL_OPS, SPIN_LIMIT, Chain, flat_floor

ROW = 256  # int32 words a TMA row (1 KB); an op's share is whole rows
EXPERT_OPS = ("gate_up", "down")


@dataclass(frozen=True)
class RingLayout:
    """Rows [a, b) of each program's stream for each op of the chain; the stream padded to whole chunks."""

    names: tuple[str, ...]
    a: tuple[int, ...]
    b: tuple[int, ...]
    rows: int  # a program's stream, padded to a multiple of box_r
    box_r: int
    gates: tuple[int, ...]  # per op: the chunk limit set once this op's wait has passed, -1 = unchanged
    limit0: int  # the chunk limit at the start (the first expert chunk)

    @property
    def chunks(self) -> int:
        return self.rows // self.box_r


def ring_layout(streams: dict[str, int], programs: int, layers: int, box_r: int) -> RingLayout:
    """The chain of `overlap_probe.layer_ops` (per layer q/k/v, o_proj, the router, Gate/Up, Down, each followed by
    its bare ops), each stream's bytes split evenly over `programs` in whole 1 KB rows."""
    names, a, b, row = [], [], [], 0
    gate_up_ops, gated_from = [], []  # index of each layer's Gate/Up op; the first row of its expert streams
    for _ in range(layers):
        for name in ("qkv", "o_proj", "router", "gate_up", "down"):
            rows = -(-streams[name] // (programs * ROW * 4))
            if name == "gate_up":
                gate_up_ops.append(len(names))
                gated_from.append(row)
            names.append(name), a.append(row), b.append(row + rows)
            row += rows
            for _ in range(SMALL_OPS[name]):
                names.append("bare"), a.append(row), b.append(row)
    padded = -(-row // box_r) * box_r
    # after layer L's Gate/Up wait, the limit is L+1's first chunk of expert rows alone (a chunk that also holds the
    # router's last rows is copied, or the router's op would wait on it forever)
    limits = [-(-r // box_r) for r in gated_from[1:]] + [padded // box_r]
    gates = [-1] * len(names)
    for op, limit in zip(gate_up_ops, limits):
        gates[op] = limit
    return RingLayout(tuple(names), tuple(a), tuple(b), padded, box_r, tuple(gates), -(-gated_from[0] // box_r))


def schedule_check(lay: RingLayout, stages: int, gated: bool) -> None:
    """The kernel's copy and read order for one program, replayed on the host (every program is alike, so each
    counter wait passes once this program has passed the op): raises where a read would wait on a chunk never
    asked for (the kernel would hang in its mbarrier wait)."""
    limit = lay.limit0 if gated else lay.chunks
    issued = min(stages, limit)
    released = 0
    for o, (a, b, gate) in enumerate(zip(lay.a, lay.b, lay.gates)):
        if gate >= 0 and gated:
            limit = gate
        issued = max(issued, min(released + stages, limit))
        for c in range(a // lay.box_r, -(-b // lay.box_r)):
            if c >= issued:
                raise RuntimeError(f"op {o} ({lay.names[o]}) reads chunk {c}, only {issued} asked for: a hang")
            released = min(c + 1, b // lay.box_r)
            issued = max(issued, min(released + stages, limit))
    if issued != lay.chunks:
        raise RuntimeError(f"{issued} of {lay.chunks} chunks asked for")


@gluon.jit
def _now(after):
    """The GPU's global nanosecond timer, read once `after` is available."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=gl.int64, is_pure=False,
                                     pack=1)


@gluon.jit
def _top_up(w_desc, ring, bars, base, issued, stop, STAGES: gl.constexpr, BOX_R: gl.constexpr):
    """Copies chunks issued .. stop - 1 of this program's stream into their stages; returns the new count."""
    while issued < stop:
        s = issued % STAGES
        mbarrier.expect(bars.index(s), BOX_R * 1024)
        tma.async_copy_global_to_shared(w_desc, [base + issued * BOX_R, 0], bars.index(s), ring.index(s))
        issued += 1
    return issued


@gluon.jit
def _ring_kernel(w_desc, out_ptr, cnt_ptr, err_ptr, epoch_ptr, stamp_ptr, rows, limit0, gated, wait,
                 A: gl.constexpr, B: gl.constexpr, GATES: gl.constexpr, N_OPS: gl.constexpr, CHUNKS: gl.constexpr,
                 STAGES: gl.constexpr, BOX_R: gl.constexpr, P2: gl.constexpr, SPIN: gl.constexpr,
                 WARPS: gl.constexpr, POLL: gl.constexpr, STAMPS: gl.constexpr = False):
    """The chain, program p reading rows [p * rows, (p + 1) * rows) through the ring. `gated` 0: every chunk copied
    as soon as its stage is free (the oracle); `wait` 0: no waits (the control). POLL: no counters; each result is
    stored as one 64-bit word (this call's epoch, the value), and an op polls the previous op's words themselves
    until every one carries the epoch: one dependent round trip an op instead of a count and then a load.
    STAMPS: each program writes the global timer at each op's start, once its wait and activation load are done,
    and once its result is formed ([op, program, 3] int64): where the chain's time goes."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    tile_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, BOX_R, 256], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    base = pid * rows
    limit = gl.where(gated != 0, limit0, CHUNKS)
    released = pid * 0  # (a tensor, as the loops carry it)
    issued = _top_up(w_desc, ring, bars, base, released, gl.minimum(STAGES, limit), STAGES, BOX_R)
    lanes = gl.arange(0, P2, layout=lane_l)
    row_i = gl.expand_dims(gl.arange(0, BOX_R, layout=gl.SliceLayout(1, tile_l)), 1)
    if POLL:
        epoch = gl.load(epoch_ptr)
    for o in gl.static_range(N_OPS):
        if STAMPS:
            gl.store(stamp_ptr + (o * P + pid) * 3, _now(pid))
        act = 0
        if o > 0:
            if POLL:
                prev = gl.load(out_ptr + (o - 1) * P + lanes, mask=lanes < P, other=epoch << 32, volatile=True)
                if wait != 0:
                    polls = 0
                    while (gl.sum(((prev >> 32) != epoch).to(gl.int32), 0) > 0) & (polls < SPIN):
                        prev = gl.load(out_ptr + (o - 1) * P + lanes, mask=lanes < P, other=epoch << 32,
                                       volatile=True)
                        polls += 1
                    if polls >= SPIN:
                        gl.atomic_max(err_ptr, o)
                act = gl.xor_sum((prev & 0xFFFFFFFF).to(gl.int32), 0)
            else:
                if wait != 0:
                    polls = 0
                    while (gl.load(cnt_ptr + o - 1, volatile=True) < P) & (polls < SPIN):
                        polls += 1
                    if polls >= SPIN:
                        gl.atomic_max(err_ptr, o)
                prev = gl.load(out_ptr + (o - 1) * P + lanes, mask=lanes < P, other=0, volatile=True)
                act = gl.xor_sum(prev, 0)
        if STAMPS:
            gl.store(stamp_ptr + (o * P + pid) * 3 + 1, _now(act))
        if GATES[o] >= 0:  # this op's wait means the router chose: the next layer's expert chunks are the limit
            limit = gl.where(gated != 0, GATES[o], limit)
            issued = _top_up(w_desc, ring, bars, base, issued, gl.minimum(released + STAGES, limit), STAGES, BOX_R)
        acc = gl.zeros([BOX_R, 256], gl.int32, tile_l)
        for c in range(A[o] // BOX_R, (B[o] + BOX_R - 1) // BOX_R):
            s = c % STAGES
            mbarrier.wait(bars.index(s), (c // STAGES) & 1)
            tile = ring.index(s).load(tile_l)
            r = c * BOX_R + row_i
            acc = acc ^ gl.where((r >= A[o]) & (r < B[o]), tile, 0)
            released = gl.minimum(c + 1, B[o] // BOX_R)  # the op's last chunk may hold the next op's first rows
            gl.thread_barrier()  # every thread has read the stage before its next copy is asked for
            fence_async_shared()
            issued = _top_up(w_desc, ring, bars, base, issued, gl.minimum(released + STAGES, limit), STAGES, BOX_R)
        res = gl.xor_sum(gl.xor_sum(acc, 1), 0) ^ (act * 3 + o)
        if STAMPS:
            gl.store(stamp_ptr + (o * P + pid) * 3 + 2, _now(res))
        if POLL:
            gl.store(out_ptr + o * P + pid, (epoch << 32) | (res.to(gl.int64) & 0xFFFFFFFF))
        else:
            gl.store(out_ptr + o * P + pid, res)
            gl.thread_barrier()  # the result is written before the program counts itself in
            gl.atomic_add(cnt_ptr + o, 1, sem="release")
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def _xor_fold(t: torch.Tensor) -> torch.Tensor:
    """xor over the last dimension (int32)."""
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = torch.cat([t, torch.zeros_like(t[..., :1])], -1)
        half = t.shape[-1] // 2
        t = t[..., :half] ^ t[..., half:]
    return t[..., 0]


class Ring:
    """The ring forms' buffers and launches (each call one decode of the chain)."""

    def __init__(self, streams: dict[str, int], programs: int, layers: int, device: torch.device, stages: int,
                 box_r: int, calls: int = 2, warps: int = 4):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        self.layout = ring_layout(streams, programs, layers, box_r)
        self.programs, self.stages, self.warps, self.device = programs, stages, warps, device
        gen = torch.Generator(device=device).manual_seed(1)
        total = programs * self.layout.rows
        self.weights = [torch.randint(-2**31, 2**31 - 1, (total, ROW), dtype=torch.int32, device=device,
                                      generator=gen) for _ in range(calls)]
        self.bytes = total * ROW * 4
        smem = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        self.descs = [TensorDescriptor.from_tensor(w, [box_r, ROW], smem) for w in self.weights]
        n = len(self.layout.names)
        self.out = torch.zeros(n * programs, dtype=torch.int32, device=device)
        self.out64 = torch.zeros(n * programs, dtype=torch.int64, device=device)
        self.cnt = torch.zeros(n, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.stamps = torch.zeros(n, programs, 3, dtype=torch.int64, device=device)

    def run(self, form: str, call: int = 0, stamps: bool = False) -> None:
        """`form`: ring[-poll][-oracle|-nowait]."""
        lay, poll = self.layout, "-poll" in form
        if poll:
            self.epoch.add_(1)  # a graph node, as the counters' reset is in the other forms
        else:
            self.cnt.zero_()
        _ring_kernel[(self.programs,)](
            self.descs[call % len(self.descs)], self.out64 if poll else self.out, self.cnt, self.err, self.epoch,
            self.stamps, lay.rows, lay.limit0, int(not form.endswith(("-oracle", "-nowait"))), int(not form.endswith("-nowait")),
            A=lay.a, B=lay.b, GATES=lay.gates, N_OPS=len(lay.names), CHUNKS=lay.chunks, STAGES=self.stages,
            BOX_R=lay.box_r, P2=triton.next_power_of_2(self.programs), SPIN=SPIN_LIMIT, WARPS=self.warps, POLL=poll,
            STAMPS=stamps, num_warps=self.warps)

    def expected(self, call: int = 0) -> torch.Tensor:
        """The chain's results computed by torch from the same weights."""
        lay, w = self.layout, self.weights[call % len(self.weights)].view(self.programs, self.layout.rows, ROW)
        out, act = [], torch.zeros((), dtype=torch.int32, device=self.device)
        for o, (a, b) in enumerate(zip(lay.a, lay.b)):
            part = (_xor_fold(_xor_fold(w[:, a:b, :])) if b > a
                    else torch.zeros(self.programs, dtype=torch.int32, device=self.device))
            res = part ^ (act * 3 + o).to(torch.int32)
            out.append(res)
            act = _xor_fold(res)
        return torch.cat(out)

    def breakdown(self, form: str, calls: int = 5) -> dict:
        """Where the chain's time goes, from the timer stamps of `calls` calls (the median call per op): each op's
        increment of the chain's critical path (the last program's result minus the op before's), split into the
        notification (the last result of the op before -> the median program past its wait and activation load)
        and the op's own work after that (-> the last program's result)."""
        per = []
        for i in range(calls):
            self.run(form, i, stamps=True)
            torch.cuda.synchronize(self.device)
            t = self.stamps.double() / 1e3  # us
            last = t[:, :, 2].max(1).values
            ready = t[:, :, 1].median(1).values
            per.append(torch.stack([last - torch.cat([last[:1] * 0 + t[0, :, 0].min(), last[:-1]]),
                                    ready - torch.cat([t[:1, :, 0].min(1).values, last[:-1]]),
                                    last - ready], 1))
        med = torch.stack(per).median(0).values.cpu()  # [op, (increment, notification, work)]
        names = self.layout.names
        groups: dict[str, list] = {}
        for o in range(len(names)):  # each op by its name and the name of the streaming op it follows
            prev = next(n for n in reversed(names[:o + 1]) if n != "bare")
            key = names[o] if names[o] != "bare" else f"bare after {prev}"
            groups.setdefault(key, []).append(med[o])
        return {k: {"ops": len(v), "increment_us": float(torch.stack(v)[:, 0].sum()),
                    "notification_us": float(torch.stack(v)[:, 1].sum()), "work_us": float(torch.stack(v)[:, 2].sum())}
                for k, v in groups.items()} | {"total_us": float(med[:, 0].sum())}

    def result(self, form: str) -> torch.Tensor:
        self.out.zero_()
        self.out64.zero_()  # (else a form that skips its waits reads the last call's words: the same values)
        self.err.zero_()
        self.run(form)
        torch.cuda.synchronize(self.device)
        if int(self.err.item()):
            raise RuntimeError(f"{form}: a program stopped polling at op {int(self.err.item())} (not all resident?)")
        if "-poll" not in form:
            return self.out.clone()
        if not bool(((self.out64 >> 32) == self.epoch).all()):
            raise RuntimeError(f"{form}: a result word without this call's epoch")
        return (self.out64 & 0xFFFFFFFF).to(torch.int32)


RING_FORMS = ("ring", "ring-oracle", "ring-poll", "ring-poll-oracle")
CHAIN_FORMS = ((2, 4096, 4096, "chain-pdl-preload"), (1, 8192, 4096, "persistent-prefetch"))
# (streams, ring stages, chunk KB): the round's streams; then 1 KB an op a program, where the chain's dependencies
# are all that is left of each form's time
RUNS = (("round", 13, 16), ("round", 26, 8), ("1 KB", 8, 1))


def _chain_rows(label: str, streams: dict[str, int], sms: int, dev: torch.device) -> list[dict]:
    rows = []
    for per_sm, pref, block, form in CHAIN_FORMS:
        chain = Chain(streams, per_sm * sms, LAYERS, dev, pref=pref, block=block)
        want = chain.result("chain")
        if not torch.equal(chain.result(form), want):
            raise RuntimeError(f"{form}: results differ from the chain's")
        floor = flat_floor(chain.weights, chain.bytes, sms, dev)
        times = graph_times([lambda i=i: chain.run(form, i) for i in range(len(chain.weights))], 15)[0]
        med = statistics.median(times)
        rows.append({"streams": label, "form": form, "programs_per_sm": per_sm, "bytes": chain.bytes,
                     "ops": len(chain.ops), "floor_us": floor, "median_us": med, "x_floor": med / floor,
                     "us_per_op": med / len(chain.ops), "times_us": times})
        print(f"[{label}] {form} ({per_sm} a SM, {chain.bytes / 1e6:.1f} MB, {len(chain.ops)} ops): {med:.1f} us "
              f"({med / len(chain.ops):.2f} an op), floor {floor:.1f} us ({med / floor:.2f}x)", flush=True)
        del chain
        torch.cuda.empty_cache()
    return rows


def _ring_row(label: str, streams: dict[str, int], stages: int, box_r: int, sms: int, dev: torch.device) -> dict:
    ring = Ring(streams, sms, LAYERS, dev, stages, box_r)
    for gated in (True, False):
        schedule_check(ring.layout, stages, gated)
    want = ring.expected()
    checks = {f: bool(torch.equal(ring.result(f), want)) for f in RING_FORMS}
    controls = {f: not torch.equal(ring.result(f), want) for f in ("ring-nowait", "ring-poll-nowait")}
    if not all(checks.values()):
        raise RuntimeError(f"ring {stages} x {box_r} KB: results differ from torch's: {checks}")
    floor = flat_floor(ring.weights, ring.bytes, sms, dev)
    n = len(ring.layout.names)
    row = {"streams": label, "stages": stages, "chunk_kb": box_r, "in_flight_kb": stages * box_r,
           "bytes": ring.bytes, "ops": n, "floor_us": floor, "same_result": checks, "nowait_controls_differ": controls}
    for form in RING_FORMS:
        times = graph_times([lambda i=i, f=form: ring.run(f, i) for i in range(len(ring.weights))], 15)[0]
        med = statistics.median(times)
        row[form] = {"median_us": med, "x_floor": med / floor, "us_per_op": med / n, "times_us": times}
    row["breakdown"] = {f: ring.breakdown(f) for f in ("ring", "ring-oracle")}
    for f, b in row["breakdown"].items():
        print(f"[{label}] {f}, timer stamps: one call {b['total_us']:.1f} us; " + "; ".join(
            f"{k} x{v['ops']}: {v['increment_us']:.1f} (notified {v['notification_us']:.1f}, work {v['work_us']:.1f})"
            for k, v in b.items() if k != "total_us"), flush=True)
    print(f"[{label}] ring, {stages} stages x {box_r} KB ({ring.bytes / 1e6:.1f} MB, {n} ops): floor {floor:.1f} us; "
          + "; ".join(f"{f} {row[f]['median_us']:.1f} ({row[f]['x_floor']:.2f}x, {row[f]['us_per_op']:.2f} an op)"
                      for f in RING_FORMS)
          + "; no-wait controls " + ", ".join(f"{f} {'caught' if c else 'NOT caught'}" for f, c in controls.items()),
          flush=True)
    del ring
    torch.cuda.empty_cache()
    return row


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m iquest.lab.ring_probe", description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", help="write the raw JSON here")
    parser.add_argument("--distinct", type=int, default=tune.TuneShape.distinct,
                        help="distinct experts a layer's Gate/Up and Down stream (default %(default)s, the prefilled "
                             "benchmark's; 38: real-request routing)")
    parser.add_argument("--no-tiny", action="store_true",
                        help="leave out the 1 KB-an-op runs (they do not depend on --distinct)")
    args = parser.parse_args(argv)
    if not 1 <= args.distinct <= tune.TuneShape.experts:
        parser.error(f"--distinct must be in 1..{tune.TuneShape.experts}, got {args.distinct}")
    dev = torch.device("cuda")
    config = Config.from_file(FULL_CONFIG)
    streams = round_streams(config, replace(tune.tune_shape(config), distinct=args.distinct))
    streams = {k: v for k, v in streams.items() if k != "lm_head"}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tiny = {k: sms * ROW * 4 for k in streams}
    report = {"probe": "ring", "commit": commit(), "device": torch.cuda.get_device_name(dev), "layers": LAYERS,
              "distinct": args.distinct, "streams": streams, "rows": []}
    for label, s in (("round", streams),) + ((("1 KB", tiny),) if not args.no_tiny else ()):
        report["rows"] += _chain_rows(label, s, sms, dev)
        for run_label, stages, box_r in RUNS:
            if run_label == label:
                report["rows"].append(_ring_row(label, s, stages, box_r, sms, dev))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Does streaming an op's weights across the op boundary pay? One layer's chain of weight streams, by structure.

Issue 37's structural question, asked of the bytes alone before any persistent layer is built. A main layer of one
TP8 rank is a chain of dependent ops; five of them stream weights (q/k/v 6.3 MB, o_proj 4.7 MB, the router 3.1 MB,
Gate/Up 40.9 MB and Down 20.4 MB at 12.9 experts), the others move almost nothing. Each op here reads its bytes
(flat 16-byte loads, xor-folded) and a value made from every program's result of the op before it, so the chain's
dependencies are real, with no arithmetic beyond that. The same LAYERS layers (distinct weights, beyond L2) run as:

  * `chain`: one kernel per op in stream order (each op's programs start once the previous kernel has ended);
  * `chain-pdl`: the same under PDL, the weights loaded after the wait;
  * `chain-pdl-preload`: under PDL, each program's first PREF words of an activation-independent op's share (q/k/v,
    o_proj, the router: their addresses do not depend on the activation) loaded before the wait, as the product's
    linears do;
  * `persistent`: one kernel for the whole chain, one program set resident throughout; an op waits on a readiness
    counter of the op before it (every program counts itself in after its store), no grid barrier;
  * `persistent-prefetch`: the same, each program loading its next op's first PREF words (where the addresses are
    known) as soon as it has finished its share of the current op, so the loads are in flight while it waits;
  * `persistent-prefetch-all`: also the expert ops' first words before the wait (an oracle: as if the experts were
    known one op earlier);
  * `floor`: the layers' bytes as one flat read (the best form of `bench stream-probe`).

Every form must produce the same result words (checked; a run fails otherwise), and a persistent form that skips
its wait is run once as a negative control of that check. Timed as `bench stream-probe` times a stream: CUDA graphs
of calls back to back, CUDA events, medians. GPU only; a lab probe the product never imports.

    python3 -m iquest.lab.overlap_probe OUT.json   (on the device with PYTHONPATH as ci/gpu.sh sets it)
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..bench.kernels_micro import FULL_CONFIG, graph_times
from ..bench.stream_probe import flat_read, round_streams
from ..bench import tune
from ..kernels.launch import launch_options, wait_for_inputs
from ..provenance import commit
from ..reference.config import Config

LAYERS = 4  # 4 x ~75 MB of distinct weights: each call's reads come from HBM
SMALL_OPS = {"qkv": 2, "o_proj": 3, "router": 1, "gate_up": 1, "down": 1}  # bare ops after each stream (norms,
# rotary and KV write, attention and its combine, the residual norm, the select, the finalize, the combine): 9,
# with the 5 streams 14 a layer, as the round's ~1,200 kernels over 93 layer calls
KNOWN = {"qkv", "o_proj", "router"}  # streams whose addresses do not depend on the activation
SPIN_LIMIT = 1 << 22  # polls before a waiting program gives up (sets the error word): a broken run ends, never hangs


@dataclass(frozen=True)
class Op:
    name: str
    words: int  # int32 words a program reads
    offset: int  # first word of this op's region in the weight buffer
    known: bool


def layer_ops(streams: dict[str, int], programs: int, layers: int) -> list[Op]:
    """The chain: per layer q/k/v, o_proj, the router, Gate/Up and Down, each followed by its bare ops; each stream's
    bytes split evenly over `programs` (rounded up to 16 bytes a program)."""
    ops, offset = [], 0
    for _ in range(layers):
        for name in ("qkv", "o_proj", "router", "gate_up", "down"):
            words = -(-streams[name] // (4 * programs * 4)) * 4
            ops.append(Op(name, words, offset, name in KNOWN))
            offset += words * programs
            ops += [Op("bare", 0, offset, True)] * SMALL_OPS[name]
    return ops


@triton.jit
def _chain_kernel(w_ptr, out_ptr, cnt_ptr, err_ptr, off_ptr, words_ptr, known_ptr, first_op, n_ops,
                  PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, WAIT: tl.constexpr, P2: tl.constexpr,
                  BLOCK: tl.constexpr, PREF: tl.constexpr, SPIN: tl.constexpr, PDL: tl.constexpr = False):
    """Ops first_op .. first_op + n_ops - 1 of the chain, program p reading words [p * n, (p + 1) * n) of each op's
    region. PREFETCH 1: the first PREF words of a known op loaded before the wait; 2: of every op. PERSISTENT: an
    op's wait is the previous op's counter reaching the program count (WAIT 0: no wait, the control); else the
    wait is PDL's (or stream order)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    lanes = tl.arange(0, P2)
    pre_i = tl.arange(0, PREF)
    blk_i = tl.arange(0, BLOCK)
    op = first_op
    while op < first_op + n_ops:  # (a while loop: the interpreter cannot take range() over a runtime bound)
        n = tl.load(words_ptr + op)
        start = tl.load(off_ptr + op) + pid.to(tl.int64) * n
        known = tl.load(known_ptr + op)
        if PREFETCH > 1:
            take = n >= 0
        elif PREFETCH > 0:
            take = known != 0
        else:
            take = n < 0
        early = tl.load(w_ptr + start + pre_i, mask=(pre_i < n) & take, other=0)
        done = tl.where(take, tl.minimum(n, PREF), 0)
        if PERSISTENT:
            if WAIT:
                if op > 0:
                    polls = 0
                    while (tl.load(cnt_ptr + op - 1, volatile=True) < P) & (polls < SPIN):
                        polls += 1
                    if polls >= SPIN:
                        tl.atomic_max(err_ptr, op)
        else:
            wait_for_inputs(PDL)
        act = 0
        if op > 0:
            prev = tl.load(out_ptr + (op - 1) * P + lanes, mask=lanes < P, other=0, volatile=True)
            act = tl.xor_sum(prev, 0)
        acc = tl.zeros([BLOCK], tl.int32)
        k = done
        while k < n:
            acc = acc ^ tl.load(w_ptr + start + k + blk_i, mask=k + blk_i < n, other=0)
            k += BLOCK
        tl.store(out_ptr + op * P + pid, tl.xor_sum(acc, 0) ^ tl.xor_sum(early, 0) ^ (act * 3 + op))
        if PERSISTENT:
            tl.debug_barrier()  # every thread's part of this program's result is written before it counts itself in
            tl.atomic_add(cnt_ptr + op, 1, sem="release")
        op += 1


class Chain:
    """The probe's buffers and its forms as callables (each one decode of the LAYERS layers' chain)."""

    def __init__(self, streams: dict[str, int], programs: int, layers: int, device: torch.device, pref: int = 2048,
                 calls: int = 2, block: int = 1024):
        self.ops = layer_ops(streams, programs, layers)
        self.programs, self.pref, self.block, self.device = programs, pref, block, device
        total = self.ops[-1].offset + self.ops[-1].words * programs
        gen = torch.Generator(device=device).manual_seed(0)
        # `calls` disjoint copies so that back-to-back calls in a graph never find the last call's weights in L2
        self.weights = [torch.randint(-2**31, 2**31 - 1, (total,), dtype=torch.int32, device=device, generator=gen)
                        for _ in range(calls)]
        self.bytes = total * 4
        n = len(self.ops)
        self.off = torch.tensor([o.offset for o in self.ops], dtype=torch.int64, device=device)
        self.words = torch.tensor([o.words for o in self.ops], dtype=torch.int32, device=device)
        self.known = torch.tensor([int(o.known) for o in self.ops], dtype=torch.int32, device=device)
        self.out = torch.zeros(n * programs, dtype=torch.int32, device=device)
        self.cnt = torch.zeros(n, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.p2 = triton.next_power_of_2(programs)

    def run(self, form: str, call: int = 0) -> None:
        w = self.weights[call % len(self.weights)]
        common = dict(P2=self.p2, BLOCK=self.block, PREF=self.pref, SPIN=SPIN_LIMIT, num_warps=4)
        args = (w, self.out, self.cnt, self.err, self.off, self.words, self.known)
        if form.startswith("persistent"):
            self.cnt.zero_()
            prefetch = 2 if form.endswith("-all") else int("prefetch" in form)
            _chain_kernel[(self.programs,)](*args, 0, len(self.ops), PERSISTENT=True, PREFETCH=prefetch,
                                            WAIT=form != "persistent-nowait", **common)
            return
        pdl = form != "chain"
        launch = launch_options(pdl, self.device)
        for i in range(len(self.ops)):
            _chain_kernel[(self.programs,)](*args, i, 1, PERSISTENT=False, PREFETCH=int(form.endswith("preload")),
                                            WAIT=True, **common, **launch)

    def result(self, form: str) -> torch.Tensor:
        self.out.zero_()
        self.err.zero_()
        self.run(form)
        torch.cuda.synchronize(self.device)
        if int(self.err.item()):
            raise RuntimeError(f"{form}: a program stopped polling at op {int(self.err.item())} (not all resident?)")
        return self.out.clone()


def flat_floor(weights: list[torch.Tensor], per_call: int, sms: int, device: torch.device) -> float:
    """Median us of one flat read of a call's `per_call` bytes (each copy of `weights` in turn), as `bench
    stream-probe` reads at its best: 8 programs a SM, 16-byte loads."""
    src = torch.cat([w.reshape(-1).view(torch.uint8) for w in weights])
    out = torch.empty(1 << 16, device=device)
    return statistics.median(graph_times(
        [lambda i=i: flat_read(src[i * per_call:(i + 1) * per_call], out, 8 * sms) for i in range(len(weights))],
        15)[0])


FORMS = ("chain", "chain-pdl", "chain-pdl-preload", "persistent", "persistent-prefetch", "persistent-prefetch-all")


def main(argv: list[str]) -> None:
    out_path = argv[0] if argv else None
    dev = torch.device("cuda")
    config = Config.from_file(FULL_CONFIG)
    streams = round_streams(config, tune.tune_shape(config))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    report = {"probe": "overlap", "commit": commit(), "device": torch.cuda.get_device_name(dev), "layers": LAYERS,
              "streams": {k: v for k, v in streams.items() if k != "lm_head"}, "rows": []}
    # (programs a SM, words preloaded, words a program has in flight after its wait): the reader's loop is not
    # software-pipelined, so its bytes in flight are BLOCK words a program; 1024 (4 KB) was the first run's
    for per_sm, pref, block in ((1, 8192, 4096), (2, 4096, 4096), (4, 2048, 4096), (4, 2048, 1024)):
        chain = Chain(streams, per_sm * sms, LAYERS, dev, pref=pref, block=block)
        want = chain.result("chain")
        checks = {form: bool(torch.equal(chain.result(form), want)) for form in FORMS}
        control = not torch.equal(chain.result("persistent-nowait"), want)
        if not all(checks.values()):
            raise RuntimeError(f"{per_sm} programs a SM: forms disagree with the chain: {checks}")
        per_call = chain.bytes
        floor = flat_floor(chain.weights, per_call, sms, dev)
        row = {"programs_per_sm": per_sm, "prefetch_words": pref, "block_words": block, "ops": len(chain.ops),
               "bytes": per_call,
               "same_result": checks, "nowait_control_differs": control, "floor_us": floor}
        for form in FORMS:
            times = graph_times([lambda i=i, f=form: chain.run(f, i) for i in range(len(chain.weights))], 15)[0]
            row[form] = {"median_us": statistics.median(times), "times_us": times,
                         "x_floor": statistics.median(times) / floor}
        report["rows"].append(row)
        print(f"{per_sm} programs a SM, {block} words a step ({len(chain.ops)} ops, {per_call / 1e6:.1f} MB): "
              f"floor {floor:.1f} us; "
              + "; ".join(f"{f} {row[f]['median_us']:.1f} ({row[f]['x_floor']:.2f}x)" for f in FORMS)
              + f"; no-wait control {'caught' if control else 'NOT caught'}", flush=True)
        del chain
        torch.cuda.empty_cache()
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

"""CPU, Triton interpreter (TRITON_INTERPRET=1), the GPU's kernel plan: device launches a decode round makes in each
variant, as the captured graph would hold them: Triton kernels + torch ops that launch a kernel, + for each Flow.when a
set_cond kernel and an IF node (+ the WHILE's own set_cond, both modes). Split by where they come from."""
import collections
import sys
from pathlib import Path

import triton
from torch.utils._python_dispatch import TorchDispatchMode

from iquest.fast.engine import EngineOptions, FastEngine
from iquest.fast.flow import EagerFlow
from iquest.reference.depth import FixedDepth, load_controller
from iquest.reference.sampling import SamplingParams
from iquest.lab.depth_probe.mend import ProbeRunner
from iquest.lab.depth_probe.count_ops import NO_KERNEL

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "iquest-q1-mini"
assert triton.knobs.runtime.interpret, "run with TRITON_INTERPRET=1"


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where, self.n, self.paused = ["other"], collections.Counter(), 0
        self.ops = collections.Counter()  # (where, aten op) -> launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_KERNEL:
            self.n[(self.where[-1], "torch")] += 1
            self.ops[(self.where[-1], name)] += 1
        return func(*args, **(kwargs or {}))


MODE = Count()
from triton.runtime import interpreter  # noqa: E402
_orig = interpreter.GridExecutor.__call__


def counted(self, *a, **k):
    MODE.n[(MODE.where[-1], "triton")] += 1
    MODE.paused += 1
    try:
        return _orig(self, *a, **k)
    finally:
        MODE.paused -= 1


interpreter.GridExecutor.__call__ = counted


def tag(label, fn):
    def inner(*a, **k):
        MODE.where.append(label)
        try:
            return fn(*a, **k)
        finally:
            MODE.where.pop()
    return inner


def main(tokens=24):
    eng = FastEngine.load(MODEL, device="cpu", options=EngineOptions(kernels="triton"))
    rank, gen = eng.rank0, eng.generation
    params, stop = SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id)
    from iquest.bench.depth import held_out
    from tokenizers import Tokenizer
    chosen, _ = held_out(MODEL, Tokenizer.from_file(str(MODEL / "tokenizer.json")), 1)
    key = ("auto", gen.top_k, 0)
    for v in sys.argv[2:] or ["fixed3", "auto", "torch_rule"]:
        ctl = FixedDepth(3) if v in ("fixed3", "nodes3", "ops3") else load_controller(MODEL)
        r = ProbeRunner(rank.model, rank.state, gen.top_k, ctl, EagerFlow(),
                        variant="product" if v in ("fixed3", "auto") else v)
        MODE.n.clear()
        MODE.ops.clear()
        whens = [0, 0]
        rounds = [0]
        w = r.flow.when

        def when(flag, body, w=w):
            if MODE.where[-1] == "round" or MODE.where[-1] == "controller":
                pass
            whens[0] += 1
            MODE.n[("flow", "set_cond")] += 1
            MODE.n[("flow", "IF node")] += 1
            MODE.paused += 1  # the eager flag read is the graph's set_cond
            try:
                taken = bool(flag)
            finally:
                MODE.paused -= 1
            if taken:
                whens[1] += 1
                MODE.where.append("taken IF body")
                try:
                    body()
                finally:
                    MODE.where.pop()
        r.flow.when = when
        r.more = tag("controller", r.more)
        base_round = r.round

        def rnd():
            rounds[0] += 1
            MODE.n[("flow", "WHILE set_cond")] += 1
            base_round()
        r.round = tag("round", rnd)
        rank._runners[key] = (r, None)
        drafts = 0
        with MODE:
            MODE.where = ["prefill"]
            steps = list(eng.generate(chosen[0][2], seed=5, params=params, max_new_tokens=tokens, drafts="auto",
                                      stop_ids=stop))
        drafts = sum(s.drafts for s in steps[1:])
        R = rounds[0]
        per = collections.Counter()
        for (wh, kind), c in MODE.n.items():
            if wh != "prefill":
                per[f"{wh}:{kind}"] += c / R
        launches = sum(c for k, c in per.items() if not k.endswith("IF node"))
        print(f"== {v}: {R} rounds, {drafts / R:.2f} drafts/round; device launches/round {launches:.1f} + IF nodes "
              f"{per.get('flow:IF node', 0):.1f}  | " + ", ".join(f"{k} {c:.1f}" for k, c in sorted(per.items())),
              flush=True)
        ops = sorted(((c / R, w, op) for (w, op), c in MODE.ops.items() if w != "prefill"), reverse=True)
        print("   torch launches/round by op: " + ", ".join(f"{w}:{op} {c:.1f}" for c, w, op in ops), flush=True)
    eng.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 24)

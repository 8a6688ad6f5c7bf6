"""Probe (CPU): per-round aten ops that would launch a device kernel, split by where they come from, for a fixed depth
and for the depth controller; flow.when calls (= IF nodes + set_cond launches in the graph); verify/draft widths."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from iquest.fast.engine import FastEngine
from iquest.reference.sampling import SamplingParams

NO_KERNEL = {"view", "_unsafe_view", "select", "slice", "alias", "as_strided", "expand", "unsqueeze", "squeeze",
             "t", "detach", "empty", "empty_like", "empty_strided", "lift_fresh", "_reshape_alias", "reshape",
             "permute", "transpose", "split", "unbind", "_local_scalar_dense", "is_nonzero", "new_empty",
             "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "result_type"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = ["round"]
        self.ops = collections.Counter()       # (where, op) -> count
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "is_nonzero"):
            self.syncs[self.where[-1]] += 1
        elif name not in NO_KERNEL:
            self.ops[(self.where[-1], name)] += 1
        return func(*args, **(kwargs or {}))


def wrap(runner, mode, stats):
    def tag(label, fn):
        def inner(*a, **k):
            mode.where.append(label)
            try:
                return fn(*a, **k)
            finally:
                mode.where.pop()
        return inner

    runner.more = tag("controller:more()", runner.more)
    fwd, drf = runner.m.forward, runner.m.draft

    def forward(rows, pos, live):
        stats["verify_rows"][rows.shape[0]] += 1
        stats["verify_live"][int(live.sum())] += 1
        return tag("verify forward", fwd)(rows, pos, live)

    def draft(tokens, h, pos, live):
        stats["draft_rows"][tokens.shape[0]] += 1
        return tag("draft forward", drf)(tokens, h, pos, live)
    runner.m.forward, runner.m.draft = forward, draft
    flow = runner.flow
    when = flow.when

    def counted_when(flag, body):
        stats["when_calls"] += 1
        stats["when_taken"] += int(flag)
        mode.where.append("flow.when (set_cond + IF node)")
        try:
            when(flag, body)   # EagerFlow reads the flag: that read is the graph's set_cond kernel
        finally:
            mode.where.pop()
    flow.when = counted_when
    # sample_draft's ops outside more(), accept/settle/dist etc. stay under "round"


def main(prompts=4, tokens=48):
    model_dir = Path(__file__).resolve().parents[2] / "fixtures" / "iquest-q1-mini"
    torch.set_num_threads(2)
    eng = FastEngine.load(model_dir, device="cpu")
    rank = eng.rank0
    from iquest.bench.depth import held_out
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chosen, _ = held_out(model_dir, tok, prompts)
    gen = eng.generation
    params, stop = SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id)
    for drafts in (3, "auto"):
        runner, _ = rank.runner(drafts, gen.top_k)
        mode = Count()
        stats = {"verify_rows": collections.Counter(), "verify_live": collections.Counter(),
                 "draft_rows": collections.Counter(), "when_calls": 0, "when_taken": 0}
        orig_round = runner.round
        n_rounds = [0]

        def rnd():
            n_rounds[0] += 1
            with mode:
                orig_round()
        runner.round = rnd
        wrap(runner, mode, stats)
        toks = drafted = 0
        for i, (_, _, ids) in enumerate(chosen):
            steps = list(eng.generate(ids, seed=100 + i, params=params, max_new_tokens=tokens, drafts=drafts,
                                      stop_ids=stop))
            toks += sum(len(s.tokens) for s in steps[1:])
            drafted += sum(s.drafts for s in steps[1:])
        R = n_rounds[0]
        by_where = collections.Counter()
        for (w, op), c in mode.ops.items():
            by_where[w] += c
        print(f"=== drafts={drafts}: rounds {R}, tokens/round {toks / R:.3f}, drafts/round {drafted / R:.2f}")
        print(f"  verify rows/forward {dict(stats['verify_rows'])}  "
              f"live rows {dict(sorted(stats['verify_live'].items()))}")
        widths = stats['draft_rows']
        print(f"  draft forward widths {dict(widths)} (per round: {sum(widths.values()) / R:.2f})")
        print(f"  flow.when per round {stats['when_calls'] / R:.2f} (taken {stats['when_taken'] / R:.2f})")
        print(f"  host reads per round (eager flags) {dict((k, round(v / R, 2)) for k, v in mode.syncs.items())}")
        for w, c in sorted(by_where.items()):
            print(f"  kernel-launching aten ops/round  {w:34s} {c / R:7.2f}")
        ctl = {op: c / R for (w, op), c in mode.ops.items() if w == "controller:more()"}
        if ctl:
            ops = sorted(ctl.items(), key=lambda x: -x[1])
            print("  more() ops per round: " + ", ".join(f"{k} {v:.2f}" for k, v in ops))
    eng.close()


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:]))

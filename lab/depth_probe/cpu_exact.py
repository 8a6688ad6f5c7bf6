"""CPU check: the lean and nested variants emit the base controller's tokens, logprobs and round records bit for bit
(eager flow, torch forms), and how many controller launches / flow.when calls a round makes in each."""
import collections
from pathlib import Path

import torch

from iquest.fast.engine import FastEngine
from iquest.fast.flow import EagerFlow
from iquest.reference.depth import load_controller
from iquest.reference.sampling import SamplingParams
from iquest.lab.depth_probe.mend import ProbeRunner  # noqa

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "iquest-q1-mini"


def main():
    torch.set_num_threads(2)
    eng = FastEngine.load(MODEL, device="cpu")
    rank, gen = eng.rank0, eng.generation
    params, stop = SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id)
    from iquest.bench.depth import held_out
    from tokenizers import Tokenizer
    chosen, _ = held_out(MODEL, Tokenizer.from_file(str(MODEL / "tokenizer.json")), 4)
    key = ("auto", gen.top_k, 0)
    results = {}
    for v in ("base", "lean", "nested", "fused"):
        r = ProbeRunner(rank.model, rank.state, gen.top_k, load_controller(MODEL), EagerFlow(), variant=v)
        calls = collections.Counter()
        w = r.flow.when
        r.flow.when = lambda f, b, w=w: (calls.__setitem__("when", calls["when"] + 1), w(f, b))[1]
        m = r.more
        r.more = lambda *a, m=m: (calls.__setitem__("more", calls["more"] + 1), m(*a))[1]
        rank._runners[key] = (r, None)
        outs = []
        rounds = 0
        for i, (_, _, ids) in enumerate(chosen):
            steps = list(eng.generate(ids, seed=7 + i, params=params, max_new_tokens=48, drafts="auto", stop_ids=stop))
            outs.append([(s.tokens, s.logprobs, s.drafts, s.accepted, s.bonus) for s in steps])
            rounds += len(steps) - 1
        results[v] = outs
        print(f"{v:7s}: rounds {rounds}, more() calls/round {calls['more'] / rounds:.2f}, "
              f"flow.when/round {calls['when'] / rounds:.2f}, identical to base: {outs == results['base']}")
    eng.close()


if __name__ == "__main__":
    main()

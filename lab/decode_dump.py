"""Decode fixed prompts and seeds with the fast engine and write every token, logprob (as float bits) and round
record to JSON: run before and after a refactor on the same GPU and compare with `--compare A B`."""

from __future__ import annotations

import json
import struct
import sys
import time

CASES = [  # (prompt text, seed, drafts, tokens)
    ("def fibonacci(n):\n", 0, "auto", 96),
    ("import os\nimport sys\n\n\ndef main(argv):\n", 1, "auto", 96),
    ("class Stack:\n    def __init__(self):\n", 2, 5, 96),
    ("def parse_args(argv):\n    parser = ", 3, 7, 96),
    ("for i in range(10):\n", 4, 3, 96),
    ("def quicksort(xs):\n", 5, 0, 64),
]


def bits(x: float) -> str:
    return struct.pack(">f", x).hex()


def dump(out: str, device: str = "cuda", kernels: str = "auto") -> None:
    from tokenizers import Tokenizer

    from iquest.cli.engines import default_model_dir
    from iquest.fast.engine import FastEngine
    from iquest.reference.sampling import SamplingParams

    model = default_model_dir()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    kw = {}
    try:
        from iquest.fast.rank import EngineOptions
        kw["options"] = EngineOptions(kernels=kernels)
    except ImportError:
        pass
    t0 = time.time()
    engine = FastEngine.load(model, device=device, **kw)
    gen = engine.generation
    params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)
    results = []
    for text, seed, drafts, n in CASES:
        steps = list(engine.generate(tok.encode(text).ids, seed=seed, params=params, max_new_tokens=n, drafts=drafts,
                                     stop_ids=tuple(gen.eos_token_id)))
        results.append({"prompt": text, "seed": seed, "drafts": drafts,
                        "tokens": [t for s in steps for t in s.tokens],
                        "logprob_bits": [bits(lp) for s in steps for lp in s.logprobs],
                        "rounds": [[s.drafts, s.accepted, len(s.tokens), int(s.bonus)] for s in steps]})
    engine.close()
    json.dump({"device": device, "kernels": kernels, "seconds": time.time() - t0, "cases": results},
              open(out, "w"), indent=1)
    print(f"{out}: {len(results)} cases, {sum(len(r['tokens']) for r in results)} tokens")


def compare(a: str, b: str) -> int:
    A, B = json.load(open(a)), json.load(open(b))
    bad = 0
    for x, y in zip(A["cases"], B["cases"]):
        same = all(x[k] == y[k] for k in ("tokens", "logprob_bits", "rounds"))
        bad += not same
        print(f"{'same' if same else 'DIFFERENT'}: seed {x['seed']} drafts {x['drafts']}, {len(x['tokens'])} tokens")
    print(f"{len(A['cases']) - bad}/{len(A['cases'])} cases identical (tokens, logprob bits, round records)")
    return int(bad > 0 or len(A["cases"]) != len(B["cases"]))


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    dump(sys.argv[1], *sys.argv[2:])

"""`iquest bench step`: median latency of one speculative round, CUDA graphs against an eager loop.

Both variants run in one process, alternating, on the same request: prefill (untimed), then one
timed decode chunk; per-round time = chunk time / rounds in it. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from ..fast.parallel import Parallel
from ..fast.rank import EngineOptions, RankEngine, Request


def _prompt(engine: RankEngine, context: int, seed: int) -> list[int]:
    """`context` tokens of real text where the model has a tokenizer (routing on real text differs
    from synthetic input), else random ids."""
    tok_file = engine.model_dir / "tokenizer.json"
    if tok_file.exists():
        import sysconfig

        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        text = "".join(p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40])
        ids = tok.encode(text).ids
        if len(ids) >= context:
            return ids[:context]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, engine.config.vocab_size, (context,), generator=g).tolist()


def _commit() -> str:
    """The source revision: $IQUEST_COMMIT where the tree travels without .git (the lent GPU machines)."""
    import os

    if os.environ.get("IQUEST_COMMIT"):
        return os.environ["IQUEST_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run(model_dir: str, context: int, drafts: int | str, repeats: int, chunk_tokens: int, seed: int,
        out: str | None) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("iquest bench step needs a CUDA device")
    engine = RankEngine(model_dir, Parallel.single("cuda"), EngineOptions(max_context=context + 2 * chunk_tokens + 64))
    prompt = _prompt(engine, context, seed)
    results: dict[str, list[dict]] = {"graph": [], "eager": []}
    runner, graph = engine.runner(drafts, engine.generation.top_k)
    for rep in range(repeats):
        req = Request(tuple(prompt), seed + rep, engine.generation.temperature, engine.generation.top_k,
                      engine.generation.top_p, chunk_tokens, drafts, ())
        for mode in ("graph", "eager"):
            engine.start(req, runner)
            st = engine.state
            rounds0, emitted0 = int(st.rounds), int(st.emitted)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.decode_chunk(runner, graph if mode == "graph" else None)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rounds, emitted = int(st.rounds) - rounds0, int(st.emitted) - emitted0
            results[mode].append({"seconds": dt, "rounds": rounds, "tokens": emitted,
                                  "round_us": dt / rounds * 1e6, "tokens_per_round": emitted / rounds})
    summary = {}
    for mode, rows in results.items():
        summary[mode] = {
            "median_round_us": statistics.median(r["round_us"] for r in rows),
            "tokens_per_round": sum(r["tokens"] for r in rows) / sum(r["rounds"] for r in rows),
            "median_tpot_us": statistics.median(r["seconds"] / r["tokens"] * 1e6 for r in rows),
        }
    summary["speedup"] = summary["eager"]["median_round_us"] / summary["graph"]["median_round_us"]
    report = {"bench": "step", "model": str(model_dir), "context": context, "drafts": drafts, "repeats": repeats,
              "chunk_tokens": chunk_tokens, "commit": _commit(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "host": platform.node(), "summary": summary, "runs": results}
    print(f"bench step  model={model_dir} context={context} drafts={drafts} repeats={repeats} "
          f"commit={report['commit']} device={report['device']}")
    print(f"{'variant':8} {'median round (us)':>18} {'tokens/round':>13} {'median TPOT (us)':>17}")
    for mode in ("graph", "eager"):
        s = summary[mode]
        print(f"{mode:8} {s['median_round_us']:18.1f} {s['tokens_per_round']:13.2f} {s['median_tpot_us']:17.1f}")
    print(f"graph speedup over eager: {summary['speedup']:.2f}x")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report

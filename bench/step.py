"""`iquest bench step`: median latency of one speculative round, CUDA graphs against an eager loop.

Both variants run in one process, alternating, on the same request: prefill (untimed), then one
timed decode chunk; per-round time = chunk time / rounds in it. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

from ..fast.parallel import Parallel
from ..provenance import commit
from ..fast.rank import EngineOptions, RankEngine, Request
from . import variants
from .timing import time_chunk


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


def _time_chunk(engine: RankEngine, runner, graph, req: Request) -> dict:
    engine.start(req, runner)  # prefill and first drafts: untimed
    row = time_chunk(engine, lambda: engine.decode_chunk(runner, graph), torch.device("cuda"))
    row["tokens_per_round"] = row["tokens"] / row["rounds"]
    return row


def run(model_dir: str, context: int, drafts: int | str, repeats: int, chunk_tokens: int, seed: int,
        out: str | None, kernels: tuple[str, ...] = ("torch",)) -> dict:
    """Each kernels variant gets its own engine; every repeat runs all variants (graph and eager) in turn."""
    if not torch.cuda.is_available():
        raise RuntimeError("iquest bench step needs a CUDA device")
    base = EngineOptions(max_context=context + 2 * chunk_tokens + 64)
    engines = {k: variants.prepare(RankEngine(model_dir, Parallel.single("cuda"), variants.options(k, base)), k)
               for k in kernels}
    first = next(iter(engines.values()))
    gen = first.generation
    prompt = _prompt(first, context, seed)
    runners = {k: e.runner(drafts, gen.top_k) for k, e in engines.items()}
    results: dict[str, list[dict]] = {f"{k}/{mode}": [] for k in kernels for mode in ("graph", "eager")}
    for rep in range(repeats):
        req = Request(tuple(prompt), seed + rep, gen.temperature, gen.top_k, gen.top_p, chunk_tokens, drafts, ())
        for k, engine in engines.items():
            runner, graph = runners[k]
            results[f"{k}/graph"].append(_time_chunk(engine, runner, graph, req))
            results[f"{k}/eager"].append(_time_chunk(engine, runner, None, req))
    for k, engine in engines.items():
        variants.check(engine, k)
    summary = {}
    for variant, rows in results.items():
        summary[variant] = {
            "median_round_us": statistics.median(r["round_us"] for r in rows),
            "tokens_per_round": sum(r["tokens"] for r in rows) / sum(r["rounds"] for r in rows),
            "median_tpot_us": statistics.median(r["seconds"] / r["tokens"] * 1e6 for r in rows),
        }
    base = summary[f"{kernels[0]}/graph"]["median_round_us"]
    for variant in summary:
        summary[variant]["ratio_to_first_graph"] = summary[variant]["median_round_us"] / base
    report = {"bench": "step", "model": str(model_dir), "context": context, "drafts": drafts, "repeats": repeats,
              "chunk_tokens": chunk_tokens, "kernels": list(kernels), "commit": commit(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
              "summary": summary, "runs": results}
    print(f"bench step  model={model_dir} context={context} drafts={drafts} repeats={repeats} "
          f"commit={report['commit']} device={report['device']}")
    print(f"{'variant':14} {'median round (us)':>18} {'tokens/round':>13} {'median TPOT (us)':>17} "
          f"{'vs ' + kernels[0] + '/graph':>16}")
    for variant, s in summary.items():
        print(f"{variant:14} {s['median_round_us']:18.1f} {s['tokens_per_round']:13.2f} {s['median_tpot_us']:17.1f} "
              f"{s['ratio_to_first_graph']:16.2f}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report

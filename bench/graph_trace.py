"""`iquest bench graph-trace`: where a captured verification forward's time goes, kernel by kernel (GPU).

Why: the step bench times the round as one graph, and its eager profile gives each kernel's duration; but under
programmatic dependent launch a kernel starts while its predecessor runs and parks at its wait, so its duration is
not what it adds to the chain. What a kernel adds is how much later it *ends* than the kernel before it: every
kernel waits for its predecessor's completion, so the ends are in launch order and their increments add up to the
forward's span.

The bench builds one TP8 rank's slice of the full-size model (random weights shaped as loaded, collectives as local no-ops,
as `iquest bench step` does), fills `context` positions of synthetic history, and captures one plain CUDA graph (no
conditional nodes) of the verification forward over `rows` rows (every layer, the final norm, the LM head) followed
by one draft-layer call on one row. Each replay is traced by torch.profiler (CUPTI records every kernel node of a
plain graph). Per replay, the kernels are ordered by their end; each kernel's increment is its end minus the
previous kernel's end. Increments are grouped by transition "previous kernel -> kernel" (so one kernel after two
different predecessors, e.g. the FP8 linear as q/k/v and as o_proj, is told apart), with medians over replays.
"""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from ..provenance import commit
from . import variants

SHORT = 48  # characters of a kernel's name kept in the report
TP = 8  # one rank of the TP8 layout


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list, cut to SHORT characters."""
    if name.startswith(("Memcpy", "Memset")):
        return name.split("(")[0].strip()[:SHORT]
    base = name.split("(")[0].split("<")[0].strip()
    return base.rsplit(" ", 1)[-1][:SHORT] if base else name[:SHORT]


def attribute(kernels: list[tuple[str, float, float]]) -> dict:
    """One traced replay: kernels (name, start, end) in any order (times in us) -> {"span_us", "kernels",
    "by_transition": {"prev -> name": {"count", "us", "own_us"}}, "by_kernel": {name: {"count", "us"}}}. The first
    kernel's increment is its own duration; each later one's is its end minus the previous end (ends sorted).
    "own_us" sums the kernels' own spans (start to end), which tells a kernel that starts late from one that runs
    long."""
    if not kernels:
        raise ValueError("no kernels traced in the replay")
    order = sorted(kernels, key=lambda k: (k[2], k[1]))
    by_transition: dict[str, dict] = {}
    by_kernel: dict[str, dict] = {}
    prev_name, prev_end = None, None
    for name, start, end in order:
        name = short_name(name)
        inc = end - (start if prev_end is None else prev_end)
        key = f"{prev_name or 'start'} -> {name}"
        for table, k in ((by_transition, key), (by_kernel, name)):
            slot = table.setdefault(k, {"count": 0, "us": 0.0})
            slot["count"] += 1
            slot["us"] += inc
        # and the kernel's own span, start to end (under PDL it includes the time parked at its wait)
        by_transition[key]["own_us"] = by_transition[key].get("own_us", 0.0) + end - start
        prev_name, prev_end = name, end
    return {"span_us": order[-1][2] - order[0][1], "kernels": len(order), "by_transition": by_transition,
            "by_kernel": by_kernel}


LAYER_MARK = "_attention_split_kernel"  # one launch in every decoder layer, fused or not


def _marks(kernels: list[tuple[str, float, float]], mark: str) -> list[tuple[int, float]]:
    """(place in end order, end) of each launch of `mark`: the layers' boundaries, as the chain reaches them."""
    order = sorted(kernels, key=lambda k: (k[2], k[1]))
    return [(i, e) for i, (n, _, e) in enumerate(order) if short_name(n) == mark]


def layer_kernels(kernels: list[tuple[str, float, float]], mark: str = LAYER_MARK) -> list[int]:
    """The kernels from each launch of `mark` to the next (ends sorted): a layer's dependent steps, as the captured
    graph runs them (the first layer's lead-in and the last layer's tail are not counted)."""
    at = _marks(kernels, mark)
    return [b - a for (a, _), (b, _) in zip(at, at[1:])]


def layer_times(kernels: list[tuple[str, float, float]], mark: str = LAYER_MARK) -> list[float]:
    """us from each launch of `mark`'s end to the next one's: what a layer adds to the chain, whatever its kernels,
    so forms with different launches compare layer by layer (`layer_kernels`' layers)."""
    at = _marks(kernels, mark)
    return [b - a for (_, a), (_, b) in zip(at, at[1:])]


def merge(replays: list[dict]) -> dict:
    """Medians over replays of each transition's and kernel's us (and its count, which must not vary)."""
    out = {"span_us": statistics.median(r["span_us"] for r in replays),
           "kernels": statistics.median(r["kernels"] for r in replays)}
    for table in ("by_transition", "by_kernel"):
        keys = {k for r in replays for k in r[table]}
        out[table] = {k: {"count": statistics.median(r[table].get(k, {"count": 0})["count"] for r in replays),
                          "us": statistics.median(r[table].get(k, {"us": 0.0})["us"] for r in replays)}
                      for k in keys}
    for k, slot in out["by_transition"].items():
        slot["own_us"] = statistics.median(r["by_transition"].get(k, {}).get("own_us", 0.0) for r in replays)
    return out


def split_replays(events: list[tuple[str, float, float]], gap_us: float = 20.0) -> list[list[tuple[str, float, float]]]:
    """The traced kernels cut into replays: each replay follows a host sync, so it starts more than `gap_us` after
    everything before it has ended, while a replay's own kernels follow each other without such a gap."""
    events = sorted(events, key=lambda e: e[1])
    out: list[list[tuple[str, float, float]]] = []
    last_end = None
    for e in events:
        if last_end is None or e[1] > last_end + gap_us:
            out.append([])
        out[-1].append(e)
        last_end = e[2] if last_end is None else max(last_end, e[2])
    return out


def _trace(graph, replays: int) -> list[tuple[str, float, float]]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


@torch.no_grad()
def trace_variant(config, weights, name: str, context: int, rows: int, replays: int, seed: int,
                  tokens_mode: str = "decode") -> dict:
    """One engine variant's captured forward (+ one draft call), traced over `replays` replays. `tokens_mode`:
    "decode" (the prompt prefilled for real, then the first round's verification block: the committed token and its
    drafts at their positions, as `iquest bench step` decodes; ~13 distinct experts a layer there), "same" (one
    random token in every row after synthetic history) or "distinct" (a random token a row); the last two route to
    ~3x the experts (measured under the retired architecture: ~44 a layer at b6fcf0f/99b7508), so their MoE streams
~3x the bytes."""
    from ..fast.rank import EngineOptions, RankEngine
    from ..fast.synthetic import synthetic_parallel
    from ..reference.config import GenerationConfig
    from .full_step import synthetic_request
    from .history import fill_history
    from .timing import replay_times

    dev = torch.device("cuda")
    generation = GenerationConfig(eos_token_id=config.eos_token_id)
    options = variants.options(name, EngineOptions(max_context=context + 64, graphs=False))
    engine = variants.prepare(RankEngine.from_weights(config, weights, generation, synthetic_parallel(TP, 0, dev),
                                                      options), name)
    g = torch.Generator(device=dev).manual_seed(seed)
    if tokens_mode == "decode":  # as bench/full_step.py: its request, prefilled for real
        runner, _ = engine.runner(rows - 1, generation.top_k)
        engine.start(synthetic_request(config, TP, context, seed, generation, 64, rows - 1), runner)
        st, j = engine.state, runner.rows
        tokens = torch.cat([st.tokens.index_select(0, st.n.view(1)), st.drafts]).clone()
        positions, live = (st.n + j).clone(), (j <= st.k).clone()
        rows = tokens.shape[0]
    else:
        fill_history(engine, context, seed)
        tokens = torch.randint(2, config.vocab_size // TP, (1 if tokens_mode == "same" else rows,), device=dev,
                               generator=g).expand(rows).contiguous()
        positions = torch.arange(context, context + rows, device=dev)
        live = torch.ones(rows, dtype=torch.bool, device=dev)
    model = engine.model
    nxt = tokens[1:2] if tokens.shape[0] > 1 else tokens[:1]

    def forward():
        logits, h = model.forward(tokens, positions, live)
        model.draft(nxt, h[:1], positions[:1], live[:1])  # a draft row at p: h_p and the token at p + 1
        return logits

    side = torch.cuda.Stream(dev)  # warm-up (compiles every kernel) off the capture
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        forward()
        taps: dict = {}
        model.forward(tokens, positions, live, taps=taps)  # the routing the captured forward takes
    torch.cuda.current_stream(dev).wait_stream(side)
    distinct = [len(set(v.flatten().tolist())) for k, v in taps.items() if k.startswith("layer") and
                k.endswith(".experts")]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
    torch.cuda.synchronize()
    replay_us = statistics.median(replay_times(graph, 1, 10))
    parts = split_replays(_trace(graph, replays))
    counts = [len(p) for p in parts]
    if len(parts) != replays or len(set(counts)) != 1:  # a dropped record would shift every increment after it
        raise RuntimeError(f"traced {len(parts)} replays of {counts} kernels, expected {replays} equal ones")
    per_layer = layer_kernels(parts[0])  # the graph's structure: the same in every replay
    times = [layer_times(p) for p in parts]
    return {"variant": name, "replay_us": replay_us, "kernels_per_replay": counts[0], "tokens": tokens_mode,
            "rows": rows, "live_rows": int(live.sum()),
            "kernels_a_layer": {"median": statistics.median(per_layer) if per_layer else None,
                                "min": min(per_layer, default=None), "max": max(per_layer, default=None),
                                "layers": len(per_layer)},
            "us_a_layer": {stat: statistics.median(f(t) for t in times) if times[0] else None
                           for stat, f in (("median", statistics.median), ("min", min), ("max", max))},
            "distinct_experts_median": statistics.median(distinct) if distinct else None,
            **merge([attribute(p) for p in parts])}


def run(config_file: str, context: int, rows: int, kernels: tuple[str, ...], replays: int, seed: int,
        out: str | None, tokens_mode: str = "decode") -> dict:
    from ..fast.rank import EngineOptions
    from ..fast.synthetic import synthetic_weights
    from .full_step import load_config

    config = load_config(config_file)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    weights = synthetic_weights(config, TP, 0, dev, EngineOptions().torch_dtype(dev), seed)
    build_s = time.perf_counter() - t0
    report = {"bench": "graph-trace", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "host": platform.node(), "command": shlex.join(["iquest", *sys.argv[1:]]),
              "config": config_file, "tp_slice": TP, "context": context, "rows": rows, "replays": replays,
              "build_s": build_s,
              "notes": ["one plain CUDA graph: the verification forward over the rows, then one draft-layer call on "
                        "one row; collectives as local no-ops (one TP8 rank's slice)",
                        "a kernel's increment = its end minus the previous kernel's end (ends in launch order); "
                        "medians over the traced replays"],
              "variants": []}
    for name in kernels:
        report["variants"].append(trace_variant(config, weights, name, context, rows, replays, seed, tokens_mode))
        _print(report["variants"][-1])
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def _print(v: dict, top: int = 30) -> None:
    print(f"\n{v['variant']}: replay {v['replay_us']:.1f} us (CUDA events), traced span {v['span_us']:.1f} us, "
          f"{v['kernels_per_replay']} kernels a replay; tokens {v['tokens']} ({v['live_rows']} of {v['rows']} rows live), "
          f"median "
          f"{v['distinct_experts_median']} distinct experts a main layer")
    k = v["kernels_a_layer"]
    print(f"  dependent steps a decoder layer (kernels from one {LAYER_MARK} to the next, {k['layers']} layers): "
          f"median {k['median']}, {k['min']}..{k['max']}")
    t = v["us_a_layer"]
    if t["median"] is not None:
        print(f"  us a decoder layer (one {LAYER_MARK}'s end to the next's, medians over replays): median "
              f"{t['median']:.2f}, {t['min']:.2f}..{t['max']:.2f}")
    print(f"  {'us a replay':>11} {'count':>6} {'us a call':>9} {'own a call':>10}  previous kernel -> kernel")
    rows = sorted(v["by_transition"].items(), key=lambda kv: -kv[1]["us"])
    for k, s in rows[:top]:
        n = max(s["count"], 1)
        print(f"  {s['us']:11.1f} {s['count']:6.0f} {s['us'] / n:9.2f} {s.get('own_us', 0.0) / n:10.2f}  {k}")
    rest = rows[top:]
    if rest:
        print(f"  {sum(s['us'] for _, s in rest):11.1f} {sum(s['count'] for _, s in rest):6.0f}            "
              f"({len(rest)} more transitions)")

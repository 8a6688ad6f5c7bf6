"""`iquest bench step --config FILE --tp-slice N`: one rank's shard of a model at full dimensions.

Rank 0's slice of the TP-N layout of docs/model.md's model, with random weights made on the device
(fast/synthetic.py: shaped as `load_weights` gives them, FP8 where the linears run as FP8), runs the real round
code; its collectives are replaced by local no-ops, so the figure is one rank's compute without communication. Op
groups without a published-architecture kernel run their torch forms under every variant (fast/plan.py), so a
`triton` round today times the FP8 linears, sampling and glue kernels beside torch attention, norms, MoE and heads. In one process: the device copy bandwidth (before the weights take the memory),
then a prefill (untimed, once), then alternating timed decode chunks with the captured decode-loop
graph and with the eager loop, each from the same restored post-prefill state; one more eager chunk
records the routing (distinct experts per MoE call) for the byte count (bench/bytes.py); a few rounds of
each variant under torch.profiler give the per-stage breakdown. The round's kernels form one dependent chain, so
besides the byte floor it reports a step-and-byte bound (`step_bound`): the profiled kernel count times one bare
dependent step measured in the same run (bench/parking.py), plus each stage's bytes beyond its own steps. Prints a
table and writes JSON.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import fields
from pathlib import Path

import torch

from ..fast.memory import rank_tensor_bytes
from ..fast.rank import EngineOptions, RankEngine, Request
from ..fast.synthetic import synthetic_parallel, synthetic_weights
from ..fast.weights import MoE, weight_format
from ..reference.config import Config, GenerationConfig
from .bytes import STAGE_ITEMS, ByteCounter, RoundRouting, stage_bytes
from .parking import dependent_step_us
from .acceptance import tpot
from .history import fill_history, synthetic_history
from . import launches, variants
from .timing import sync, time_chunk
from ..provenance import commit

STAGES = ("attention", "mlp", "norm", "lm_head", "sampling", "draft")  # labels in fast/model.py, fast/round.py,
# fast/torch_ops.py
TARGET_FLOOR_RATIO, TARGET_SPEEDUP = 1.5, 8.0
TOP_KERNELS, KERNEL_NAME_CHARS, PRINT_KERNELS = 40, 120, 20  # per-kernel rows kept in the profile (by device time)
PROFILE_TOKENS = 4  # tokens decoded under the profiler, per variant
SNAPSHOT_KV_LIMIT = 4 << 30  # restore every layer's KV contents when they are this small


def load_config(path: str | Path) -> Config:
    """A model's config for the synthetic benchmarks: a model folder (config.json and mtp/config.json), or a target's
    config file with its draft's beside it (mtp/config.json, else NAME-mtp.json: configs/iquest-q1.json and
    configs/iquest-q1-mtp.json)."""
    from ..cli.info_cmd import config_with_draft

    path = Path(path)
    return Config.from_dir(path) if path.is_dir() else config_with_draft(path)


def synthetic_request(config: Config, tp: int, context: int, seed: int, generation: GenerationConfig,
                      max_new_tokens: int, drafts: int) -> Request:
    """A decode request of `context` random prompt tokens from rank 0's vocabulary rows (other ranks' rows would embed
    to zero without the all-reduce), with the generation config's sampling."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, config.vocab_size // tp, (context,), generator=g).tolist()
    return Request(tuple(prompt), seed, generation.temperature, generation.top_k, generation.top_p, max_new_tokens,
                   drafts, ())


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, copies: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (GPU_FACTS.md)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(copies):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * copies / seconds


class Snapshot:
    """The engine's post-prefill state, restored in place (captured graphs keep their addresses)."""

    def __init__(self, engine: RankEngine):
        self.engine = engine
        st, cache = engine.state, engine.cache
        self.state = {f.name: t.clone() for f in fields(st) if (t := getattr(st, f.name)) is not None}
        self.slot_pos = [kv.slot_pos.clone() for kv in cache.layers]
        kv_bytes = sum(2 * kv.k.numel() * kv.k.element_size() for kv in cache.layers)
        self.all_kv = kv_bytes <= SNAPSHOT_KV_LIMIT
        layers = range(len(cache.layers)) if self.all_kv else [len(cache.layers) - 1]  # else the draft's cache
        self.kv = {i: (cache[i].k.clone(), cache[i].v.clone()) for i in layers}

    def restore(self) -> None:
        st, cache = self.engine.state, self.engine.cache
        for name, value in self.state.items():
            getattr(st, name).copy_(value)
        for kv, pos in zip(cache.layers, self.slot_pos):
            kv.slot_pos.copy_(pos)
        for i, (k, v) in self.kv.items():
            cache[i].k.copy_(k)
            cache[i].v.copy_(v)


class RoutingRecorder:
    """While active (eager rounds only), records each round's distinct experts per MoE call over live rows: the
    model's `mlp` (which knows the layer's tag and live rows) and its ops' `route` (whose experts it keeps) are
    wrapped on the instances, and put back on exit (a benchmark variant's own `route` stub included)."""

    def __init__(self, engine: RankEngine, runner):
        self.model, self.runner, self.rounds = engine.model, runner, []

    def __enter__(self) -> "RoutingRecorder":
        model, runner, ops, current = self.model, self.runner, self.model.ops, {}
        mlp, route, round_ = model.mlp, ops.route, runner.round
        self._own_route = vars(ops).get("route")  # an ablation's stub, or None: the class's method

        def rec_mlp(c, weights, b, live, taps, tag):
            current.pop("experts", None)
            out = mlp(c, weights, b, live, taps, tag)
            if self.rounds and isinstance(weights, MoE) and "experts" in current:
                self.rounds[-1].append((tag, int(live.sum()), int(current["experts"][live].unique().numel())))
            return out

        def rec_route(*args, **kw):
            routed = route(*args, **kw)
            current["experts"] = routed[1]
            return routed

        def rec_round():
            self.rounds.append([])
            round_()

        model.mlp, ops.route, runner.round = rec_mlp, rec_route, rec_round
        self._round = round_
        return self

    def __exit__(self, *exc) -> None:
        del self.model.mlp  # the class's method again
        if self._own_route is None:
            del self.model.ops.route
        else:
            self.model.ops.route = self._own_route
        self.runner.round = self._round  # an attribute of the runner itself (RoundRunner.__init__)

    def routings(self, moe_layers: int, k: int) -> list[RoundRouting]:
        """Each complete round's routing: `moe_layers` main MoE calls and `k` draft passes."""
        out = []
        for calls in self.rounds:
            verify = tuple(n for tag, _, n in calls if tag.startswith("layer"))
            draft = [(rows, n) for tag, rows, n in calls if tag == "mtp."]
            if len(verify) == moe_layers and len(draft) == k:
                out.append(RoundRouting(verify, tuple(n for _, n in draft), accepted=draft[0][0] - 1))
        return out


def step_bound(step_us: float, launches: float, launches_by_stage: dict[str, float],
               stage_floor_us: dict[str, float]) -> float:
    """Least round time for a chain of `launches` dependent kernels, each at least one bare dependent step, whose stages
    must also move their bytes: every kernel's step, plus each stage's byte floor beyond its own kernels' steps (a
    stage's bytes can hide under its own steps, not under another stage's: each waits for the one before)."""
    extra = sum(max(0.0, floor - step_us * launches_by_stage.get(stage, 0.0)) for stage, floor in stage_floor_us.items())
    return step_us * launches + extra


def _stage_of(event) -> str:
    e = event
    while e is not None:
        if e.name in STAGES:
            return e.name
        e = e.cpu_parent
    return "other"


def breakdown(events, wall_us: float, rounds: int, cuda: bool) -> dict:
    """Per-round time by stage (innermost label): device kernel time on CUDA, self CPU time on CPU;
    gaps = wall - busy. Graph replays carry no labels: their kernels count as "other"."""
    from torch.autograd import DeviceType

    per = dict.fromkeys(STAGES + ("other",), 0.0)
    launched = dict.fromkeys(STAGES + ("other",), 0)  # device kernels a stage's ops launched
    busy = 0.0
    by_kernel: dict[str, list[float]] = {}  # device kernel name -> [launches, us]
    for e in events:
        if e.device_type == DeviceType.CPU:
            t = sum(k.duration for k in e.kernels) if cuda else e.self_cpu_time_total
            if t:
                per[_stage_of(e)] += t
            launched[_stage_of(e)] += len(e.kernels)
        elif cuda and not getattr(e, "is_user_annotation", False) and e.name not in STAGES:
            busy += e.time_range.elapsed_us()
            slot = by_kernel.setdefault(e.name[:KERNEL_NAME_CHARS], [0, 0.0])
            slot[0] += 1
            slot[1] += e.time_range.elapsed_us()
    if cuda:  # kernels the profiler saw but could not tie to a CPU op (e.g. inside graph replays)
        per["other"] += max(0.0, busy - sum(per.values()))
    else:
        busy = sum(per.values())
    rounds = max(rounds, 1)
    out = {s: v / rounds for s, v in per.items()}
    out["busy"] = busy / rounds
    out["gaps"] = wall_us / rounds - out["busy"]
    out["wall"] = wall_us / rounds
    out["launches"] = sum(n for n, _ in by_kernel.values()) / rounds
    out["launches_by_stage"] = {k: v / rounds for k, v in launched.items()}
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    out["top_kernels"] = [{"name": k, "launches": n / rounds, "us": t / rounds} for k, (n, t) in top]
    return out


def run(config_file: str, tp: int, context: int, drafts: int, repeats: int, chunk_tokens: int, seed: int,
        device: str, out: str | None, profile_rounds: bool = True, kernels: tuple[str, ...] = ("torch",),
        history: str = "auto", layers: int | None = None, eager: bool = True, quiet: bool = False) -> dict:
    """`kernels`: the engine variants, each run with the captured graph (CUDA) and eagerly (unless not `eager`), all
    over one set of weights; the first variant is the one held to the byte floor, "torch" eager is the eager
    baseline. `quiet`: no report printed (a caller that prints its own)."""
    config = load_config(config_file)
    config = config.first_layers(layers) if layers else config
    config.check_tp(tp)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    cuda = dev.type == "cuda"
    notes = ["collectives replaced by local no-ops: one rank's compute, no communication",
             f"variants: {', '.join(kernels)} (torch = the torch form of every op; triton = the kernels of kernels/ "
             "for every op group of fast/plan.GROUPS); "
             "eager = the same round code run by the eager loop (host reads each condition)",
             "each timed chunk starts from its engine's restored post-prefill state (one prefill per engine)"]
    if not cuda:
        notes.append("no CUDA device: graph capture and the bandwidth floor are skipped (eager loop only)")
    filled = synthetic_history(history, context)
    if filled:
        notes.append(f"synthetic history: positions 0..{filled - 1} hold random K/V with correct position labels "
                     f"(bench/history.py); prefill ran on the last {context - filled} prompt tokens")
    for n in notes if not quiet else ():
        print(n)
    bandwidth = copy_bandwidth(dev) if cuda else None
    bare_step = dependent_step_us(dev) if cuda else None
    fmt = weight_format("auto", config, dev)  # what the linears run as: FP8 on CUDA and for an FP8 checkpoint
    weight_bytes = sum(rank_tensor_bytes(config, tp, 0, fmt).values())
    if cuda:
        free, _ = torch.cuda.mem_get_info(dev)
        need = weight_bytes  # the engines share the weights; caches at 1K context are small
        print(f"rank 0 of tp={tp}: {weight_bytes / 1e9:.1f} GB of weights ({fmt}); {free / 1e9:.1f} GB free")
        if need > free:
            raise RuntimeError(f"rank slice needs {need / 1e9:.1f} GB, the device has {free / 1e9:.1f} GB free")
    options = EngineOptions(max_context=context + 2 * chunk_tokens + 64, graphs=cuda)
    dtype = options.torch_dtype(dev)
    t0 = time.perf_counter()
    weights = synthetic_weights(config, tp, 0, dev, dtype, seed, fmt=fmt)
    build_s = time.perf_counter() - t0
    generation = GenerationConfig(eos_token_id=config.eos_token_id)
    req = synthetic_request(config, tp, context, seed, generation, chunk_tokens + 1, drafts)
    engines, timing, captured = {}, {}, {}
    for name in kernels:  # the weights are shared; each engine has its own caches, state and graph
        engine = variants.prepare(RankEngine.from_weights(config, weights, generation, synthetic_parallel(tp, 0, dev),
                                                          variants.options(name, options)), name)
        t0 = time.perf_counter()
        with launches.recorded() as captured[name]:  # the capture's Triton kernels: do the variants' graphs differ
            runner, graph = engine.runner(drafts, generation.top_k)
        t1 = time.perf_counter()
        if filled:
            fill_history(engine, filled, seed)
        engine.start(req, runner, history=filled)
        sync(dev)
        timing[name] = {"capture_s": t1 - t0, "prefill_s": time.perf_counter() - t1}
        engines[name] = (engine, runner, graph, Snapshot(engine))

    def chunk(name: str, mode: str) -> dict:
        engine, runner, graph, snap = engines[name]
        snap.restore()
        return time_chunk(engine, lambda: engine.decode_chunk(runner, graph if mode == "graph" else None), dev)

    modes = [(k, m) for k in kernels for m in ((("graph", "eager") if eager else ("graph",)) if cuda else ("eager",))]
    for k, m in modes:  # warm-up, untimed: first-use allocations, kernel compiles, lazily kept dense weights
        chunk(k, m)
    for k in kernels:
        variants.check(engines[k][0], k)
    runs: dict[str, list[dict]] = {f"{k}/{m}": [] for k, m in modes}
    for _ in range(repeats):  # alternating: drifts in clocks or temperature hit every variant alike
        for k, m in modes:
            runs[f"{k}/{m}"].append(chunk(k, m))
    summary: dict = {}
    for key, rows in runs.items():
        summary[key] = {"median_round_us": statistics.median(r["round_us"] for r in rows),
                        "tokens_per_round": sum(r["tokens"] for r in rows) / max(1, sum(r["rounds"] for r in rows))}
    main = modes[0][0] + "/" + modes[0][1]
    paired = paired_ratios(runs, main)
    baseline = "torch/eager" if "torch/eager" in summary else None
    if baseline and baseline != main:
        summary["speedup"] = summary[baseline]["median_round_us"] / summary[main]["median_round_us"]

    # Bytes per round from each variant's routing (one more eager chunk of it, recorded), and the upper bound: a
    # variant that pins the routing (triton~route:38) is held to its own floor.
    counter = ByteCounter(config, tp, 0, act_bytes=torch.finfo(dtype).bits // 8, fmt=fmt)
    upper = counter.round(context, drafts)
    by_variant = {k: _round_bytes(engines[k], counter, config, context, drafts, upper) for k in kernels}
    bytes_info = by_variant[kernels[0]]
    best = summary[main]["median_round_us"]
    profile = tpot(best, drafts)
    floor, floors = None, {}
    if bandwidth:
        floors = variant_floors(by_variant, summary, main.split("/")[1], upper["total"], bandwidth)
        floor = {"bandwidth_bytes_per_s": bandwidth, "floor_us": floors[kernels[0]]["floor_us"],
                 "floor_upper_us": upper["total"] / bandwidth * 1e6, "variant": main}
        floor["ratio"] = best / floor["floor_us"]
        floor["stages_us"] = {k: v / bandwidth * 1e6 for k, v in bytes_info["stages"].items()}
    stages = {}
    if profile_rounds:
        for k, m in modes:
            engine, runner, graph, snap = engines[k]
            try:
                stages[f"{k}/{m}"] = _profiled(engine, runner, graph if m == "graph" else None, snap, dev)
            except Exception as exc:  # a profiler failure must not lose the timings above
                notes.append(f"profiling {k}/{m} failed: {type(exc).__name__}: {exc}")

    eager = stages.get(f"{kernels[0]}/eager")
    if floor and bare_step and eager and eager.get("launches"):
        floor["dependent_step_us"], floor["launches"] = bare_step, eager["launches"]
        floor["step_bound_us"] = step_bound(bare_step, eager["launches"], eager["launches_by_stage"], floor["stages_us"])
        floor["step_bound_ratio"] = floor["step_bound_us"] / floor["floor_us"]
    report = {"bench": "step-full", "config": str(config_file), "layers": config.num_hidden_layers, "tp_slice": tp, "rank": 0, "context": context,
              "drafts": drafts, "repeats": repeats, "chunk_tokens": chunk_tokens, "seed": seed, "notes": notes,
              "synthetic_history": filled,
              "kernels": list(kernels), "main_variant": main, "baseline_variant": baseline,
              "commit": commit(), "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
              "torch": torch.__version__, "host": platform.node(), "dtype": str(dtype), "weights": fmt,
              "weight_bytes": weight_bytes, "build_s": build_s, "engines": timing,
              "restore_all_kv": all(e[3].all_kv for e in engines.values()), "summary": summary, "bytes": bytes_info,
              "floor": floor, "floors_by_variant": floors, "paired": paired,
              "graphs": {k: launches.compare(captured[kernels[0]].kernels, captured[k].kernels) for k in kernels[1:]},
              "bytes_by_variant": {k: {n: b[n] for n in ("measured_median", "distinct_experts_verify_mean")}
                                   for k, b in by_variant.items()}, "stages_us_per_round": stages, "tpot_mini_profile": profile,
              "targets": {"floor_ratio_max": TARGET_FLOOR_RATIO, "speedup_min": TARGET_SPEEDUP,
                          "floor_met": floor is not None and floor["ratio"] <= TARGET_FLOOR_RATIO,
                          "speedup_met": summary.get("speedup", 0.0) >= TARGET_SPEEDUP},
              "runs": runs}
    if not quiet:
        _print(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def paired_ratios(runs: dict[str, list[dict]], main: str) -> dict:
    """Each other arm's round against the main arm's of the same repeat (the arms alternate within a repeat, so a
    drift in clocks or temperature divides out): {arm: {"median", "min", "max", "n"}} of round_us / main's. An A'
    arm (the main variant again, primed) gives the spread a real difference must clear."""
    ref = [r["round_us"] for r in runs[main]]
    out = {}
    for key, rows in runs.items():
        if key == main or key.split("/")[1] != main.split("/")[1]:  # graph against graph, eager against eager
            continue
        ratios = [r["round_us"] / m for r, m in zip(rows, ref)]
        out[key] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
    return out


def variant_floors(by_variant: dict, summary: dict, mode: str, upper_total: float, bandwidth: float) -> dict:
    """Each variant's round (in `mode`) against the byte floor of its own routing's bytes (the upper bound where
    none was recorded)."""
    out = {}
    for k, b in by_variant.items():
        floor_us = (b["measured_median"] or upper_total) / bandwidth * 1e6
        round_us = summary[f"{k}/{mode}"]["median_round_us"]
        out[k] = {"floor_us": floor_us, "distinct_experts_verify_mean": b["distinct_experts_verify_mean"],
                  "bytes_measured_median": b["measured_median"], "mode": mode, "median_round_us": round_us,
                  "ratio": round_us / floor_us}
    return out


def _round_bytes(built: tuple, counter: ByteCounter, config: Config, context: int, drafts: int, upper: dict) -> dict:
    """One variant's bytes per round over the routing of one recorded eager chunk (median of its rounds)."""
    engine, runner, _, snap = built
    snap.restore()
    with RoutingRecorder(engine, runner) as rec:
        engine.decode_chunk(runner, None)
    routings = rec.routings(len(counter.moe_layers), drafts)
    per_round = [counter.round(context, drafts, r) for r in routings]
    return {"measured_median": statistics.median(b["total"] for b in per_round) if per_round else None,
            "upper_bound": upper["total"], "rounds_recorded": len(per_round),
            "breakdown_first_round": per_round[0] if per_round else None, "breakdown_upper": upper,
            "distinct_experts_verify_mean": statistics.mean(statistics.mean(r.verify) for r in routings)
            if routings and counter.moe_layers else None,
            "distinct_experts_verify_upper": counter.upper_bound_experts(drafts + 1),
            "stages": {k: statistics.median(stage_bytes(b)[k] for b in per_round) for k in STAGE_ITEMS}
            if per_round else stage_bytes(upper)}


def _profiled(engine: RankEngine, runner, graph, snap: Snapshot, dev: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    snap.restore()
    st = engine.state
    st.budget.copy_(st.emitted + PROFILE_TOKENS)  # a few rounds: the profiler's trace stays small
    rounds0 = int(st.rounds)
    sync(dev)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.decode_chunk(runner, graph)
        sync(dev)
        wall_us = (time.perf_counter() - start) * 1e6
    return breakdown(prof.events(), wall_us, int(st.rounds) - rounds0, cuda)


def _print(r: dict) -> None:
    s, b, f = r["summary"], r["bytes"], r["floor"]
    print(f"bench step  config={r['config']} tp-slice={r['tp_slice']} (rank 0) context={r['context']} "
          f"drafts={r['drafts']} repeats={r['repeats']} commit={r['commit']} device={r['device']}")
    setup = "; ".join(f"{k}: capture {t['capture_s']:.1f} s, prefill {t['prefill_s']:.1f} s" for k, t in r["engines"].items())
    print(f"weights {r['weight_bytes'] / 1e9:.2f} GB ({r['weights']}) built in {r['build_s']:.1f} s; {setup} (untimed)")
    print(f"{'variant':14} {'median round (us)':>18} {'tokens/round':>13}")
    for key, v in s.items():
        if isinstance(v, dict):
            print(f"{key:14} {v['median_round_us']:18.1f} {v['tokens_per_round']:13.2f}")
    for key, p in r.get("paired", {}).items():
        print(f"{key} against {r['main_variant']}, paired by repeat: {p['median']:.4f}x median "
              f"({p['min']:.4f}-{p['max']:.4f}, {p['n']} repeats)")
    for key, c in r.get("graphs", {}).items():
        print(launches.verdict(key, r["kernels"][0], c))
    if "speedup" in s:
        print(f"{r['main_variant']} speedup over {r['baseline_variant']}: {s['speedup']:.2f}x (target >= {TARGET_SPEEDUP:.0f}x)")
    if r.get("tpot_mini_profile"):
        p = r["tpot_mini_profile"]
        print(f"TPOT on the mini model's acceptance profile ({p['tokens_per_round']:.2f} tokens/round at depth "
              f"{r['drafts']}, {p['source']}): {p['tpot_us']:.1f} us for {r['main_variant']}")
    measured = b["measured_median"]
    print(f"bytes per round: {measured / 1e6:.2f} MB measured routing (median of {b['rounds_recorded']} rounds), "
          f"{b['upper_bound'] / 1e6:.2f} MB upper bound" if measured else
          f"bytes per round: {b['upper_bound'] / 1e6:.2f} MB upper bound (no routing recorded)")
    if b["distinct_experts_verify_mean"] is not None:
        print(f"distinct experts per main MoE layer over {r['drafts'] + 1} rows: {b['distinct_experts_verify_mean']:.1f} "
              f"(upper bound {b['distinct_experts_verify_upper']})")
    if f:
        print(f"device copy bandwidth {f['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + written); "
              f"floor {f['floor_us']:.1f} us (upper-bound bytes: {f['floor_upper_us']:.1f} us); "
              f"{f['variant']} at {f['ratio']:.2f}x the floor (target <= {TARGET_FLOOR_RATIO}x)")
        for k, v in r.get("floors_by_variant", {}).items():
            if len(r["floors_by_variant"]) > 1:
                print(f"  {k}/{v['mode']}: {v['distinct_experts_verify_mean']:.1f} distinct experts a main layer, "
                      f"its own floor {v['floor_us']:.1f} us, round {v['median_round_us']:.1f} us = {v['ratio']:.2f}x")
    else:
        print("byte floor: skipped (no CUDA device)")
    if f and f.get("step_bound_us"):
        print(f"dependent step {f['dependent_step_us']:.2f} us (a chained small kernel, same run) x "
              f"{f['launches']:.0f} kernels a round, plus each stage's bytes beyond its steps: step-and-byte bound "
              f"{f['step_bound_us']:.1f} us = {f['step_bound_ratio']:.2f}x the byte floor; {f['variant']} at "
              f"{f['ratio'] / f['step_bound_ratio']:.2f}x that bound")
    eager = r["stages_us_per_round"].get(r["main_variant"].split("/")[0] + "/eager")
    if f and eager and f.get("stages_us"):  # graph replays carry no stage labels: the same kernels' eager row
        cols = "  ".join(f"{k} {eager[k]:.0f}/{f['stages_us'][k]:.0f} ({eager[k] / f['stages_us'][k]:.1f}x)"
                         for k in f["stages_us"] if f["stages_us"][k] > 0)
        print(f"stages against their byte floors, {r['main_variant'].split('/')[0]}/eager (us/round, measured/floor): "
              f"{cols}")
    for key, st in r["stages_us_per_round"].items():
        if key.endswith("/graph"):  # replays carry no stage labels: only busy and wall mean something
            print(f"stages, {key} (us/round): [wall {st['wall']:.0f}] not attributed: graph replays carry no stage "
                  f"labels and the profiler traced only {st['busy']:.0f} us of kernels inside the conditional-node "
                  "bodies; see the eager row of the same kernels")
            continue
        cols = "  ".join(f"{k} {st[k]:.0f}" for k in STAGES + ("other", "gaps"))
        print(f"stages, {key} (us/round): {cols}  [wall {st['wall']:.0f}, {st.get('launches', 0):.0f} kernels]")
        for row in st.get("top_kernels", [])[:PRINT_KERNELS]:
            print(f"    {row['us']:9.1f} us {row['launches']:7.1f} x  {row['name'][:100]}")
    for n in r["notes"]:
        print("note:", n)

"""`iquest bench step --config FILE --tp N` (or `--tp-slice N --ranks M`): rounds with real collectives, one
process per rank.

`--tp N` is real tensor parallelism: N processes, each with its slice of the TP-N layout. `--tp-slice N --ranks M`
runs ranks 0..M-1 of the TP-N layout as M processes (e.g. two ranks of the full model's TP8 layout on two H200s,
where a TP2 rank would not fit): collectives run among the M processes with the TP-N message sizes, the
all-gather tiles the M parts to N (the outputs are not the model's; the communication and compute are a TP-N
rank's).

Every rank makes its own slice of the TP-N layout (random weights on its device, fast/synthetic.py), joins
the process group (gloo: on GPUs it only bootstraps the peer-memory collectives of fast/collectives.py; multicast
stays off) and runs the same schedule: prefill, then `repeats` timed decode chunks, each from the restored
post-prefill state, with the captured decode-loop graph (GPUs) and eagerly, alternating. Ranks stay in lockstep
because the schedule is fixed and sampling is identical on every rank (all-gathered candidates, shared uniforms).
Rank 0 times each chunk between barriers and counts the collectives an eager round issues. `shared_gpu`: every
rank on GPU 0 (under an MPS daemon): a correctness and lockstep run, its times emulation, not NVLink figures.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import queue
import statistics
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ..fast.parallel import Parallel, free_port, init_process
from ..fast.rank import EngineOptions, RankEngine, Request
from ..fast.synthetic import synthetic_weights
from ..reference.config import GenerationConfig
from .full_step import Snapshot, load_config
from .acceptance import tpot
from .history import fill_history, synthetic_history
from .timing import time_chunk
from ..provenance import commit


@dataclass(frozen=True)
class PartialParallel(Parallel):
    """Ranks 0..processes-1 of a TP-`world` layout, one process each, collectives among those processes."""

    processes: int = 1

    @property
    def active(self) -> bool:
        return self.processes > 1

    @property
    def group_size(self) -> int:
        return self.processes

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.peers is not None:
            k = x.shape[-1]
            got = self.peers.all_gather_last(x)
            return torch.cat([got[..., (i % self.processes) * k:(i % self.processes + 1) * k]
                              for i in range(self.world)], dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.processes)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([parts[i % self.processes] for i in range(self.world)], dim=-1)


class CollectiveCounter:
    """Counts (and times on the host) the collectives a rank's Parallel issues while active."""

    def __init__(self, par: Parallel):
        self.par, self.calls = par, {"all_reduce": 0, "all_gather_last": 0, "broadcast": 0}

    def __enter__(self) -> "CollectiveCounter":
        for name in self.calls:
            original = getattr(type(self.par), name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            object.__setattr__(self.par, name, counted.__get__(self.par))
        peers = self.par.peers
        if peers is not None:  # an all-reduce ending in a sandwich tail is issued to the peers directly
            fused = peers.all_reduce_add_norm

            def counted_fused(*args, **kwargs):
                self.calls["all_reduce"] += 1
                return fused(*args, **kwargs)

            peers.all_reduce_add_norm = counted_fused
        return self

    def __exit__(self, *exc) -> None:
        for name in self.calls:
            object.__delattr__(self.par, name)
        if self.par.peers is not None:
            del self.par.peers.all_reduce_add_norm


def _decode(engine: RankEngine, runner, graph, counter: CollectiveCounter | None) -> None:
    """One decode chunk (the captured loop, or eager with `graph` None), its collectives counted while `counter` is
    given (the barrier around it is not)."""
    with counter if counter is not None else nullcontext():
        engine.decode_chunk(runner, graph)
    engine.par.check()


def _rank_main(rank: int, tp: int, port: int, kind: str, spec: dict, results: "mp.Queue") -> None:
    """`tp` is the layout; `spec["processes"]` how many of its ranks run (all of them for --tp)."""
    try:
        torch.set_num_threads(1)
        joined = init_process(rank, spec["processes"], port, kind, spec["shared_gpu"])
        par = joined if spec["processes"] == tp else PartialParallel(rank, tp, joined.device, joined.group,
                                                                      processes=spec["processes"])
        config = load_config(spec["config"])
        config = config.first_layers(spec["layers"]) if spec["layers"] else config
        options = EngineOptions(max_context=spec["context"] + 2 * spec["chunk_tokens"] + 64, graphs=kind == "cuda",
                                kernels=spec["kernels"], shared_gpu=spec["shared_gpu"])
        dtype = options.torch_dtype(par.device)
        weights = synthetic_weights(config, tp, rank, par.device, dtype, spec["seed"])
        generation = GenerationConfig(eos_token_id=config.eos_token_id)
        engine = RankEngine.from_weights(config, weights, generation, par, options)
        g = torch.Generator().manual_seed(spec["seed"])
        prompt = torch.randint(2, config.vocab_size, (spec["context"],), generator=g).tolist()
        req = Request(tuple(prompt), spec["seed"], generation.temperature, generation.top_k, generation.top_p,
                      spec["chunk_tokens"] + 1, spec["drafts"], ())
        runner, graph = engine.runner(spec["drafts"], generation.top_k)
        filled = synthetic_history(spec["history"], spec["context"])
        if filled:
            fill_history(engine, filled, spec["seed"])
        engine.start(req, runner, history=filled)
        snap = Snapshot(engine)
        st, chunks, counts = engine.state, {"graph": [], "eager": []}, None
        modes = [("graph", graph), ("eager", None)] if graph is not None else [("eager", None)]
        for i in range(spec["repeats"] + 1):  # the first chunk of each mode warms up, untimed
            for mode, g in modes:
                snap.restore()
                counter = CollectiveCounter(engine.par) if i == 1 and mode == "eager" else None
                chunk = time_chunk(engine, lambda: _decode(engine, runner, g, counter), engine.par.device,
                                   before=torch.distributed.barrier)
                if counter is not None:
                    counts = dict(counter.calls)
                if i:
                    chunks[mode].append({**chunk, "tokens_out": st.log_tokens[:int(st.emitted)].tolist()})
        engine.close()
        results.put(("ok", rank, {"chunks": chunks, "collectives_first_timed_chunk": counts}))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run(config_file: str, tp: int, context: int, drafts: int, repeats: int, chunk_tokens: int, seed: int,
        device: str, out: str | None, kernels: str = "torch", processes: int | None = None,
        history: str = "auto", shared_gpu: bool = False, layers: int | None = None) -> dict:
    """Layout TP-`tp`; `processes` of its ranks run (default all); `layers`: only the model's first main layers."""
    config = load_config(config_file)
    config = config.first_layers(layers) if layers else config
    config.check_tp(tp)
    processes = processes or tp
    if not 2 <= processes <= tp:
        raise ValueError(f"ranks must be in 2..{tp} for a TP-{tp} layout, got {processes}")
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if kind == "cuda" and not shared_gpu and torch.cuda.device_count() < processes:
        raise RuntimeError(f"{processes} ranks need {processes} GPUs, this machine has {torch.cuda.device_count()} "
                           "(--share-gpu puts every rank on GPU 0, under an MPS daemon, for a correctness run)")
    spec = {"config": str(config_file), "context": context, "drafts": drafts, "repeats": repeats,
            "chunk_tokens": chunk_tokens, "seed": seed, "kernels": kernels, "processes": processes,
            "history": history, "shared_gpu": shared_gpu, "layers": layers}
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, kind, spec, results), daemon=True)
             for r in range(processes)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < len(procs):
            try:
                status, rank, info = results.get(timeout=5)
            except queue.Empty:  # a rank killed outright (memory, a NCCL abort) posts nothing: do not wait forever
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{info}")
            got[rank] = info
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    by_mode = got[0]["chunks"]
    main = "graph" if by_mode["graph"] else "eager"
    chunks = by_mode[main]
    same = all(got[r]["chunks"][m][-1]["tokens_out"] == by_mode[main][-1]["tokens_out"]
               for r in got for m in by_mode if by_mode[m])
    counts = got[0]["collectives_first_timed_chunk"]
    rounds = by_mode["eager"][0]["rounds"]
    summary = {"median_round_us": statistics.median(c["round_us"] for c in chunks), "mode": main,
               "median_round_us_by_mode": {m: statistics.median(c["round_us"] for c in cs) for m, cs in by_mode.items()
                                           if cs},
               "tokens_per_round": sum(c["tokens"] for c in chunks) / max(1, sum(c["rounds"] for c in chunks)),
               "ranks_emitted_same_tokens": same,
               "collectives_per_round": {k: v / max(rounds, 1) for k, v in counts.items()}}
    summary["tpot_mini_profile"] = tpot(summary["median_round_us"], drafts)
    report = {"bench": "step-tp", "config": str(config_file), "layers": config.num_hidden_layers, "tp": tp,
              "ranks": processes,
              "partial": processes < tp, "context": context, "drafts": drafts,
              "synthetic_history": synthetic_history(history, context),
              "repeats": repeats, "chunk_tokens": chunk_tokens, "seed": seed, "kernels": kernels, "backend":
              "peer-memory kernels (gloo bootstrap)" if kind == "cuda" else "gloo", "shared_gpu": shared_gpu,
              "commit": commit(), "device": torch.cuda.get_device_name(0) if kind == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "host": platform.node(), "summary": summary,
              "runs": {m: [{k: v for k, v in c.items() if k != "tokens_out"} for c in cs] for m, cs in by_mode.items()}}
    who = f"tp={tp}" if processes == tp else f"ranks 0..{processes - 1} of the tp={tp} layout"
    print(f"bench step  config={config_file} {who} ({report['backend']}, one process per rank, real collectives) "
          f"layers={config.num_hidden_layers} context={context} drafts={drafts} kernels={kernels} repeats={repeats} "
          f"commit={report['commit']}")
    if shared_gpu:
        print("note: every rank on one GPU (MPS): a correctness and lockstep run; times are emulation, not NVLink")
    if report["synthetic_history"]:
        print(f"note: synthetic history: positions 0..{report['synthetic_history'] - 1} hold random K/V with correct "
              "position labels (bench/history.py); only the prompt's tail was prefilled")
    if processes < tp:
        print(f"note: collectives run among {processes} processes with TP-{tp} message sizes; the all-gather tiles "
              f"{processes} parts to {tp}: outputs are not the model's, communication and compute are a TP-{tp} rank's")
    print("median round " + ", ".join(f"{m} {v:.1f} us" for m, v in summary["median_round_us_by_mode"].items())
          + f"; tokens/round {summary['tokens_per_round']:.2f}; every rank emitted the same tokens (both modes): "
          f"{same}")
    if summary["tpot_mini_profile"]:
        p = summary["tpot_mini_profile"]
        print(f"TPOT on the mini model's acceptance profile ({p['tokens_per_round']:.2f} tokens/round at depth "
              f"{drafts}): {p['tpot_us']:.1f} us")
    print("collectives per round: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["collectives_per_round"].items()))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report

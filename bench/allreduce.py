"""`iquest bench allreduce`: one bf16 all-reduce of [rows, hidden] over --ranks GPUs, as TP decode issues it.

One process per GPU (torch.multiprocessing.spawn), or every rank on GPU 0 with --share-gpu (under an MPS daemon: an
emulation whose times say nothing about NVLink; NCCL and symmetric memory refuse several ranks on one GPU, so only
the peer kernels run there). NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1
are set before the process group starts (GPU_FACTS.md). Variants:
  peer       the engine's all-reduce (kernels/allreduce.py through fast/collectives.py): push, poll, rank order
  nccl       dist.all_reduce, in place
  one_shot   torch symmetric memory one_shot_all_reduce: every rank reads all peers' buffers (out of place)
  two_shot   torch symmetric memory two_shot_all_reduce_: reduce-scatter then all-gather via peers (in place)
Each is first checked on a rank-dependent fill whose sum is exact in bf16, then timed inside a CUDA
graph of CALLS calls on zeros (in-place sums stay finite); per call = replay time / CALLS, replays
started together after a barrier. A variant that is unavailable or fails records its error instead.
Rank 0 prints a table and writes JSON; the per-round line multiplies the per-call medians by the
all-reduces of one TP decode round (an estimate from this microbenchmark, not a measured round).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..reference.config import Config
from .timing import replay_times

VARIANTS = ("peer", "nccl", "one_shot", "two_shot")
PEER = ("peer",)
CALLS = 60  # per captured graph (a multiple of three, like the fused kernel's rotating slots)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
FULL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "iquest-q1.json"


DRAFTS = 5  # the fixed depth of the round


def round_allreduces(config: Config, drafts: int = DRAFTS) -> int:
    """All-reduces in one TP decode round at a fixed draft depth (docs/model.md, "Tensor parallelism"): the verify
    pass has two per decoder layer (after o_proj and after the MLP's Down) plus one after the vocabulary-parallel
    embedding; each draft pass has its embedding's, eh_proj's and the draft block's two (counted in a real TP round:
    tests/test_bench_tp_step.py)."""
    return 2 * config.num_hidden_layers + 1 + drafts * (1 + 1 + 2 * config.mtp.num_hidden_layers)


def _pattern(rows: int, hidden: int, device) -> torch.Tensor:
    return (torch.arange(rows * hidden, device=device) % 7 - 3).view(rows, hidden)


def fill(rank: int, rows: int, hidden: int, device=None) -> torch.Tensor:
    """Integers in -3..3 times (rank + 1): any partial sum over <= 8 ranks is an integer of magnitude
    <= 108, exact in bf16 whatever order the variant adds in."""
    return (_pattern(rows, hidden, device) * (rank + 1)).to(torch.bfloat16)


def expected_sum(world: int, rows: int, hidden: int, device=None) -> torch.Tensor:
    return (_pattern(rows, hidden, device) * (world * (world + 1) // 2)).to(torch.bfloat16)


def _variant(name: str, rows: int, hidden: int, device: torch.device, group, peers):
    """(buffer the rank writes its partial into, call returning the reduced tensor)."""
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    if name == "peer":
        return x, lambda: peers.all_reduce(x)
    if group is None:
        raise RuntimeError("NCCL and torch symmetric memory refuse several ranks on one GPU")
    if name == "nccl":
        def call():
            dist.all_reduce(x, group=group)
            return x
        return x, call
    import torch.distributed._symmetric_memory as symm_mem

    op = {"one_shot": "one_shot_all_reduce", "two_shot": "two_shot_all_reduce_"}[name]
    op = getattr(torch.ops.symm_mem, op)  # AttributeError (recorded) where this build lacks it
    buf = symm_mem.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, group)
    group_name = group.group_name
    return buf, lambda: op(buf, "sum", group_name)


def _graph_times(call, repeats: int) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # communicator setup and first-use allocations stay out of the graph
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    return replay_times(graph, CALLS, repeats, warmup=1, before=_lockstep)


def _lockstep() -> None:
    """Every rank idle, then all released together: a replay waiting on a late peer would time the wait."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def _measure(name: str, rows: int, hidden: int, repeats: int, rank: int, world: int, device, group, peers) -> dict:
    row: dict = {"variant": name, "rows": rows, "hidden": hidden}
    try:
        buf, call = _variant(name, rows, hidden, device, group, peers)
        buf.copy_(fill(rank, rows, hidden, device))
        torch.cuda.synchronize()
        dist.barrier()  # every peer's partial is written before anyone reads it
        want = expected_sum(world, rows, hidden, device)
        row["verified"] = bool(torch.equal(call(), want))
        torch.cuda.synchronize()
        dist.barrier()  # no peer still reads this buffer when it is zeroed
        buf.zero_()
        times = _graph_times(call, repeats)
        row.update(median_us=statistics.median(times), times_us=times)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).strip()}"[:2000]
    torch.cuda.synchronize()
    dist.barrier()
    return row


def _worker(rank: int, world: int, port: int, rows_list: list[int], hidden: int, repeats: int, out: str | None,
            command: str, config_file: str, shared_gpu: bool) -> None:
    os.environ.update(MULTICAST_OFF)  # before the process group and any symmetric memory exist
    from ..fast.collectives import PeerCollectives
    from ..fast.parallel import init_process

    par = init_process(rank, world, port, "cuda", shared_gpu)  # gloo: it bootstraps the peer buffers
    group = None if shared_gpu else dist.new_group(backend="nccl")
    peers = PeerCollectives(par.group, rank, world, hidden, 32, torch.bfloat16, par.device)
    mine = [_measure(v, r, hidden, repeats, rank, world, par.device, group, peers) for r in rows_list
            for v in VARIANTS]
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        from ..provenance import commit

        from .full_step import load_config

        config = load_config(config_file)
        report = {"bench": "allreduce", "commit": commit(), "ranks": world, "hidden": hidden, "rows": rows_list,
                  "shared_gpu": shared_gpu, "emulation": shared_gpu,
                  "repeats": repeats, "calls_per_graph": CALLS, "command": command, "host": platform.node(),
                  "devices": [torch.cuda.get_device_name(0 if shared_gpu else i) for i in range(world)],
                  "torch": torch.__version__,
                  "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "config": config_file,
                  "allreduces_per_round": round_allreduces(config),
                  "results": [dict(r, per_rank_median_us=[e[i].get("median_us") for e in every],
                                   verified_all_ranks=all(e[i].get("verified", False) for e in every))
                              for i, r in enumerate(mine)]}
        print_report(report)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(report, indent=1) + "\n")
    dist.barrier()
    peers.release()
    dist.barrier()
    dist.destroy_process_group()


def run(ranks: int, rows: tuple[int, ...], hidden: int, repeats: int, out: str | None,
        config_file: str | Path = FULL_CONFIG, shared_gpu: bool = False) -> None:
    from ..fast.parallel import free_port

    if not shared_gpu and torch.cuda.device_count() < ranks:
        raise RuntimeError(f"iquest bench allreduce needs {ranks} CUDA devices, found {torch.cuda.device_count()} "
                           "(--share-gpu: every rank on GPU 0 under an MPS daemon, an emulation)")
    os.environ.update(MULTICAST_OFF)  # inherited by the spawned ranks
    command = shlex.join(["iquest", *sys.argv[1:]])
    torch.multiprocessing.spawn(_worker, args=(ranks, free_port(), list(rows), hidden, repeats, out, command,
                                               str(config_file), shared_gpu), nprocs=ranks, join=True)


def print_report(r: dict) -> None:
    print(f"bench allreduce  ranks={r['ranks']} hidden={r['hidden']} commit={r['commit']} device={r['devices'][0]} "
          f"torch={r['torch']} nccl={r['nccl']} multicast off ({', '.join(f'{k}={v}' for k, v in r['env'].items())})")
    print(f"timing: CUDA graph of {r['calls_per_graph']} calls, replay time / calls, median of {r['repeats']} "
          "replays (rank 0's CUDA events; replays start after a barrier)")
    if r.get("emulation"):
        print("note: every rank on one GPU under MPS: an emulation (the ranks share one GPU's SMs and memory), "
              "not a latency figure")
    print(f"{'rows':>4} {'variant':10} {'verified':>8} {'median us':>10} {'per-rank medians (us)':>24}")
    for x in r["results"]:
        if "error" in x:
            print(f"{x['rows']:4} {x['variant']:10} error: {x['error'].splitlines()[0][:100]}")
            continue
        ranks = " ".join(f"{m:.1f}" if m is not None else "-" for m in x["per_rank_median_us"])
        print(f"{x['rows']:4} {x['variant']:10} {str(x['verified_all_ranks']):>8} {x['median_us']:10.1f} {ranks:>24}")
    n = r["allreduces_per_round"]
    for rows in r["rows"]:
        cells = [f"{x['variant']} {x['median_us'] * n:.0f} us" for x in r["results"]
                 if x["rows"] == rows and "median_us" in x]
        print(f"per-round collective estimate, rows={rows} ({n} all-reduces = 2 x layers + 1 embed + {DRAFTS} draft passes x 4; "
              f"per-call microbenchmark median x {n}, an estimate): {', '.join(cells) or '-'}")

"""Several tensor-parallel ranks on one GPU (GPU_FACTS.md, "Several ranks on one GPU"), for the GPU tests of the peer
collectives: `run(scenario, world, env, **kw)` starts `world` rank processes with every rank on cuda:0 (under the MPS
daemon whose environment `env` names, so that their kernels run side by side), runs `scenario` in each and returns
every rank's result, gathered on rank 0. Run as a script by `run`, never imported by pytest as a test module.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

SCENARIOS: dict = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def run(name: str, world: int, env: dict, timeout: float = 420, **kw) -> list:
    from iquest.fast.parallel import free_port

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        done = subprocess.run([sys.executable, "-m", "iquest.tests.tp_ranks", name, str(world), str(free_port()),
                               json.dumps(kw), out], env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{name} at {world} ranks failed (rc {done.returncode}):\n{done.stderr[-6000:]}")
        print(done.stdout[-3000:])
        return json.load(open(out))


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---- scenarios (each runs in every rank; the return value is gathered) ------------------------------------------
def _collectives(par, hidden: int, candidates: int = 32, dtype=torch.bfloat16):
    from iquest.fast.collectives import PeerCollectives

    return PeerCollectives(par.group, par.rank, par.world, hidden, candidates, dtype, par.device)


def _exact(par, rows: int, hidden: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's integer-valued partial, the exact sum over ranks): small integers, exact in bf16 and fp32."""
    g = torch.Generator(device="cpu").manual_seed(1000 * call + 7)
    base = torch.randint(-8, 9, (rows, hidden), generator=g)
    mine = base * (par.rank + 1) + call
    total = base * sum(r + 1 for r in range(par.world)) + call * par.world
    return mine.to(torch.bfloat16).to(par.device), total.to(torch.bfloat16).to(par.device)


@scenario
def kernels(par, hidden: int = 6144) -> dict:
    """Exact sums eager (rows 1..64, the slot sequence through every slot) and inside a CUDA graph replayed several
    times (7 calls a replay: the counter keeps the slots); the all-reduce ending in each of the layer's sandwich tails
    against the all-reduce then the `add_norm` kernel, bit for bit (one definition of the tail, built alike); the
    gather, and gathers of unlike widths with a late peer; every rank's bits of a random reduction; per-call times
    (emulation)."""
    from iquest.kernels.rmsnorm import add_norm

    c, dev = _collectives(par, hidden), par.device
    bad = 0
    for call, rows in enumerate([1, 8, 64, 3, 8, 8, 1, 64, 5, 8] * 5):
        mine, want = _exact(par, rows, hidden, call)
        bad += int((c.all_reduce(mine) != want).sum())
    static = torch.zeros(7, 8, hidden, dtype=torch.bfloat16, device=dev)
    outs = [None] * 7
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for i in range(7):  # warm-up (compiles; advances the counter as a replay does)
            c.all_reduce(static[i])
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(graph):
        for i in range(7):
            outs[i] = c.all_reduce(static[i])
    graph_bad = 0
    for rep in range(6):
        wants = []
        for i in range(7):
            mine, want = _exact(par, 8, hidden, 100 + 7 * rep + i)
            static[i].copy_(mine)
            wants.append(want)
        graph.replay()
        torch.cuda.synchronize(dev)
        graph_bad += sum(int((o != w).sum()) for o, w in zip(outs, wants))
    g = torch.Generator(device=dev).manual_seed(11 + par.rank)
    shared = torch.Generator(device=dev).manual_seed(5)
    partial = (torch.randn(8, hidden, generator=g, device=dev) * 4).to(torch.bfloat16)
    stream = torch.randn(8, hidden, generator=shared, device=dev).to(torch.bfloat16)
    weight = torch.rand(hidden, generator=shared, device=dev).to(torch.bfloat16) + 0.5
    branch_w = torch.rand(hidden, generator=shared, device=dev).to(torch.bfloat16) + 0.5
    # the layer's tails: attention's (branch norm, a scale), the MLP's of layer >= 1 (neither), the draft's (fp32 stream)
    tails = {"attention": (stream, 0.75, branch_w), "mlp": (stream, 1.0, None), "draft": (stream.float(), 1.0, branch_w)}
    fused_equal, outs = {}, []
    for name, (residual, scale, y_norm) in tails.items():
        got = c.all_reduce_add_norm(partial, residual, scale, y_norm, weight, 1e-6, torch.bfloat16)
        total = c.all_reduce(partial)
        want = (total, *add_norm(residual, total, scale, y_norm, weight, 1e-6, torch.bfloat16))
        fused_equal[name] = all(torch.equal(a, b) for a, b in zip(got, want))
        outs.extend(got)
    keys = torch.randint(-2 ** 62, 2 ** 62, (8, 20), generator=g, device=dev)
    gathered = c.all_gather_last(keys)
    # gathers of unlike widths through the slots (a round's sampling keys, then its narrower logprob parts), a peer
    # late before some: each must be every rank's keys in rank order, whatever the slot held before
    mixed_bad = 0
    for call, width in enumerate([32, 3, 20, 3, 3, 32, 20, 3, 32]):
        every = [torch.randint(-2 ** 62, 2 ** 62, (4, width), generator=torch.Generator(device=dev).manual_seed(
            97 * call + p), device=dev) for p in range(par.world)]
        if call % 2 == 0:
            _late(par, 1, cycles=5_000_000)
        mixed_bad += int((c.all_gather_last(every[par.rank]) != torch.cat(every, dim=1)).sum())
    times = {}
    for rows in (1, 8):
        x = partial[:rows].clone()
        st = stream[:rows].clone()
        for name, fn in (("all_reduce", lambda: c.all_reduce(x)),
                         ("all_reduce_add_norm",
                          lambda: c.all_reduce_add_norm(x, st, 1.0, weight, weight, 1e-6, torch.bfloat16))):
            times[f"{name} {rows}x{hidden} eager"] = _eager_us(fn, dev)
            times[f"{name} {rows}x{hidden} graph"] = _graph_us(fn, dev)
    c.check()
    return {"bad": bad, "graph_bad": graph_bad, "mixed_bad": mixed_bad, "fused_equal": fused_equal,
            "keys": keys.cpu().tolist(),
            "gathered": gathered.cpu().tolist(), "digest": digest(*outs), "times_us": times,
            "error": int(c.error)}


def _eager_us(fn, dev, n: int = 60) -> float:
    fn()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize(dev)
    return 1e6 * (time.perf_counter() - t0) / n


def _graph_us(fn, dev, calls: int = 30, replays: int = 10) -> float:
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize(dev)
    return 1e6 * (time.perf_counter() - t0) / (calls * replays)


def _late(par, rank_late: int, cycles: int = 50_000_000) -> None:
    """Rank `rank_late` holds its stream ~tens of ms before the next call, so its data arrives late."""
    if par.rank == rank_late:
        torch.cuda._sleep(cycles)


@scenario
def controls(par, hidden: int = 1024) -> dict:
    """The negative controls, each next to the healthy piece it replaces, on the same late peer: a reader that does
    not wait, a slot never re-armed, a rank that reduces in its own order; last, a rank that never writes (the failure
    exit: the error flag, then one clear error, nothing hangs)."""
    from iquest.fast.collectives import CollectiveError

    from iquest.kernels import allreduce as ar
    from iquest.tests.kernel_controls import BROKEN as broken

    out = {}
    for name in ("healthy", "poll", "rearm"):
        c = _collectives(par, hidden)
        b = c.reduce
        pieces = {} if name == "healthy" else {name: broken[name]}
        bad = 0
        for call in range(7):  # 7 calls: slot 0 is reused at calls 3 and 6, each time with its peer late
            mine, want = _exact(par, 8, hidden, call)
            if call % 3 == 0:
                _late(par, 1)
            got = ar._all_reduce(mine, b.peers, b.own, b.state, c.error, par.rank, 0, 60_000_000_000, None, None,
                                 False, **pieces)
            bad += int((got != want).sum())
        torch.cuda.synchronize(par.device)
        out[name] = bad
        torch.distributed.barrier(group=par.group)
        c.release()
    digests = {}
    for name in ("healthy", "order"):  # fp32 rows of unlike magnitudes: a bf16 result would round the order away
        c = _collectives(par, hidden, dtype=torch.float32)
        b = c.reduce
        g = torch.Generator(device=par.device).manual_seed(3 + par.rank)
        x = torch.randn(8, hidden, generator=g, device=par.device) * 10 ** (par.rank % 4)
        pieces = {} if name == "healthy" else {"order": broken["order"]}
        got = ar._all_reduce(x, b.peers, b.own, b.state, c.error, par.rank, 0, 60_000_000_000, None, None, False,
                             **pieces)
        digests[name] = digest(got)
        torch.distributed.barrier(group=par.group)
        c.release()
    c = _collectives(par, hidden)
    b = c.reduce
    raised = ""
    t0 = time.perf_counter()
    if par.rank != 1:  # rank 1 never writes
        mine, _ = _exact(par, 8, hidden, 0)
        ar._all_reduce(mine, b.peers, b.own, b.state, c.error, par.rank, 0, 300_000_000, None, None, False)
        for _ in range(4):  # the calls after the first timeout give up on its flag, not each after its own 3 s
            ar._all_reduce(mine, b.peers, b.own, b.state, c.error, par.rank, 0, 3_000_000_000, None, None, False)
        torch.cuda.synchronize(par.device)
        try:
            c.check()
        except CollectiveError as e:
            raised = str(e)
    return {"bad": out, "digest": digests, "raised": raised, "exit_s": time.perf_counter() - t0}


@scenario
def engine(par, model: str, prompt: list, seed: int, drafts, tokens: int, dtype: str = "bf16") -> dict:
    """A decode with the TP engine (every rank on this GPU), through the captured loop and eagerly: tokens, logprob
    bits, round records and the last verification's hidden rows of each, to compare ranks and modes."""
    from iquest.fast.rank import EngineOptions, RankEngine, Request
    from iquest.reference.sampling import SamplingParams

    e = RankEngine(model, par, EngineOptions(max_context=512, dtype=dtype, shared_gpu=True))
    p = SamplingParams()
    req = Request(tuple(prompt), seed, p.temperature, p.top_k, p.top_p, tokens, drafts, ())
    runner, graph = e.runner(drafts, p.top_k)
    out = {"graphs": graph is not None}
    for mode, g in (("graph", graph), ("eager", None)):
        e.start(req, runner)
        while not bool(e.state.done):
            e.decode_chunk(runner, g)
            e.par.check()
        st = e.state
        n = int(st.emitted)
        out[mode] = {"tokens": st.log_tokens[:n].tolist(), "logprobs": digest(st.log_logprobs[:n]),
                     "rounds": st.log_rounds[:int(st.rounds)].tolist(), "hidden": digest(st.hid)}
    out["fused_tails"] = e.model.ops.calls["reduce_add_norm"] if hasattr(e.model.ops, "calls") else 0
    e.close()
    return out


def _rank(rank: int, world: int, port: int, name: str, kw: dict, out: str) -> None:
    import torch.distributed as dist

    from iquest.fast.parallel import init_process

    par = init_process(rank, world, port, "cuda", shared_gpu=True)
    result = SCENARIOS[name](par, **kw)
    every: list = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    name, world, port, kw, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
    mp.spawn(_rank, args=(world, port, name, kw, out), nprocs=world)

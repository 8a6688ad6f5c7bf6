"""Tensor parallelism through our own peer-memory collectives (kernels/allreduce.py, fast/collectives.py), tested on
one GPU: 2 and 8 ranks share cuda:0 under an MPS daemon this module starts for its session (its own pipe and log
folders under /tmp; quit afterwards). The ranks' kernels then run side by side, so the figures are emulation, not
NVLink latency; the correctness is the protocol's.

Checked: exact sums eager and through graph replays; the all-reduce ending in each sandwich tail bit for bit against
the all-reduce then the `add_norm` kernel; the gather in rank order; every rank's bits equal; the negative controls (a reader that does not wait, a
slot never re-armed, a rank that reduces in its own order) each caught; a rank that never writes ends in one clear
error, not a hang; the TP engine (mini model and tiny-tp8 at TP 2 and 8) with every rank's tokens and hidden rows
identical, the captured TP loop bit-exact against the eager TP round, and its tokens against TP=1 until the first
explained divergence.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from iquest.tests.helpers import PARAMS, PROMPTS, TOLERANCE, fast_dist, fixture_dir, mini_or_skip

pytestmark = pytest.mark.gpu
MPS_CONTROL = "nvidia-cuda-mps-control"


@pytest.fixture(scope="module")
def mps():
    """An MPS daemon for this module's rank processes: the environment that makes a process its client. Under a
    daemon already running (bash ci/gpu.sh mps ..., which sets the pipe folder) that one is used and left running:
    one GPU serves one daemon, so a second would leave the ranks time-sliced."""
    control = shutil.which(MPS_CONTROL) or f"/usr/local/nvidia/bin/{MPS_CONTROL}"
    if not torch.cuda.is_available() or not os.path.exists(control):
        pytest.skip("needs a GPU and nvidia-cuda-mps-control")
    running = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if running and os.path.isdir(running):
        yield {}
        return
    root = tempfile.mkdtemp(prefix="iquest-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d)
    subprocess.run([control, "-d"], env={**os.environ, **env}, check=True, timeout=30)
    yield env
    subprocess.run([control], input="quit\n", env={**os.environ, **env}, text=True, timeout=30)
    shutil.rmtree(root, ignore_errors=True)


def _run(*args, **kw):
    from iquest.tests.tp_ranks import run

    return run(*args, **kw)


@pytest.mark.parametrize("world", [2, 8])
def test_peer_collectives_are_exact_and_equal_on_every_rank(mps, world):
    ranks = _run("kernels", world, mps)
    for r in ranks:
        assert r["error"] == 0 and r["bad"] == 0 and r["graph_bad"] == 0 and all(r["fused_equal"].values()), r
        assert r["mixed_bad"] == 0, r  # gathers of unlike widths (kernels/allreduce.py's re-arm)
        assert r["gathered"] == [sum((ranks[p]["keys"][row] for p in range(world)), []) for row in range(8)]
    assert len({r["digest"] for r in ranks}) == 1, "ranks computed different bits"
    print(f"[{world} ranks on one GPU, emulation] {ranks[0]['times_us']}")


def test_negative_controls_are_caught_and_a_silent_rank_is_a_clear_error(mps):
    ranks = _run("controls", 8, mps)
    r0 = ranks[0]
    assert r0["bad"]["healthy"] == 0, r0
    assert r0["bad"]["poll"] > 0, "a reader that does not wait read its late peer's lane and nothing failed"
    assert r0["bad"]["rearm"] > 0, "a slot never re-armed gave stale values and nothing failed"
    assert len({r["digest"]["healthy"] for r in ranks}) == 1
    assert len({r["digest"]["order"] for r in ranks}) > 1, "ranks reducing in their own order still agreed"
    for rank, r in enumerate(ranks):
        if rank == 1:
            continue
        assert "rank 1" in r["raised"] and f"rank {rank}:" in r["raised"] and "all_reduce" in r["raised"], r
        assert r["exit_s"] < 10, r  # 0.3 s, then four calls ending on the flag (without it, 3 s each: 12.3 s)


def _single_tokens(model, prompt, seed, drafts, n):
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine, Request

    e = RankEngine(model, Parallel.single("cuda"), EngineOptions(max_context=512, dtype="fp32"))
    req = Request(tuple(prompt), seed, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, n, drafts, ())
    return [t for s in e.decode(req) for t in s.tokens], e


@pytest.mark.parametrize("name,world", [("mini", 2), ("mini", 4), ("tiny-tp8", 8)],
                         ids=["mini-tp2", "mini-tp4", "tiny-tp8"])
def test_tp_engine_on_one_gpu(mps, name, world):
    from iquest.qualify.agreement import compare

    model = mini_or_skip() if name == "mini" else fixture_dir(name)
    prompt, seed, drafts, n = PROMPTS[0], 5, 3, 40
    ranks = _run("engine", world, mps, model=str(model), prompt=prompt, seed=seed, drafts=drafts, tokens=n,
                 dtype="fp32")
    assert all(r["graphs"] for r in ranks), "the TP round was not captured"
    assert all(r["fused_tails"] > 0 for r in ranks), "no all-reduce ended in its sandwich tail (the fused path)"
    for mode in ("graph", "eager"):
        assert len({str(r[mode]) for r in ranks}) == 1, f"ranks disagree ({mode})"
    assert ranks[0]["graph"] == ranks[0]["eager"], "the captured TP loop is not bit-exact against the eager TP round"
    one, single = _single_tokens(model, prompt, seed, drafts, n)
    many = ranks[0]["graph"]["tokens"]
    result = compare(prompt, many, one, fast_dist(single), fast_dist(single), TOLERANCE["fp32"])
    print(f"[tp={world} on one GPU vs tp=1, {model.name}] {result}")
    assert result.explained, str(result)

"""Starting the tensor-parallel ranks: a worker that fails before the rendezvous is reported at once (rank 0 used to
wait in the rendezvous for a rank that had already exited), and the memory check of ranks sharing one GPU asks GPU
0 for all of them (it asked GPU `rank`, which does not exist on a one-GPU machine: the worker failed before joining)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import pytest
import torch

from iquest.fast import memory
from iquest.fast.engine import FastEngine, _await_workers
from iquest.fast.rank import EngineOptions, EngineParts
from iquest.reference.config import Config, ConfigError
from iquest.fast.cache import RingSnapshot, StaticKV
from iquest.tests.helpers import ROOT, TINY, FailingLoader, rank_engine


@dataclass
class _Proc:
    exitcode: int | None = None


def test_await_workers_collects_every_rank():
    q = queue.Queue()
    for r in (1, 2, 3):
        q.put(("joining", r))
    _await_workers(q, [_Proc(), _Proc(), _Proc()], "joining", timeout_s=5)
    assert q.empty()


@pytest.mark.parametrize("status, raised", [("config", ConfigError), ("error", RuntimeError)])
def test_await_workers_raises_a_workers_failure(status, raised):
    q = queue.Queue()
    q.put(("joining", 1))
    q.put((status, "GPU 1 does not exist"))
    with pytest.raises(raised, match="GPU 1 does not exist"):
        _await_workers(q, [_Proc(), _Proc()], "joining", timeout_s=5)


def test_await_workers_sees_a_silent_exit_and_a_timeout():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 exited \\(code -9\\)"):
        _await_workers(queue.Queue(), [_Proc(), _Proc(-9)], "joining", timeout_s=60)
    with pytest.raises(RuntimeError, match="did not report 'ok' within 1 s"):
        _await_workers(queue.Queue(), [_Proc()], "ok", timeout_s=1)
    assert time.monotonic() - t0 < 10


def test_a_worker_failing_at_start_fails_load_with_its_reason():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not read its shard"):
        FastEngine.load(TINY, tp=2, device="cpu", parts=EngineParts(loader=FailingLoader))
    assert time.monotonic() - t0 < 120
    assert not torch.distributed.is_initialized()  # rank 0 had joined: the failed start ended its group


def test_shared_gpu_memory_check_asks_gpu0_for_every_rank(monkeypatch):
    config = Config.from_dir(TINY)
    options = EngineOptions(max_context=512, dtype="bf16", shared_gpu=True)
    need = memory.rank_bytes(config, 2, 512, 2, prefix_reuse=True) * memory.HEADROOM
    asked = []

    def free_of(gpu):
        asked.append(gpu)
        return free, 0

    monkeypatch.setattr(torch.cuda, "mem_get_info", free_of)
    free = int(need * 2) + 1
    for rank in (0, 1):
        memory.check_memory(config, 2, options, "cuda", ranks=(rank,))
    assert asked == [0]  # rank 1 skips: rank 0 checked the one GPU for both
    free = int(need * 1.5)  # room for one rank's share, not two
    with pytest.raises(ConfigError, match="2 ranks sharing GPU 0 need"):
        memory.check_memory(config, 2, options, "cuda", ranks=(0,))
    asked.clear()
    memory.check_memory(config, 2, EngineOptions(max_context=512, dtype="bf16"), "cuda", ranks=(1,))
    assert asked == [1]


def test_the_prefix_reuse_copy_is_counted_as_the_engine_makes_it():
    """fast/memory counts the rings' copy that prefix reuse keeps (issue 51): as many bytes as an engine's own, and as
    a copy of the rings of caches sized as the engine sizes them, at the published size too."""
    config = Config.from_dir(TINY)
    engine = rank_engine(TINY)  # fp32, --max-context 512: the tiny rings (96 and 80 slots) are smaller
    assert memory.prefix_snapshot_bytes(config, 1, 512, 4) == engine.snapshot_bytes > 0
    full = Config.from_file(ROOT / "configs" / "iquest-q1.json", ROOT / "configs" / "iquest-q1-mtp.json")
    for tp, context, want_mb in ((8, 8192, 137), (1, 131072, 1078), (8, 4096, 0)):
        kv = StaticKV(full, full.num_key_value_heads // tp, context + 16, torch.bfloat16, torch.device("meta"))
        got = memory.prefix_snapshot_bytes(full, tp, context)
        assert got == RingSnapshot.bytes_for(kv, kv.rings())
        # 63 sliding layers' rings of 4,160 slots; at a 4,096-token context only the draft's window (512) is one
        assert round(got / 1e6) == want_mb, (tp, context, got)
        assert memory.rank_bytes(full, tp, context, prefix_reuse=True) - memory.rank_bytes(full, tp, context) == got


def test_the_memory_check_counts_the_copy_where_prefix_reuse_is_on(monkeypatch):
    """The copy counts where the engine's options keep it (iquest serve --prefix-reuse on, its default), not for
    iquest generate or a server with reuse off."""
    config = Config.from_dir(TINY)
    plain = memory.rank_bytes(config, 1, 512, 2) * memory.HEADROOM
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda gpu: (int(plain) + 1, 0))
    with pytest.raises(ConfigError, match="prefix-reuse copy of the rings"):
        memory.check_memory(config, 1, EngineOptions(max_context=512, dtype="bf16", prefix_reuse=True), "cuda")
    memory.check_memory(config, 1, EngineOptions(max_context=512, dtype="bf16"), "cuda")
    memory.check_memory(config, 1, EngineOptions(max_context=512, dtype="bf16", prefix_reuse=True), "cuda",
                        prefix_reuse=False)


def test_the_server_builds_its_engine_with_its_prefix_reuse(monkeypatch, tmp_path):
    """iquest serve passes --prefix-reuse to the engine it loads, so the memory check counts the copy it will make."""
    from iquest.cli import engines, serve_cmd

    seen = []

    def load(*args, **kwargs):
        seen.append(kwargs.get("prefix_reuse"))
        raise SystemExit(0)  # stop before serving

    monkeypatch.setattr(engines, "load_engine", load)
    for flag, want in (("on", True), ("off", False)):
        with pytest.raises(SystemExit):
            from iquest.cli.main import main
            main(["serve", "--model", str(TINY), "--device", "cpu", "--prefix-reuse", flag])
        assert seen[-1] is want


def test_a_closed_engine_collected_later_leaves_the_next_engines_group():
    """qualify runs engine after engine in one process: the first one's __del__, when the garbage collector got to it
    after the next had started, ended the next one's process group ("Group ... is not registered")."""
    prompt = [3, 4, 5, 6]
    first = FastEngine.load(TINY, tp=2, device="cpu")
    want = [t for s in first.generate(prompt, seed=1, max_new_tokens=4, drafts=3) for t in s.tokens]
    first.close()
    second = FastEngine.load(TINY, tp=2, device="cpu")
    try:
        first.__del__()  # as the collector would
        assert torch.distributed.is_initialized()
        got = [t for s in second.generate(prompt, seed=1, max_new_tokens=4, drafts=3) for t in s.tokens]
        assert got == want
    finally:
        second.close()
    assert not torch.distributed.is_initialized()

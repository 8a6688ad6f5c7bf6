"""The fast engine as the CLI and server see it: `FastEngine.load(model_dir, tp=N).generate(...)`.

Rank 0 runs in the calling process; ranks 1..N-1 are worker processes (one per GPU on CUDA, gloo on
CPU) that receive each request over a queue and run the same decode in lockstep.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..reference.checkpoint import CheckpointReader
from ..reference.config import Config, ConfigError, GenerationConfig
from ..reference.sampling import SamplingParams
from ..reference.speculative import Step
from .depth_policy import DepthPolicy, depth_policy
from .memory import check_memory
from .parallel import free_port, init_process
from .plan import GROUPS, KernelPlan
from .rank import EngineOptions, EngineParts, RankEngine, Request


def _device_kind(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _worker(rank: int, world: int, port: int, kind: str, model_dir: str, options: EngineOptions, parts: EngineParts,
            requests: "mp.Queue", ready: "mp.Queue") -> None:
    from .stacks import dump_stacks_on_signal

    dump_stacks_on_signal()  # kill -USR1 PID (qualify's stall watch too): where this rank waits
    try:
        torch.set_num_threads(1)
        check_memory(Config.from_dir(model_dir), world, options, kind, ranks=(rank,))
        ready.put(("joining", rank))  # rank 0 joins the process group only once every worker got this far
        engine = RankEngine(model_dir, init_process(rank, world, port, kind, options.shared_gpu), options, parts)
        ready.put(("ok", rank))
    except ConfigError as e:  # a clear one-line reason (e.g. this GPU's memory), raised as such by rank 0
        ready.put(("config", str(e)))
        return
    except BaseException:  # report instead of leaving rank 0 waiting for this rank
        ready.put(("error", traceback.format_exc()))
        return
    while (req := requests.get()) is not None:
        for _ in engine.decode(req):
            pass
    engine.close()


def _await_workers(ready: "mp.Queue", procs: list, status: str, timeout_s: float = 600.0) -> None:
    """Wait until every worker has reported `status`; raise at once when one reports a failure or exits without a
    word (killed), and after `timeout_s` without progress."""
    import queue
    import time

    left, deadline = len(procs), time.monotonic() + timeout_s
    while left:
        try:
            got, info = ready.get(timeout=1.0)
        except queue.Empty:
            dead = [i + 1 for i, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"tensor-parallel worker rank {dead[0]} exited (code {procs[dead[0] - 1].exitcode})"
                                   f" before it reported {status!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{left} tensor-parallel worker(s) did not report {status!r} within {timeout_s:.0f} s")
            continue
        if got == "config":
            raise ConfigError(info)
        if got == "error":
            raise RuntimeError(f"a tensor-parallel worker failed to start:\n{info}")
        left -= got == status
        deadline = time.monotonic() + timeout_s


def kernel_summary(plan: KernelPlan) -> str:
    """What ran as which form, in words: "torch" (every op its torch form), or the groups running Triton kernels, then
    those the plan left on their torch forms, e.g. "triton for linear, sampling; torch forms for attention, norm, moe,
    lm_head, glue (off in this plan)"."""
    if not plan.uses_triton:
        return "torch"
    on = [g for g in GROUPS if getattr(plan, g)]
    off = list(plan.torch_groups)
    return f"triton for {', '.join(on)}" + (f"; torch forms for {', '.join(off)} (off in this plan)" if off else "")


def _rank_processes(kind: str):
    """Where ranks 1..tp-1 come from. CUDA needs a fresh interpreter a rank (spawn). CPU ranks fork from a server that
    imported this module once, so a rank starts without importing torch again (~2 s of a core each; forkserver, where
    the platform has it)."""
    if kind != "cpu" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class FastEngine:
    def __init__(self, rank0: RankEngine, procs: list, queues: list):
        self.rank0, self.procs, self.queues = rank0, procs, queues
        self.closed = False
        self.config: Config = rank0.config
        self.generation: GenerationConfig = rank0.generation

    @classmethod
    def load(cls, model_dir: str | Path, tp: int = 1, device: str = "auto",
             options: EngineOptions = EngineOptions(), parts: EngineParts = EngineParts()) -> "FastEngine":
        model_dir = Path(model_dir)
        config = Config.from_dir(model_dir)
        config.check_tp(tp)  # before any device work
        kind = _device_kind(device)
        if kind == "cuda" and not options.shared_gpu and torch.cuda.device_count() < tp:
            raise ConfigError(f"--tp {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()} (--share-gpu "
                              "runs every rank on GPU 0, for testing, under an MPS daemon)")
        if options.max_context > config.max_position_embeddings:
            options = replace(options, max_context=config.max_position_embeddings)
        CheckpointReader(model_dir, config)  # names, shapes, dtypes from the headers: fail before any device work
        check_memory(config, tp, options, kind, ranks=(0,))  # each worker checks its own GPU
        port = free_port()
        ctx = _rank_processes(kind)
        ready = ctx.Queue()
        procs, queues = [], []
        for rank in range(1, tp):
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(rank, tp, port, kind, str(model_dir), options, parts, q, ready),
                            daemon=True)
            p.start()
            procs.append(p)
            queues.append(q)
        joined = False
        try:
            _await_workers(ready, procs, "joining")  # a worker that fails first would leave rank 0 in the rendezvous
            par = init_process(0, tp, port, kind, options.shared_gpu)
            joined = par.group is not None
            rank0 = RankEngine(model_dir, par, options, parts)
            _await_workers(ready, procs, "ok")
        except BaseException:
            for p in procs:
                p.kill()
            if joined:  # a failed start leaves no process group behind: the next load in this process starts clean
                torch.distributed.destroy_process_group()
            raise
        return cls(rank0, procs, queues)

    @property
    def kernels(self) -> str:
        """What the ranks run: "torch", "triton" or a debugging plan's groups (fast/plan.py)."""
        return self.rank0.plan.name

    @property
    def plan(self) -> KernelPlan:
        return self.rank0.plan

    @property
    def weights(self) -> str:
        """What the linear weights run as: "fp8" or "bf16" (fast/weights.weight_format)."""
        return self.rank0.model.w.format

    @property
    def quantized_at_load(self) -> bool:
        """A BF16 checkpoint running as FP8: its linears were quantized to E4M3 blocks when they loaded."""
        return self.weights == "fp8" and not self.config.quantized

    def describe(self) -> dict:
        """What runs, for summaries: device, TP, compute dtype, weight format and the kernel plan in words."""
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.rank0.dtype, str(self.rank0.dtype))
        weights = self.weights + (" (quantized at load from bf16)" if self.quantized_at_load else "")
        kernels = kernel_summary(self.plan)
        fold = self.rank0.options.router_fold
        routing = ("; routing folded into o_proj and the attention tail" + (" (not across ranks: off at this tp)"
                                                                              if self.tp > 1 else "")) if fold else ""
        prefetch = self.rank0.options.expert_prefetch
        warming = "; sliding layers' predicted experts warmed in L2 (expert prefetch)" if prefetch else ""
        return {"device": self.device.type, "tp": self.tp, "dtype": dtype, "weights": weights,
                "weights_quantized_at_load": self.quantized_at_load, "kernels": kernels,
                "kernel_groups": {"triton": [g for g in GROUPS if getattr(self.plan, g)],
                                  "torch": list(self.plan.torch_groups)},
                "router_fold": fold and self.tp == 1, "expert_prefetch": prefetch,
                "text": f"fast on {self.device.type}, tp {self.tp}, {dtype} activations, weights {weights}; "
                        f"kernels: {kernels}{routing}{warming}"}

    @property
    def device(self) -> torch.device:
        return self.rank0.par.device

    @property
    def tp(self) -> int:
        return self.rank0.par.world

    def policy(self, drafts: int | str) -> DepthPolicy:
        """What a user's `--drafts` (auto, 0, 3..7) runs on this engine's device (fast/depth_policy.py)."""
        return depth_policy(drafts, self.rank0.model_dir, self.device.type)

    def warm_up(self, prompt: Sequence[int], drafts: int | str, params: SamplingParams = SamplingParams()) -> None:
        """Compile the Triton kernels and capture the decode loop for this request's shapes, off the decode clock: a
        two-token decode of the same prompt (the torch fallback has nothing to compile, so it returns at once)."""
        if self.kernels == "torch":
            return
        for _ in self.generate(prompt, seed=0, params=params, max_new_tokens=2, drafts=drafts):
            pass

    supports_top_logprobs = True  # generate(top_logprobs=N): each token's N most likely alternatives (N <= 20)
    supports_prefix_reuse = True  # generate(prefix_reuse=True), cached_prefix(): the server's --prefix-reuse

    def cached_prefix(self, prompt: Sequence[int], drafts: int | str) -> int:
        """Prompt tokens whose KV the next `generate(prompt, drafts=drafts, prefix_reuse=True)` takes from the last
        request that kept its prefix (0: it prefills the whole prompt). Every rank decides alike from the same record;
        rank 0's answer travels with the request all the same, and the others check it."""
        return self.rank0.reusable(prompt, bool(drafts))

    @property
    def prefix_snapshot_bytes(self) -> int:
        """Device bytes one rank holds for prefix reuse: its ring caches' copy (made at the first kept prefix)."""
        return self.rank0.snapshot_bytes

    def generate(self, prompt: Sequence[int], *, seed: int, params: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 64, drafts: int | str = "auto", stop_ids: Sequence[int] = (),
                 top_logprobs: int = 0, prefix_reuse: bool = False) -> Iterator[Step]:
        """`prefix_reuse`: prefill only past the prefix this prompt shares with the last prompt (`cached_prefix`), and
        keep this prompt's for the next request; the tokens and logprobs are those of a full prefill, bit for bit."""
        if len(prompt) + max_new_tokens > self.rank0.options.max_context:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceed the engine's "
                             f"context of {self.rank0.options.max_context} (--max-context)")
        reuse = self.cached_prefix(prompt, drafts) if prefix_reuse else 0
        req = Request(tuple(prompt), seed, params.temperature, params.top_k, params.top_p, max_new_tokens,
                      drafts, tuple(stop_ids), top_logprobs, reuse=reuse, keep_prefix=prefix_reuse)
        for q in self.queues:
            q.put(req)
        return self.rank0.decode(req)

    def close(self) -> None:
        """Stop the workers and end the process group, once: a closed engine collected later (`__del__`) must not end
        the group of an engine started since."""
        if getattr(self, "closed", True):
            return
        self.closed = True
        for q in self.queues:
            q.put(None)
        if self.procs:
            self.rank0.close()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.procs, self.queues = [], []
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

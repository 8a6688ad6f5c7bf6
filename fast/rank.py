"""One rank of the fast engine: its weights, static caches and device state, prefill and the decode loop.

Every rank of a tensor-parallel group runs this same code on the same request; collectives inside the
model keep them in lockstep, and identical candidates and uniforms give identical tokens everywhere.
The host reads the device's result log once per `TOKENS_PER_READ` emitted tokens (streaming and
cancellation) and at the end; between reads the decode loop runs on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from ..reference.config import Config, GenerationConfig
from ..reference.depth import FixedDepth, load_controller
from ..reference.rng import PURPOSE_COMMIT, int64_bits
from ..reference.speculative import Step
from . import sampler
from .cache import RingSnapshot, StaticKV
from .collectives import CollectiveError
from .flow import EagerFlow
from .graphs import capture_decode_loop
from .model import FastModel
from .parallel import Parallel
from .plan import KernelPlan
from .round import RoundRunner
from .state import MAX_STOP_IDS, MAX_TOP_LOGPROBS, TOKENS_PER_READ, VERIFY_ROWS, DecodeState
from .torch_ops import TorchOps
from .weights import ModelWeights, WeightLoader, load_weights

# (op, field, value): one kernel launch setting replaced (EngineOptions.kernel_settings, fast/kernel_settings.py)
KernelSetting = tuple[str, str, int | str | bool]
PREFILL_BLOCK = 64  # rows per prefill block: no more than the ring's spare slots (see cache.py)
MAX_CANDIDATES = 256  # sampling candidates a rank contributes to the all-gather at most


@dataclass(frozen=True)
class EngineOptions:
    max_context: int = 4096
    dtype: str = "auto"             # auto = bf16 on CUDA, fp32 on CPU
    graphs: bool = True             # capture CUDA graphs (ignored on CPU)
    shared_gpu: bool = False        # TP > 1 with every rank on GPU 0 (testing on one GPU, under an MPS daemon)
    kernels: str | KernelPlan = "auto"  # auto = Triton on CUDA, the torch forms on CPU; or torch, triton, a plan
    weights: str = "auto"           # what the linears run as (fast/weights.weight_format): auto, bf16 or fp8
    prefix_reuse: bool = False      # the server keeps its rings' copy for the next turn (counted by fast/memory.py)
    router_fold: bool = False       # routing in o_proj and the attention tail: a numerical change (docs/round.md)
    expert_prefetch: bool = False   # predicted experts warmed in L2 beside sliding layers' attention (docs/round.md)
    # the router's select asks L2 for its chosen experts' Gate and Up slabs (a hint: the same bits); off, as it made
    # the select slower than the Gate/Up it feeds gained (docs/PERF.md, "The routed prefetch, measured")
    routed_prefetch: bool = False
    # the MoE's Down ending in the combine and the sandwich tail, one launch (kernels/moe.py `down_add_norm`; the same
    # bits); off, as Down then the combine inside the tail measured faster (docs/PERF.md, current state)
    down_tail: bool = False
    # (op, field, value) triples replacing the kernels' launch settings (fast/kernel_settings.py), the product's: a
    # bench variant's (`triton@moe.gate_up_split=1`) or qualify's (--kernel-setting), so that a numerical form is
    # qualified, and any setting timed in the round, before it becomes a default
    kernel_settings: tuple[KernelSetting, ...] = ()

    def plan(self, device: torch.device) -> KernelPlan:
        """The kernel plan for this device (on CPU, Triton kernels run only under Triton's interpreter)."""
        return self.kernels if isinstance(self.kernels, KernelPlan) else KernelPlan.choose(self.kernels, device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]


@dataclass(frozen=True)
class EngineParts:
    """The pieces an engine is built from. The product's are these; a negative control of qualify/ substitutes a
    broken subclass of one of them, so that no product file carries a branch for it."""

    loader: type[WeightLoader] = WeightLoader
    cache: type[StaticKV] = StaticKV
    model: type[FastModel] = FastModel
    runner: type[RoundRunner] = RoundRunner
    snapshot: type[RingSnapshot] = RingSnapshot


def kernel_setting(text: str) -> KernelSetting:
    """"moe.gate_up_split=4" -> ("moe", "gate_up_split", 4), an EngineOptions.kernel_settings triple: an int,
    True/False, None (a field's "the kernel's own choice", as moe.down_registers=None), or else the text (make_ops
    refuses an unknown op or field)."""
    target, eq, value = text.partition("=")
    op, dot, field = target.partition(".")
    if not (op and dot and field and eq and value):
        raise ValueError(f"a kernel setting is OP.FIELD=VALUE (moe.gate_up_split=4), got {text!r}")
    if value.isdigit():
        return op, field, int(value)
    return op, field, {"True": True, "False": False, "None": None}.get(value, value)


def kernel_settings_of(plan: KernelPlan, triples: tuple[KernelSetting, ...]):
    """fast/kernel_settings.KernelSettings with `triples` (EngineOptions.kernel_settings) replacing their defaults, or
    None for a plan without kernels; ValueError for an unknown op or field, or an op whose kernels the plan lacks."""
    if not plan.uses_triton:
        if triples:
            raise ValueError(f"kernel settings {list(triples)} need kernels: the plan runs the torch forms")
        return None
    from .kernel_settings import build  # imports triton

    return build(plan, triples)


def make_ops(plan: KernelPlan, options: EngineOptions) -> TorchOps:
    """The torch forms, or the Triton dispatcher for a plan with kernels (imported only then: it imports triton)."""
    settings = kernel_settings_of(plan, options.kernel_settings)
    if settings is None:
        return TorchOps(options.router_fold, options.expert_prefetch)
    from .triton_ops import TritonOps

    return TritonOps(plan, options.router_fold, options.expert_prefetch, settings, options.routed_prefetch,
                     options.down_tail)


def cache_capacity(options: EngineOptions) -> int:
    """Positions the caches hold: drafts and padding rows run past the request's budget."""
    return options.max_context + 2 * VERIFY_ROWS


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    seed: int
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    drafts: int | str
    stop_ids: tuple[int, ...]
    top_logprobs: int = 0  # each emitted token's most likely alternatives, logged (at most MAX_TOP_LOGPROBS)
    reuse: int = 0          # positions [0, reuse) taken from the last request's prefill (RankEngine.reusable)
    keep_prefix: bool = False  # keep what this prefill leaves for the next request to reuse


@dataclass
class Prefix:
    """What a request's prefill left for the next request: its prompt, the cache epoch its KV belongs to, and whether
    the draft's KV over the prompt was made and its ring copied (not for plain decoding, nor when the first token
    ended the request)."""

    prompt: np.ndarray
    epoch: int
    drafted: bool = False


class RankEngine:
    def __init__(self, model_dir: str | Path, par: Parallel, options: EngineOptions,
                 parts: EngineParts = EngineParts()):
        model_dir = Path(model_dir)
        config = Config.from_dir(model_dir)
        config.check_tp(par.world)
        generation = GenerationConfig.from_dir(model_dir, config)
        weights = load_weights(model_dir, config, par, options.torch_dtype(par.device), loader=parts.loader,
                               fmt=options.weights)
        self._build(model_dir, config, generation, weights, par, options, parts)

    @classmethod
    def from_weights(cls, config: Config, weights: ModelWeights, generation: GenerationConfig, par: Parallel,
                     options: EngineOptions, parts: EngineParts = EngineParts()) -> "RankEngine":
        """An engine over weights already in memory (e.g. fast/synthetic.py), without a checkpoint folder.
        Nothing is captured at construction, and the "auto" depth controller is unavailable (no model folder)."""
        config.check_tp(par.world)
        engine = cls.__new__(cls)
        engine._build(None, config, generation, weights, par, options, parts)
        return engine

    def _build(self, model_dir: Path | None, config: Config, generation: GenerationConfig, weights: ModelWeights,
               par: Parallel, options: EngineOptions, parts: EngineParts) -> None:
        # On GPUs the ranks' collectives are our peer-memory kernels (fast/collectives.py), made here, collectively
        self.dtype = options.torch_dtype(par.device)
        candidates = min(MAX_CANDIDATES, config.vocab_size // par.world)
        par = par.with_peers(config.hidden_size, candidates, self.dtype)
        self.model_dir, self.par, self.options, self.parts = model_dir, par, options, parts
        self.config, self.generation = config, generation
        c = self.config
        kv_heads = max(c.num_key_value_heads // par.world, 1)
        self.capacity = cache_capacity(options)
        self.plan = options.plan(par.device)
        self.cache = parts.cache(c, kv_heads, self.capacity, self.dtype, par.device)
        ops = make_ops(self.plan, options)
        self.model = parts.model(c, weights, self.cache, par, self.dtype, ops)
        self.state = self._allocate_state(min(self.generation.top_k, c.vocab_size))
        rings = self.cache.rings()
        self._target_rings = [i for i in rings if i < c.num_hidden_layers]
        self._draft_rings = [i for i in rings if i == c.num_hidden_layers]
        self.prefix: Prefix | None = None
        self._snapshot: RingSnapshot | None = None  # made at the first request that keeps its prefix
        self._runners: dict[tuple, tuple[RoundRunner, object]] = {}
        if self._use_graphs() and model_dir is not None:  # capture (and upload) the default decode loop now
            self.runner("auto", self.generation.top_k)

    # ---- runners and their graphs ------------------------------------------------------------------
    def runner(self, drafts: int | str, top_k: int, top_logprobs: int = 0) -> tuple[RoundRunner, object]:
        """The round runner (and, on CUDA, the captured decode-loop graph) for this controller, top_k and number of
        logged alternatives."""
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")
        key = (drafts, top_k, top_logprobs)
        if key not in self._runners:
            if drafts == "auto" and self.model_dir is None:
                raise ValueError("drafts='auto' needs the model folder's depth controller; use a fixed depth")
            controller = load_controller(self.model_dir) if drafts == "auto" else FixedDepth(int(drafts)) if drafts else None
            width = min(top_k, self.config.vocab_size)  # a distribution never has more entries than the vocabulary
            if width != self.state.q_ids.shape[1]:
                self.state = self._allocate_state(width)
                self._runners.clear()
            if top_logprobs:
                self.state.hold_alternatives()
            runner = self.parts.runner(self.model, self.state, top_k, controller, EagerFlow(), top_logprobs)
            graph = capture_decode_loop(self.state, runner, self.par.device) if self._use_graphs() else None
            self._runners[key] = (runner, graph)
        return self._runners[key]

    def _allocate_state(self, width: int) -> DecodeState:
        state = DecodeState.allocate(self.capacity, self.options.max_context, self.config.hidden_size, width,
                                     self.dtype, self.par.device)
        if self.par.peers is not None:  # a collective that gives up ends the decode loop
            state.halt = self.par.peers.error
        return state

    def _use_graphs(self) -> bool:
        # Torch's collectives (NCCL) cannot live inside conditional-node bodies; the peer kernels can.
        return self.options.graphs and self.par.device.type == "cuda" and self.par.capturable

    # ---- a request ------------------------------------------------------------------------------
    @torch.no_grad()
    def start(self, req: Request, runner: RoundRunner, history: int = 0) -> None:
        """Prefill the prompt, draw the first token, draft the first round (eager: not on the decode clock).

        `history` > 0 (benchmarks at long context): the caches already hold positions [0, history) of every layer, the
        draft's included (bench/history.py fills them), so prefill starts at `history`. `req.reuse` > 0: positions
        [0, req.reuse) come from the last request's prefill (`reusable`), its ring copies restored first."""
        st, m, dev = self.state, len(req.prompt), self.par.device
        speculative = runner.controller is not None
        begin = history or req.reuse
        if not 0 <= begin < m:
            raise ValueError(f"history {begin} must lie in [0, prompt length {m})")
        if req.reuse:
            if history:
                raise ValueError("a request that reuses a prefix takes no history")
            # every rank holds the same prefix: a rank that would reuse otherwise has diverged from rank 0 (whose own
            # answer is req.reuse)
            if self.par.rank and self.reusable(req.prompt, speculative) != req.reuse:
                raise RuntimeError(f"rank {self.par.rank} cannot reuse {req.reuse} prompt positions")
            self._snapshot.restore(self.cache, self._target_rings + (self._draft_rings if speculative else []))
        self.prefix = None  # the caches change from here on: only this prefill's own record may stand after it
        keep = req.keep_prefix and not history
        st.clear()
        if not begin:
            self.cache.reset()
        st.seed.fill_(int64_bits(req.seed))
        st.temperature.fill_(req.temperature)
        st.top_p.fill_(req.top_p)
        st.budget.fill_(req.max_new_tokens)
        stops = list(req.stop_ids)[:MAX_STOP_IDS]
        st.stop_ids[: len(stops)] = torch.tensor(stops, dtype=torch.int64, device=dev)
        st.tokens[:m] = torch.tensor(req.prompt, dtype=torch.int64, device=dev)
        hiddens = []
        for s in range(begin, m, PREFILL_BLOCK):
            pos = torch.arange(s, min(s + PREFILL_BLOCK, m), device=dev)
            logits, h = self.model.forward(st.tokens[pos], pos, torch.ones_like(pos, dtype=torch.bool))
            hiddens.append(h)
        hidden = torch.cat(hiddens)  # main hiddens of positions begin..m-1
        if keep:
            self._keep_target(req.prompt)
        ids, probs = runner.dist(logits[-1:])
        first = sampler.draw(ids, probs, runner.uniform(torch.tensor([m], device=dev), PURPOSE_COMMIT))
        st.n.fill_(m - 1)
        row = torch.zeros(VERIFY_ROWS, dtype=torch.int64, device=dev)
        row[0] = first[0]
        logprob = runner.logprobs(logits[-1:], first).expand(VERIFY_ROWS)
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        runner.settle(row, zero + 1, row, zero + 1, logprob, zero, zero)
        if runner.controller is None or bool(st.done):
            return
        # Depth 0 over the whole prompt: the row at p reads the target's hidden at p and the token at p + 1 (the last
        # row, at m - 1, the first output token).
        for s in range(begin, m, PREFILL_BLOCK):
            e = min(s + PREFILL_BLOCK, m)
            pos = torch.arange(s, e, device=dev)
            live = torch.ones_like(pos, dtype=torch.bool)
            rows = hidden[s - begin:e - begin]
            if e < m:
                self.model.draft(st.tokens[pos + 1], rows, pos, live)
            else:
                if keep:  # the deeper draft rows that follow write the ring at m.., evicting what a reuse reads
                    self._keep_draft()
                runner.draft(st.tokens[pos + 1], rows, pos, live, last=torch.tensor(e - s - 1, device=dev))

    # ---- prefix reuse (issue 51) ------------------------------------------------------------------
    # A cold prefill runs blocks of PREFILL_BLOCK rows from position 0, and a row's KV depends on its block's shape:
    # only KV that an earlier prefill made in a whole block of the same grid, over the same tokens, equals a cold
    # prefill's bit for bit (decode's blocks of 1-8 rows round differently). So a reuse takes positions [0, P) with P
    # a multiple of the block that is below the shared prefix: P <= common - 1, since the draft row at P - 1 read the
    # token at P; rows from P on read only hiddens this prefill computes. Full layers still hold those positions
    # (decode writes only past the prompt, and KV left past P is rewritten before any query sees it, as rejected
    # drafts' is); a query reads only its visible slots, so what sits in the others changes no bit. Rings were
    # overwritten by decode: their copies, taken after the prefill (the draft's before its deeper rows), are restored,
    # and must hold every position a row at P reads (its window below P), or the prompt is prefilled whole.
    @property
    def snapshot_bytes(self) -> int:
        """Bytes of this rank's ring copies for prefix reuse (held once a request has kept its prefix)."""
        return RingSnapshot.bytes_for(self.cache, self._target_rings + self._draft_rings)

    def reusable(self, prompt, speculative: bool) -> int:
        """How many of `prompt`'s first positions the next start may take from the kept prefix (0: none, prefill from
        0): the rule above, for a speculative request only when the draft's KV was kept too."""
        pre = self.prefix
        if pre is None or pre.epoch != self.cache.epoch or (speculative and not pre.drafted):
            return 0
        new = np.asarray(prompt, dtype=np.int64)
        n = min(len(new), len(pre.prompt))
        diff = np.flatnonzero(new[:n] != pre.prompt[:n])
        common = int(diff[0]) if diff.size else n
        reuse = (common - 1) // PREFILL_BLOCK * PREFILL_BLOCK
        if reuse <= 0:
            return 0
        layers = self._target_rings + (self._draft_rings if speculative else [])
        if not all(self._snapshot.holds(i, reuse - self.cache[i].window + 1, reuse) for i in layers):
            return 0  # a shared prefix that ends long before the last prompt did: its ring no longer holds it
        return reuse

    def _keep_target(self, prompt) -> None:
        if self._snapshot is None:
            self._snapshot = self.parts.snapshot(self.cache, self._target_rings + self._draft_rings)
        self._snapshot.take(self.cache, self._target_rings)
        self.prefix = Prefix(np.asarray(prompt, dtype=np.int64), self.cache.epoch)

    def _keep_draft(self) -> None:
        if self.prefix is not None:
            self._snapshot.take(self.cache, self._draft_rings)
            self.prefix.drafted = True

    def decode_chunk(self, runner: RoundRunner, graph) -> None:
        """Run rounds on the device until TOKENS_PER_READ more tokens are logged or the request ends."""
        st = self.state
        if graph is not None:
            graph.replay()
            return
        st.target.copy_(st.emitted + TOKENS_PER_READ)
        st.update_running()
        while bool(st.running):  # one host read per round, the graph's loop condition
            runner.round()
            st.update_running()

    def decode(self, req: Request):
        """Generator of Steps (rank 0 consumes them; other ranks just drive the collectives)."""
        runner, graph = self.runner(req.drafts, req.top_k, req.top_logprobs)
        self.start(req, runner)
        self.par.check()
        read_tokens = read_rounds = 0
        flag = torch.ones(1, dtype=torch.int64, device=self.par.device)
        failed = False
        try:
            while True:
                steps, read_tokens, read_rounds = self._read_log(read_tokens, read_rounds, req.top_logprobs)
                for step in steps:
                    yield step
                if bool(self.state.done):
                    return
                flag.fill_(1)
                self.par.broadcast(flag)  # rank 0 may have cancelled: every rank stops together
                if int(flag) == 0:
                    return
                self.decode_chunk(runner, graph)
                self.par.check()
        except CollectiveError:
            failed = True  # a peer is gone: no flag to hand to it
            raise
        finally:
            if not bool(self.state.done) and not failed:
                flag.fill_(0)
                if self.par.rank == 0:
                    self.par.broadcast(flag)

    def close(self) -> None:
        """Drop the peers' buffer views, then wait for every rank to have done so (a rank that exits while a peer
        still maps its buffer makes torch warn); a rank already gone is not waited for long."""
        if self.par.peers is None:
            return
        self.par.peers.release()
        try:
            torch.distributed.monitored_barrier(group=self.par.group, timeout=timedelta(seconds=10))
        except RuntimeError:
            pass  # a peer stopped (its error was raised where it happened)

    def _read_log(self, read_tokens: int, read_rounds: int, top: int = 0) -> tuple[list[Step], int, int]:
        st = self.state
        rounds = int(st.rounds)
        rec = st.log_rounds[read_rounds:rounds].tolist()
        count = sum(r[2] for r in rec)
        toks = st.log_tokens[read_tokens:read_tokens + count].tolist()
        lps = st.log_logprobs[read_tokens:read_tokens + count].tolist()
        tops = None
        if top:  # the alternatives inside the distribution's support (fewer where top-k/top-p left fewer)
            ids = st.log_top_ids[read_tokens:read_tokens + count, :top].tolist()
            alp = st.log_top_lp[read_tokens:read_tokens + count, :top].tolist()
            tops = [[(t, lp) for t, lp in zip(row_ids, row_lp) if lp != float("-inf")]
                    for row_ids, row_lp in zip(ids, alp)]
        steps, i = [], 0
        for k, a, keep, bonus in rec:
            if keep == 0:
                continue
            steps.append(Step(toks[i:i + keep], lps[i:i + keep], drafts=k, accepted=a, bonus=bool(bonus),
                              top_logprobs=None if tops is None else tops[i:i + keep]))
            i += keep
        if steps and bool(st.done):
            steps[-1].stopped = bool((st.emitted < st.budget))
        return steps, read_tokens + count, rounds

"""Per-position numerics by replay: record every block the fast engine really ran during a decode, recompute
each one with the float64 reference on the committed token stream, and score every row in its position classes.

Recording substitutes engine parts (fast/rank.EngineParts), as the negative controls do: `recording_parts(parts)`
gives the candidate's own model and round runner, each with a recording subclass laid over it (`RecordingModel`,
`RecordingRunner`), and `recording(engine, recorder)` hands rank 0's model a Recorder for one decode. Nothing of a
product object is overwritten at run time; outside `recording` (and on every other rank) the subclasses only pass
through. The blocks compared are the engine's actual verification blocks, redraft blocks and draft rows, with their
padding, their live masks and the KV state the real rounds left behind. The reference side keeps its own caches
*stream-true*: target and draft KV at committed positions always come from the emitted token stream (prompt +
output) and the reference's own hiddens, caught up lazily, so a fast engine whose context drifts from what it
emitted (rejected KV kept, redraft skipped) is compared against what it should have computed.

Draft rows (docs/model.md, "Recursive MTP draft"): a draft row at position p consumes the target's post-norm hidden
h_p and the token x_{p+1}; the draft's KV starts at position 0.

Position classes are data (qualify/tolerances.json, "classes"): a row belongs to every class that applies; each
class keeps its own worst case, so a defect confined to one class is never averaged away by the others.

A recursive draft row (depth >= 2) is the draft layer applied to the previous depth's output, a continuous value.
The reference recomputes it from the *fast engine's* previous output (`recursion="fast"`), as it recomputes a
verification row from the engine's tokens: each depth is then held to one layer's rounding. Run from its own
previous output (`recursion="reference"`), the reference follows a second chain whose rounding differs from the
first at every depth, and the two can cross a router tie at different depths (`iquest debug chain` splits the two).
The engine's feeding of its previous output is still checked: the row is recomputed from what the previous depth
*output*, so feeding anything else shows up as an error at that depth.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from ..fast import sampler as fast_sampler
from ..fast.model import FastModel
from ..fast.rank import EngineParts
from ..fast.round import RoundRunner
from ..reference import sampling
from ..reference.checkpoint import draft_prefix, layer_prefix
from ..reference.model import ReferenceModel
from ..reference.sampling import Dist, SamplingParams
from . import tolerances
from .agreement import divergence_bound, greedy_gap
from .router import router_input, scores_error, swap_ratio
from .window import record_window, sliding_layers

VERIFY_ROWS = 8
METRICS = ("numerics.logits", "numerics.hidden", "numerics.kl", "numerics.topk", "numerics.sampler")
# what a recorded block keeps of the engine's taps (router_in*: the router fold's input, qualify/router.py)
ROUTER_TAPS = ("mlp_in", "router_scores", "experts", "router_in", "router_in_bound")


def classes_all() -> list[str]:
    """Every position class, in the order of tolerances.json's "classes" (indexed ones expanded)."""
    out = []
    for c in tolerances.table()["classes"]:
        lo, hi = c.get("index", (None, None))
        out += [c["name"]] if lo is None else [c["name"].format(i=i) for i in range(lo, hi + 1)]
    return out


@dataclass(frozen=True)
class Geometry:
    """Where the position classes change: the target's sliding window and ring, the draft's window and ring."""
    window: int | None
    ring: int
    draft_window: int | None
    draft_ring: int


@dataclass
class Block:
    kind: str                   # "prefill" | "verify" | "draft"
    round: int                  # verify: round index; draft: chain index (feeds the verify round of that index)
    depth: int                  # draft rows: which q_d they give (1 = depth-0 redraft block); 0 otherwise
    tokens: list[int]
    positions: list[int]
    live: list[bool]
    logits: torch.Tensor        # [R, V/tp] float64, rank 0's vocabulary slice
    hidden: torch.Tensor        # [R, H] float64
    # (row, ids [K], probs [K], input logits [V]) per runner.dist row; under tensor parallelism the input is the
    # ranks' gathered candidates (each rank's top-k, -inf elsewhere): the same top-k, so the same dist()
    dists: list = field(default_factory=list)
    taps: dict | None = None    # with Recorder(taps=True): the engine's router taps (ROUTER_TAPS) of every MoE layer
    window_missing: list | None = None  # per row (missing positions, why): qualify/window.py; None: no sliding layer


class Recorder:
    """What one decode of one engine (rank 0) ran, block by block, as its recording parts report it. With `taps`,
    blocks also keep the engine's router taps (numerics.router, numerics.router_scores, `iquest debug chain`)."""

    def __init__(self, config, taps: bool = False):
        self.taps = taps
        self.vocab = config.vocab_size
        self.sliding = {draft: sliding_layers(config, draft) for draft in (False, True)}  # cache.window's
        self.blocks: list[Block] = []
        self.in_round = False
        self.round = -1
        self.chain = -1
        self.depth = 1
        self.gathered: list[torch.Tensor] = []

    def model_call(self, kind: str, cache, tokens, positions, live, logits, hidden, taps) -> None:
        if kind == "verify":
            self.round += 1
        round_ = self.chain if kind == "draft" else self.round if kind == "verify" else -1
        b = Block(kind, round_, self.depth if kind == "draft" else 0, tokens.tolist(), positions.tolist(),
                  live.tolist(), logits.detach().double().cpu(), hidden.detach().double().cpu())
        if taps is not None:
            b.taps = {k: v for k, v in taps.items() if k.rsplit(".", 1)[-1] in ROUTER_TAPS}
        record_window(b, cache, self.sliding[kind == "draft"])  # as the rows read it
        self.blocks.append(b)

    def dist_call(self, local_logits, ids, probs) -> None:
        b = self.blocks[-1]
        R = local_logits.shape[0]
        rows = list(range(R)) if R == len(b.tokens) else [max(i for i, x in enumerate(b.live) if x)]
        logits_in = local_logits.detach().double().cpu()
        if logits_in.shape[-1] != self.vocab:  # a vocabulary slice: every rank's top-k candidates, -inf elsewhere
            logits_in = candidate_logits(self.gathered[-1], self.vocab)
        self.gathered.clear()
        for r, row in enumerate(rows):
            # copies: ids and probs may be views of the decode state's rows (a draft's proposal), rewritten later
            b.dists.append((row, ids[r].cpu().clone(), probs[r].double().cpu().clone(), logits_in[r]))


class RecordingModel(FastModel):
    """Laid over the candidate's model class (`recording_parts`): reports every forward and draft call to the
    Recorder that `recording` hands it, and otherwise passes through."""

    recorder: Recorder | None = None

    def forward(self, tokens, positions, live, taps=None):
        rec = self.recorder
        if rec is None:
            return super().forward(tokens, positions, live, taps)
        mine = {} if taps is None and rec.taps else taps
        logits, hidden = super().forward(tokens, positions, live, mine)
        rec.model_call("verify" if rec.in_round else "prefill", self.cache, tokens, positions, live, logits, hidden,
                       mine)
        return logits, hidden

    def draft(self, tokens, hidden, positions, live, taps=None):
        rec = self.recorder
        if rec is None:
            return super().draft(tokens, hidden, positions, live, taps)
        mine = {} if taps is None and rec.taps else taps
        logits, h = super().draft(tokens, hidden, positions, live, mine)
        rec.model_call("draft", self.cache, tokens, positions, live, logits, h, mine)
        return logits, h


class RecordingRunner(RoundRunner):
    """Laid over the candidate's round runner class: marks the rounds (a target forward inside one is a verification
    block, outside one a prefill block), the draft chains and depths, and reports every distribution it samples with
    (and, under tensor parallelism, the candidates the ranks gathered for it)."""

    def _rec(self) -> Recorder | None:
        return getattr(self.m, "recorder", None)

    def speculative_round(self) -> None:
        self._in_round(super().speculative_round)

    def plain_round(self) -> None:
        self._in_round(super().plain_round)

    def _in_round(self, body) -> None:
        rec = self._rec()
        if rec is not None:
            rec.in_round = True
        try:
            body()
        finally:
            if rec is not None:
                rec.in_round = False

    def _sampling_args(self) -> tuple:
        args = super()._sampling_args()
        rec = self._rec()
        if rec is None:
            return args
        gather = args[2]

        def recording_gather(keys):  # the candidates the ranks all-gather, kept: the rows' top-k over the vocabulary
            rec.gathered.append(gather(keys))
            return rec.gathered[-1]
        return (*args[:2], recording_gather, *args[3:])

    def dist(self, local_logits):
        ids, probs = super().dist(local_logits)
        if (rec := self._rec()) is not None:
            rec.dist_call(local_logits, ids, probs)
        return ids, probs

    def sample(self, local_logits, u, out, chain=None):  # a draft depth's dist and draw (one kernel where fused)
        served = super().sample(local_logits, u, out, chain)
        if (rec := self._rec()) is not None:
            rec.dist_call(local_logits, out[1], out[2])
        return served

    def draft(self, *args, **kwargs):
        if (rec := self._rec()) is not None:
            rec.chain += 1
            rec.depth = 1
        return super().draft(*args, **kwargs)

    def draft_row(self, depth: int) -> None:
        rec = self._rec()
        if rec is None:
            return super().draft_row(depth)
        rec.depth = depth
        try:
            return super().draft_row(depth)
        finally:
            rec.depth = 1


@lru_cache(maxsize=None)
def _combined(mixin: type, base: type) -> type:
    return base if issubclass(base, mixin) else type(f"Recording{base.__name__}", (mixin, base), {})


@dataclass(frozen=True)
class _Recording:
    """A picklable stand-in for a recording class (tensor-parallel workers receive the parts by pickle): builds the
    subclass of `base` with `mixin` laid over it in whichever process constructs it."""
    mixin: type
    base: type

    def __call__(self, *args, **kwargs):
        return _combined(self.mixin, self.base)(*args, **kwargs)


def recording_parts(parts: EngineParts = EngineParts()) -> EngineParts:
    """`parts` with the recording model and runner laid over its own (a control's broken piece stays in place)."""
    if isinstance(parts.model, _Recording):
        return parts
    return replace(parts, model=_Recording(RecordingModel, parts.model), runner=_Recording(RecordingRunner, parts.runner))


@contextmanager
def recording(engine, recorder: Recorder):
    """Hand `engine`'s model (rank 0's) the recorder for the duration (the engine built with `recording_parts`)."""
    if not isinstance(engine.model, RecordingModel):
        raise TypeError("the engine was not built with qualify.replay.recording_parts(...): nothing would be recorded")
    engine.model.recorder = recorder
    try:
        yield recorder
    finally:
        engine.model.recorder = None


@dataclass
class DraftRow:
    """What the reference computed one draft row from, and its draft-layer taps (the row is `row` of `taps`)."""
    token: int                  # x_{p+1}, the token the row consumes
    position: int               # p
    prev: torch.Tensor          # [H] the hidden h_p the row started from
    taps: dict
    row: int

    def tap(self, name: str) -> torch.Tensor:
        return self.taps["mtp." + name][self.row]


# ---- the reference side -------------------------------------------------------------------------------
class _ForcedRouting(ReferenceModel):
    """The reference with its MoE layers' experts given per layer (weight prefix -> [R, k]) instead of chosen by its
    routers: the block recomputed under the engine's routing (qualify/router.py). It shares the reference's weights."""

    def __init__(self, base: ReferenceModel, forced: dict[str, torch.Tensor]):
        self.__dict__.update(base.__dict__)
        self.forced = forced

    def _moe(self, c, p, b, experts=None):
        return super()._moe(c, p, b, self.forced.get(p) if experts is None else experts)


class StreamReference:
    """The float64 reference with stream-true caches: KV at committed positions always from the stream.

    Target rows recorded with the engine's router taps get their routing checked (numerics.router): where the
    engine's experts differ from the reference's in some MoE layer, and every such swap is one the engine's own
    MoE input explains (qualify/router.py: on the reference's input, and again on the input of the block recomputed
    under the engine's routing), the block is recomputed with the engine's experts in every MoE layer, and that
    recompute is what the rows are scored against and what the cache and the hiddens keep (the engine's cache holds
    its own routing's keys, and the draft reads its own hiddens). An unexplained swap is scored against the
    reference's own routing, and fails numerics.router."""

    def __init__(self, ref: ReferenceModel, stream: list[int], recursion: str = "fast", router_tol: float = 1.0):
        if recursion not in ("fast", "reference"):
            raise ValueError(f"recursion must be 'fast' or 'reference', got {recursion!r}")
        self.m, self.stream, self.recursion, self.router_tol = ref, stream, recursion, router_tol
        self.cache = ref.new_cache()
        self.main_valid = 0      # target KV and hiddens are stream-true for positions < main_valid
        self.mtp_valid = 0       # draft KV is the depth-0 KV (from the target's hiddens) for positions < mtp_valid
        self.H: dict[int, torch.Tensor] = {}
        self.chain_h: torch.Tensor | None = None
        self.chain_pos = -1
        c = ref.config
        self.moe = {f"layer{i}.": layer_prefix(i) for i in range(c.num_hidden_layers) if not c.is_dense(i)}

    def catch_up(self, end: int) -> bool:
        if end > len(self.stream):
            return False
        if self.main_valid < end:
            pos = torch.arange(self.main_valid, end)
            _, h = self.m.forward(torch.tensor(self.stream[self.main_valid:end]), pos, self.cache)
            for i, p in enumerate(pos.tolist()):
                self.H[p] = h[i]
            self.main_valid = end
        return True

    def _swaps(self, b: Block, idx: list[int], taps: dict, own: bool) -> tuple[bool, dict[int, float]]:
        """(any expert set differs, row -> max over MoE layers of the swap's m / band) of the engine's experts
        against the reference run's (`own`: its routers' own top k of its scores, for a run with forced experts)."""
        any_swap, ratios = False, {}
        for r, i in enumerate(idx):
            worst = 0.0
            for t, p in self.moe.items():
                if t + "experts" not in b.taps:
                    continue
                fast = b.taps[t + "experts"][i]
                ref = (torch.sort(taps[t + "router_scores"][r], descending=True, stable=True).indices[:fast.numel()]
                       if own else taps[t + "experts"][r])
                swapped, ratio = swap_ratio(self.m.w[p + "mlp.router.weight"], router_input(b.taps, t, i),
                                            taps[t + "mlp_in"][r], fast, ref)
                any_swap |= swapped
                worst = max(worst, ratio)
            ratios[i] = worst
        return any_swap, ratios

    def main_block(self, b: Block) -> list:
        """Per row: None (padding), ("uncovered",), ("context", why) or ("ok", logits [V], hidden [H], router value
        or None when the block has no taps)."""
        out: list = [None] * len(b.tokens)
        idx = [i for i, x in enumerate(b.live) if x]
        pos0 = b.positions[idx[0]]
        if not self.catch_up(pos0):
            return [("uncovered",) if b.live[i] else None for i in range(len(b.tokens))]
        if pos0 >= len(self.stream) or b.tokens[idx[0]] != self.stream[pos0]:
            why = (f"block starts at position {pos0} with token {b.tokens[idx[0]]}, but the committed stream has "
                   f"{self.stream[pos0] if pos0 < len(self.stream) else 'nothing'} there")
            for i in idx:
                out[i] = ("context", why)
            return out
        toks = torch.tensor([b.tokens[i] for i in idx])
        pos = torch.tensor([b.positions[i] for i in idx])
        taps = {} if b.taps is not None else None
        logits, hidden = self.m.forward(toks, pos, self.cache, taps)
        ratios: dict[int, float | None] = {i: None for i in idx}
        if taps is not None:
            swapped, ratios = self._swaps(b, idx, taps, own=False)
            if swapped and max(ratios.values()) <= self.router_tol:  # recompute under the engine's routing
                forced = {p: torch.stack([b.taps[t + "experts"][i] for i in idx]) for t, p in self.moe.items()
                          if t + "experts" in b.taps}
                ftaps: dict = {}
                flogits, fhidden = _ForcedRouting(self.m, forced).forward(toks, pos, self.cache, ftaps)
                _, again = self._swaps(b, idx, ftaps, own=True)
                ratios = {i: max(ratios[i], again[i]) for i in idx}
                if max(again.values()) <= self.router_tol:
                    logits, hidden = flogits, fhidden
                else:  # unexplained on the recomputed inputs: back to the reference's own routing (and its KV)
                    logits, hidden = self.m.forward(toks, pos, self.cache)
        true = 0
        for r, i in enumerate(idx):
            out[i] = ("ok", logits[r], hidden[r], ratios[i])
            p = b.positions[i]
            if true == r and p < len(self.stream) and b.tokens[i] == self.stream[p]:
                self.H[p] = hidden[r]
                true += 1
        self.main_valid = pos0 + true
        return out

    def draft_block(self, b: Block) -> list:
        """Per row: None, ("uncovered",), ("context", why) or ("ok", logits, hidden, DraftRow)."""
        out: list = [None] * len(b.tokens)
        if b.depth >= 2:  # one recursive row from the previous depth's output
            p = b.positions[0]
            if self.chain_h is None or p != self.chain_pos + 1:
                self.chain_h = None
                return [("uncovered",)]
            prev, taps = self.chain_h, {}
            logits, h = self.m.draft(torch.tensor([b.tokens[0]]), prev[None], torch.tensor([p]), self.cache, taps)
            self.chain_h, self.chain_pos = self._next(h[0], b.hidden[0]), p
            return [("ok", logits[0], h[0], DraftRow(b.tokens[0], p, prev, taps, 0))]
        # depth 0: row p reads the target's h_p and x_{p+1}, both committed
        idx = [i for i, x in enumerate(b.live) if x]
        inside = [i for i in idx if b.positions[i] + 1 < len(self.stream)]
        self.chain_h = None
        for i in idx:
            out[i] = ("uncovered",)
        if not inside:
            return out
        P = max(b.positions[i] for i in inside)
        if not self.catch_up(P + 1):
            return out
        s = min(self.mtp_valid, min(b.positions[i] for i in inside))
        pos = torch.arange(s, P + 1)
        prev = torch.stack([self.H[p] for p in pos.tolist()])
        taps: dict = {}
        logits, h = self.m.draft(torch.tensor(self.stream[s + 1:P + 2]), prev, pos, self.cache, taps)
        self.mtp_valid = P + 1
        for i in inside:
            p = b.positions[i]
            if b.tokens[i] != self.stream[p + 1]:
                out[i] = ("context", f"draft row at position {p} carries token {b.tokens[i]}, the stream has "
                                     f"{self.stream[p + 1]} at {p + 1}")
            else:
                out[i] = ("ok", logits[p - s], h[p - s], DraftRow(self.stream[p + 1], p, prev[p - s], taps, p - s))
        last = max(idx)
        if b.positions[last] == P and out[last][0] == "ok":
            self.chain_h, self.chain_pos = self._next(h[P - s], b.hidden[last]), P
        return out

    def forced(self, row: "DraftRow", experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, h') of a draft row recomputed with the draft layer's experts given (qualify/router.py). The
        row's K/V (written before its MoE, so equal up to float64 rounding of a one-row recompute) is put back
        as the block left it, so the replay does not depend on which rows were recomputed."""
        layer, p = self.m.config.num_hidden_layers, row.position  # the cache's draft entry
        k, v = self.cache.k[layer][p].clone(), self.cache.v[layer][p].clone()
        logits, h = self.m.draft(torch.tensor([row.token]), row.prev[None], torch.tensor([p]),
                                 self.cache, None, experts.view(1, -1))
        self.cache.k[layer][p], self.cache.v[layer][p] = k, v
        return logits[0], h[0]

    def _next(self, ref_h: torch.Tensor, fast_h: torch.Tensor) -> torch.Tensor:
        """The previous-depth output the next recursive row starts from (see the module docstring)."""
        return fast_h if self.recursion == "fast" else ref_h


# ---- scoring ------------------------------------------------------------------------------------------------
@dataclass
class Worst:
    rows: int = 0
    failures: int = 0
    ratio: float = -1.0
    value: float = 0.0
    tol: float = 0.0
    where: str = ""
    sumsq: float = 0.0          # sum of the values' squares (the RMS statistic of the fp8w.* checks)

    def add(self, value: float, tol: float, where: str) -> None:
        ratio = value / tol if tol > 0 else (0.0 if value == 0 else math.inf)
        if math.isnan(ratio):
            ratio = math.inf
        self.rows += 1
        self.sumsq += value * value
        self.failures += ratio > 1
        if ratio > self.ratio:
            self.ratio, self.value, self.tol, self.where = ratio, value, tol, where


class Scores:
    """(check, class) -> Worst."""

    def __init__(self):
        self.table: dict[tuple[str, str], Worst] = {}

    def add(self, check: str, classes: list[str], value: float, tol: float, where: str) -> None:
        for c in classes:
            self.table.setdefault((check, c), Worst()).add(value, tol, where)

    def merge(self, other: "Scores") -> None:
        for key, w in other.table.items():
            mine = self.table.setdefault(key, Worst())
            mine.rows += w.rows
            mine.sumsq += w.sumsq
            mine.failures += w.failures
            if w.ratio > mine.ratio:
                mine.ratio, mine.value, mine.tol, mine.where = w.ratio, w.value, w.tol, w.where


def row_classes(b: Block, i: int, g: Geometry) -> list[str]:
    """The position classes of row i of a block (tolerances.json, "classes")."""
    p = b.positions[i]
    if b.kind == "draft":
        return ([f"draft_depth{b.depth}"] + (["draft_past_window"] if g.draft_window and p >= g.draft_window else [])
                + (["draft_ring_reused"] if p >= g.draft_ring else []))
    if b.kind == "prefill":
        return ["prefill"]
    return ([f"verify_row{i}"] + (["past_window"] if g.window and p >= g.window else [])
            + (["ring_reused"] if p >= g.ring else []))


def candidate_logits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [R, vocab] rows holding the candidates whose rank keys are `keys` [R, C] (fast.sampler's: value and
    global id) and -inf elsewhere. Each rank contributes its own top-k, so a row's top-k is the whole vocabulary's
    and dist() of it is dist() of the full row (docs/round.md: top-k first, the softmax over those alone)."""
    values, ids = fast_sampler.unkey(keys.cpu())
    out = torch.full((keys.shape[0], vocab), -math.inf, dtype=torch.float64)
    return out.scatter_(1, ids, values.double())


def kl(ref_logits: torch.Tensor, fast_logits: torch.Tensor, t: float) -> float:
    lp = torch.log_softmax(ref_logits / t, -1)
    lq = torch.log_softmax(fast_logits / t, -1)
    return max(float((lp.exp() * (lp - lq)).sum()), 0.0)


def _by_token(ids: torch.Tensor, values: torch.Tensor) -> dict[int, float]:
    """{token: value} as Python numbers, each tensor read once (`tolist`), not an element at a time: the same values,
    exactly, a tenth of a quick qualification's time fewer."""
    return dict(zip(ids.tolist(), values.tolist()))


def sampler_error(fast_ids, fast_probs, logits_in, params: SamplingParams) -> tuple[float, str]:
    """Max |p_fast - p_ref| of the fast sampler against reference sampling.dist on the same logits."""
    ref = sampling.dist(logits_in, params)
    fast = {t: p for t, p in _by_token(fast_ids, fast_probs).items() if p > 0}
    refd = _by_token(ref.ids, ref.probs)
    only = fast.keys() ^ refd.keys()
    if only and params.temperature > 0:
        # Boundary allowance: mass before each candidate in the untruncated top-k order.
        k = min(params.top_k, logits_in.numel())
        order = torch.argsort(-logits_in, stable=True)[:k]
        full = torch.softmax((logits_in[order] - logits_in[order[0]]) / params.temperature, -1)
        before = _by_token(order, torch.cumsum(full, 0) - full)
        if any(abs(before.get(tok, 2.0) - params.top_p) <= 1e-5 for tok in only):
            # rounding kept or cut the crossing token: compare both renormalized over the common support
            common = set(fast) & set(refd)
            fs, rs = sum(fast[t] for t in common), sum(refd[t] for t in common)
            fast, refd = {t: fast[t] / fs for t in common}, {t: refd[t] / rs for t in common}
            only = set()
    one_side = {t: fast.get(t, refd.get(t)) for t in only}
    worst = max([abs(fast[t] - refd[t]) for t in fast.keys() & refd.keys()] + list(one_side.values()), default=0.0)
    if not one_side:
        return worst, ""
    tok = max(one_side, key=one_side.get)  # the heaviest token of one support only
    return worst, f"token {tok} in {'fast' if tok in fast else 'reference'} support only (p={one_side[tok]:.3g})"


def l1(p: Dist, ids: torch.Tensor, probs: torch.Tensor) -> float:
    fast = {t: q for t, q in _by_token(ids, probs).items() if q > 0}
    refd = _by_token(p.ids, p.probs)
    return sum([abs(fast.get(t, 0.0) - refd.get(t, 0.0)) for t in set(fast) | set(refd)])


def distribution_ratio(ref_logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, params: SamplingParams,
                       tol_rel: float, scale: float) -> float:
    """How far the fast engine's sampling distribution (ids, probs) lies from the reference's, over the bound
    2 e / T that logits within e = tol_rel * scale of the reference's allow (qualify/tolerances.json,
    decode.acceptance): the L1 distance, or at temperature 0 (one-hot, T taken as 1) the pick's greedy_gap."""
    bound = divergence_bound(tol_rel, scale, params.temperature)
    if params.temperature == 0:
        return greedy_gap(ref_logits, int(ids[probs.argmax()])) / bound
    return l1(sampling.dist(ref_logits, params), ids, probs) / bound


@dataclass
class ReplayResult:
    scores: Scores
    round_ratio: dict[int, float]   # worst L1/bound of target (round r) and draft (chain r) distributions;
                                    # at temperature 0 the pick's greedy_gap/bound
    covered: int
    uncovered: int


def router_checked(sr: StreamReference, router_w: torch.Tensor, b: Block, i: int, r: tuple,
                   tol: float) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(logits, hidden) draft row i of `b` is scored against, and its numerics.router value (None when the
    block has no taps): the reference's own row (r, from draft_block), or, for a swap of draft-layer experts that the
    engine's own input explains (value <= tol), the reference recomputed with the engine's experts."""
    if b.taps is None:
        return r[1], r[2], None
    fast = b.taps["mtp.experts"][i]
    swapped, ratio = swap_ratio(router_w, router_input(b.taps, "mtp.", i), r[3].tap("mlp_in"), fast,
                                r[3].tap("experts"))
    if swapped and ratio <= tol:
        return (*sr.forced(r[3], fast), ratio)
    return r[1], r[2], ratio


def router_weight(ref: ReferenceModel) -> torch.Tensor:
    """The draft layer's router [E, H] (float64, exactly the stored values)."""
    return ref.w[draft_prefix() + "mlp.router.weight"]


def routers(ref: ReferenceModel) -> dict[str, torch.Tensor]:
    """Tap prefix ("layer{l}." or "mtp.") -> that MoE layer's stored router (float64, exact)."""
    c = ref.config
    out = {f"layer{i}.": ref.w[layer_prefix(i) + "mlp.router.weight"] for i in range(c.num_hidden_layers)
           if not c.is_dense(i)}
    out["mtp."] = router_weight(ref)
    return out


def score_router_scores(scores: Scores, b: Block, i: int, classes: list[str], where: str, rw: dict,
                        tol: float, rw_abs: dict | None = None) -> None:
    """numerics.router_scores of row i over every MoE layer the block ran (qualify/router.scores_error): the worst
    layer's value. `rw_abs`: |w| of the routers in `rw`, by the same prefixes, where the caller holds them."""
    worst, why = -1.0, ""
    for prefix, w in rw.items():
        if prefix + "experts" not in b.taps:
            continue
        v, what = scores_error(w, router_input(b.taps, prefix, i), b.taps[prefix + "router_scores"][i],
                               b.taps[prefix + "experts"][i], None if rw_abs is None else rw_abs[prefix])
        if v > worst:
            worst, why = v, f"{prefix.rstrip('.')}: {what}"
    if worst >= 0:
        scores.add("numerics.router_scores", classes, worst, tol, f"{where}: {why}")


def score(blocks: list[Block], ref: ReferenceModel, stream: list[int], params: SamplingParams, tol: dict,
          geometry: Geometry, vocab_offset: int = 0, full_vocab: bool = True) -> ReplayResult:
    """Every recorded row against the stream-true reference. `tol`: check -> tolerance value (the column of the
    candidate's scheme). Rows recorded with taps also get numerics.router_scores (every MoE layer: the router on the
    engine's own input) and numerics.router (qualify/router.py): a swap of experts that the engine's own MoE input
    explains is scored against the reference recomputed with the engine's experts (target rows: StreamReference's
    main_block; draft rows: router_checked).
    Every live row of a block recorded with its ring (Block.window_missing) gets cache.window, whether or not the
    reference covers it. Under tensor parallelism (not `full_vocab`) the logits are rank 0's vocabulary slice, so
    numerics.kl and numerics.topk are not scored; numerics.sampler is, on the candidates the ranks gathered
    (Block.dists)."""
    sr = StreamReference(ref, stream, router_tol=tol["numerics.router"])
    router_w, rw = router_weight(ref), routers(ref)
    rw_abs = {prefix: w.abs() for prefix, w in rw.items()}
    tol_rel = tol["numerics.logits"]
    scores, round_ratio = Scores(), {}
    t = params.temperature if params.temperature > 0 else 1.0
    covered = uncovered = 0
    for b in blocks:
        rows = sr.draft_block(b) if b.kind == "draft" else sr.main_block(b)
        ref_rows: dict[int, tuple] = {}
        for i, r in enumerate(rows):
            if r is None:
                continue
            classes = row_classes(b, i, geometry)
            where = f"{b.kind} round {b.round} row {i} position {b.positions[i]}"
            if b.window_missing is not None and b.live[i]:
                missing, why = b.window_missing[i]
                scores.add("cache.window", classes, float(missing), tol["cache.window"],
                           f"{where}: {why}" if why else where)
            if b.taps is not None and b.live[i]:  # the engine's router on its own input: no reference needed
                score_router_scores(scores, b, i, classes, where, rw, tol["numerics.router_scores"], rw_abs)
            if r[0] == "uncovered":
                uncovered += 1
                continue
            covered += 1
            if r[0] == "context":
                for m in METRICS[:4]:
                    scores.add(m, classes, math.inf, 1.0, f"{where}: {r[1]}")
                continue
            rl, rh = r[1], r[2]
            ratio = r[3] if b.kind != "draft" else None  # target rows: checked (and recomputed) by main_block
            if b.kind == "draft":
                rl, rh, ratio = router_checked(sr, router_w, b, i, r, tol["numerics.router"])
            if ratio is not None:
                scores.add("numerics.router", classes, ratio, tol["numerics.router"], where)
            fl, fh = b.logits[i], b.hidden[i]
            scale = float(rl.abs().max())
            ref_rows[i] = (rl, scale)
            e = tol_rel * scale
            rl_s = rl[vocab_offset:vocab_offset + fl.numel()]
            scores.add("numerics.logits", classes, float((fl - rl_s).abs().max()) / scale, tol_rel, where)
            scores.add("numerics.hidden", classes, float((fh - rh).abs().max() / rh.abs().max()),
                       tol["numerics.hidden"], where)
            if full_vocab:
                scores.add("numerics.kl", classes, kl(rl, fl, t), (e / t) ** 2 / 2, where)
                k = min(params.top_k, rl.numel())
                kth = float(torch.topk(rl, k).values[k - 1])
                top = torch.topk(fl, k).indices
                scores.add("numerics.topk", classes, float((rl[top] < kth - 2 * e).sum()), tol["numerics.topk"],
                           where)
        for row, ids, probs, logits_in in b.dists:
            classes = row_classes(b, row, geometry)
            where = f"{b.kind} round {b.round} row {row} position {b.positions[row]}"
            err, why = sampler_error(ids, probs, logits_in, params)  # logits_in: the whole vocabulary's top-k
            scores.add("numerics.sampler", classes, err, tol["numerics.sampler"], f"{where} {why}".strip())
            if row in ref_rows and b.kind in ("verify", "draft"):
                rl, scale = ref_rows[row]
                ratio = distribution_ratio(rl, ids, probs, params, tol_rel, scale)
                round_ratio[b.round] = max(round_ratio.get(b.round, 0.0), ratio)
            elif b.kind in ("verify", "draft") and rows[row] is not None and rows[row][0] == "context":
                round_ratio[b.round] = math.inf
    return ReplayResult(scores, round_ratio, covered, uncovered)

"""The checks of `iquest qualify`, each producing rows of (check, class, worst error, tolerance, verdict).

- decode sessions: one real decode of the fast engine, recorded and replayed against the float64 reference
  (per-position numerics, qualify/replay.py), and compared with the reference's own decode of the same request
  (tokens and acceptance sequences until the first divergence, each divergence explained: qualify/agreement.py);
- stability: the same prefix alone, +1 and +8 tokens, on both engines;
- lossless: chi-square of the first speculative token against its exact distribution (micro preset).

The reference a candidate is judged by is named by (model folder, quant): quant None is the checkpoint as stored;
"fp8" has every linear the checkpoint stores unquantized (a BF16 checkpoint: all of them) quantized exactly as the
engine's loader quantizes it at load (`--weights fp8`: E4M3 in fast/weights.LOAD_BLOCK blocks, over whole blocks),
then dequantized exactly: the model the FP8 engine runs.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import torch

from ..fast.cache import RING_SLACK, StaticKV, layer_slots
from ..fast.parallel import Parallel
from ..fast.rank import PREFILL_BLOCK, EngineOptions, EngineParts, RankEngine, Request, cache_capacity
from ..fast.weights import LOAD_BLOCK
from ..reference.checkpoint import CheckpointReader
from ..reference.config import Config
from ..reference import sampling
from ..reference.fp8 import dequantize, quantize
from ..reference.model import ReferenceModel
from ..reference.sampling import SamplingParams
from ..reference.speculative import generate, model_logprobs
from . import tolerances
from .agreement import compare, divergence_bound, greedy_gap
from .replay import Geometry, Recorder, Scores, recording, score


@dataclass
class Row:
    check: str
    cls: str
    value: float
    tol: float
    passed: bool
    rows: int = 0
    where: str = ""

    def as_dict(self) -> dict:
        f = lambda x: x if math.isfinite(x) else str(x)  # noqa: E731 (JSON has no inf)
        return {"check": self.check, "class": self.cls, "worst": f(self.value), "tolerance": f(self.tol),
                "verdict": "pass" if self.passed else "FAIL", "rows": self.rows, "where": self.where}


@lru_cache(maxsize=None)
def reference(model_dir: str, quant: str | None = None) -> ReferenceModel:
    """The float64 reference on the checkpoint as stored (quant None), or with every linear the checkpoint stores
    unquantized quantized as the engine's loader quantizes it at load (quant "fp8"; see the module docstring). Cached
    for the process, so made outside inference mode (qualify/run.py runs its units under it) whatever the first
    caller's mode: its weights stay ordinary tensors for every later caller."""
    with torch.inference_mode(False):
        return _reference(model_dir, quant)


def _reference(model_dir: str, quant: str | None) -> ReferenceModel:
    if quant is None:
        return ReferenceModel.load(model_dir)
    if quant != "fp8":
        raise ValueError(f"unknown reference quantization {quant!r}")
    reader = CheckpointReader(model_dir)
    weights = {}
    for name in reader.names():
        s = reader.read_weight(name)
        if s.scale is not None:
            w = dequantize(s.weight, s.scale, reader.block, torch.float64)
        elif at_load(reader, name):  # over the whole tensor: the loader's whole blocks are the same
            w = dequantize(*quantize(s.weight, LOAD_BLOCK), LOAD_BLOCK, torch.float64)
        else:
            w = s.weight
        weights[name] = w
    model = ReferenceModel(reader.config, weights)
    model.model_dir = Path(model_dir)
    return model


def at_load(reader: CheckpointReader, name: str) -> bool:
    """Whether --weights fp8 quantizes `name` at load: a linear (quantizable) the checkpoint stores unquantized."""
    return reader.specs[name].quantized and not reader.is_quantized(name)


def quantized_at_load(model_dir: str) -> bool:
    """Whether --weights fp8 quantizes any of the checkpoint's linears at load (a BF16 checkpoint: all of them)."""
    reader = CheckpointReader(model_dir)
    return any(at_load(reader, n) for n in reader.names())


def params_for(engine: RankEngine, case: "Case | None" = None) -> SamplingParams:
    """The case's sampling parameters, or the model's generation_config.json defaults."""
    if case is not None and case.params is not None:
        return SamplingParams(*case.params)
    g = engine.generation
    return SamplingParams(g.temperature, g.top_k, g.top_p)


@dataclass(frozen=True)
class RefSpec:
    """Which float64 reference judges a candidate: the model folder and its quantization (see the module docstring)."""
    model_dir: str
    quant: str | None = None

    def model(self) -> ReferenceModel:
        return reference(self.model_dir, self.quant)


@dataclass(frozen=True)
class Case:
    prompt: tuple[int, ...]
    seed: int
    drafts: int | str
    max_new_tokens: int
    params: tuple[float, int, float] | None = None  # (temperature, top_k, top_p); None: the model's defaults


@dataclass
class Session:
    """One recorded decode of the fast engine and what the checks made of it."""

    case: Case
    steps: list
    blocks: list
    scores: Scores
    round_ratio: dict
    geometry: Geometry
    params: SamplingParams
    agreement_rows: list[Row] = field(default_factory=list)
    source_scores: Scores | None = None  # fp8w.*: against the BF16 source's reference (a BF16 checkpoint as FP8)

    @property
    def ring(self) -> int:
        return self.geometry.ring


def _tokens(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def _acceptance(steps) -> list[tuple[int, int]]:
    return [(s.drafts, s.accepted) for s in steps[1:]]


def _logprobs(steps) -> list[float]:
    return [lp for s in steps for lp in s.logprobs]


@lru_cache(maxsize=None)
def reference_decode(ref: RefSpec, case: Case, params: SamplingParams) -> tuple:
    from ..reference.depth import load_controller

    controller = load_controller(ref.model_dir) if case.drafts == "auto" else None  # the model's own rule, as fast/
    steps = list(generate(ref.model(), list(case.prompt), seed=case.seed, params=params,
                          max_new_tokens=case.max_new_tokens, drafts=case.drafts, controller=controller))
    return tuple(_tokens(steps)), tuple(_acceptance(steps))


def fast_prefill_dist(engine: RankEngine, params: SamplingParams):
    """The fast engine's target distribution after `prefix`, from a fresh prefill (after the decode)."""
    def dist(prefix):
        runner, _ = engine.runner(0, params.top_k)
        engine.state.temperature.fill_(params.temperature)  # the sampler reads these from the device state
        engine.state.top_p.fill_(params.top_p)
        engine.cache.reset()
        dev = engine.par.device
        for s in range(0, len(prefix), PREFILL_BLOCK):
            p = torch.arange(s, min(s + PREFILL_BLOCK, len(prefix)), device=dev)
            logits, _ = engine.model.forward(torch.tensor(prefix, device=dev)[p], p, torch.ones_like(p, dtype=torch.bool))
        ids, probs = runner.dist(logits[-1:])
        keep = probs[0] > 0
        return sampling.Dist(ids[0][keep].cpu(), probs[0][keep].double().cpu())
    return dist


def reference_dist(ref: RefSpec, params: SamplingParams):
    model = ref.model()

    def dist(prefix):
        logits, _ = model.forward(torch.tensor(prefix), torch.arange(len(prefix)), model.new_cache())
        return sampling.dist(logits[-1], params)
    return dist


def geometry(config: Config, options: EngineOptions, cache: type[StaticKV] = StaticKV) -> Geometry:
    """Where the position classes change for a candidate: the config's windows (the contract) and the rings the
    engine's caches hold under `options` (the cache class `cache`: a negative control's may hold fewer spare slots).
    A ring is the whole capacity when no layer of its kind slides."""
    cap = cache_capacity(options)
    slack = getattr(cache, "ring_slack", RING_SLACK)
    window = next((config.window(i) for i in range(config.num_hidden_layers) if config.window(i)), None)
    draft = config.mtp.window(0)
    return Geometry(window, layer_slots(window, cap, slack), draft, layer_slots(draft, cap, slack))


def sliding_ring(config: Config, options: EngineOptions, cache: type[StaticKV] = StaticKV) -> int:
    """Slots of a target sliding layer's ring (the whole capacity when no layer slides)."""
    return geometry(config, options, cache).ring


def record(engine: RankEngine, case: Case, run=None, taps: bool = False) -> tuple[SamplingParams, list, list]:
    """Decode `case` on `engine` (or through `run(req)`) under a Recorder: (params, steps, recorded blocks). The
    engine is built with qualify.replay.recording_parts."""
    params = params_for(engine, case)
    req = Request(case.prompt, case.seed, params.temperature, params.top_k, params.top_p, case.max_new_tokens,
                  case.drafts, ())
    with recording(engine, Recorder(engine.config, taps)) as rec:
        steps = list((run or engine.decode)(req))
    return params, steps, rec.blocks


def decode_session(engine: RankEngine, ref: RefSpec, case: Case, column: str, run=None,
                   dist_engine: RankEngine | None = None, source: RefSpec | None = None) -> Session:
    """`engine`: the (rank-0) engine recorded; `run(req)`: how a request is decoded (default engine.decode; a
    FastEngine's generate under TP); `dist_engine`: a single-rank engine for fresh-prefill distributions; `source`:
    also score the recorded blocks against this reference with the fp8w.* tolerances (a BF16 checkpoint run as FP8,
    against its BF16 weights)."""
    params, steps, blocks = record(engine, case, run, taps=True)  # router taps: numerics.router(_scores)
    out = _tokens(steps)
    stream = list(case.prompt) + out
    tol = tolerances.column(column)
    geo = geometry(engine.config, engine.options, type(engine.cache))
    full = engine.par.world == 1
    result = score(blocks, ref.model(), stream, params, tol, geo, engine.model.w.vocab_offset, full_vocab=full)
    session = Session(case, steps, blocks, result.scores, result.round_ratio, geo, params)
    session.agreement_rows = agreement(dist_engine or engine, ref, case, params, out, _acceptance(steps),
                                       result.round_ratio, tol["numerics.logits"])
    if full:  # rank 0's logits are a vocabulary slice under tensor parallelism: no log-normalizer to check against
        session.agreement_rows.append(logprob_row(blocks, case, out, _logprobs(steps),
                                                  tolerances.value("decode.logprobs", column)))
    if source is not None:
        session.source_scores = source_scores(blocks, source, stream, params, column, geo, engine, full)
    return session


def source_scores(blocks, source: RefSpec, stream, params, column: str, geo: Geometry, engine, full: bool) -> Scores:
    """fp8w.logits, fp8w.hidden, fp8w.kl of the recorded blocks against `source`'s reference."""
    col = tolerances.fp8w(column)
    tol = dict(tolerances.column(column), **{"numerics.logits": tolerances.value("fp8w.logits", col),
                                             "numerics.hidden": tolerances.value("fp8w.hidden", col)})
    result = score(blocks, source.model(), stream, params, tol, geo, engine.model.w.vocab_offset, full_vocab=full)
    out = Scores()
    for (check, cls), w in result.scores.table.items():
        if check in ("numerics.logits", "numerics.hidden", "numerics.kl"):
            out.table[("fp8w." + check.split(".")[1], cls)] = w
    return out


def agreement(engine, ref: RefSpec, case: Case, params, out, acc, round_ratio, tol_rel) -> list[Row]:
    ref_out, ref_acc = reference_decode(ref, case, params)
    total = min(len(out), len(ref_out))
    i = next((j for j in range(total) if out[j] != ref_out[j]), total)
    tag = f"prompt {len(case.prompt)} tokens, seed {case.seed}, drafts {case.drafts}"
    if i < total:
        prefix = list(case.prompt) + list(out[:i])
        model = ref.model()
        logits, _ = model.forward(torch.tensor(prefix), torch.arange(len(prefix)), model.new_cache())
        bound = divergence_bound(tol_rel, float(logits[-1].abs().max()), params.temperature)
        if params.temperature == 0:  # one-hot distributions: the pick's place in the reference's logits
            gap = greedy_gap(logits[-1], out[i])
            tokens_row = Row("decode.tokens", "first_divergence", gap, bound, gap <= bound, total,
                             f"{tag}: agree on {i}/{total} tokens, then diverge at position {len(prefix)}: greedy "
                             f"picks {out[i]} vs {ref_out[i]}, the fast's {gap:.3g} below the reference's largest "
                             f"logit (bound {bound:.3g})")
        else:
            # The reference's distribution at the divergence is the forward just run (compare asks for this prefix
            # only).
            res = compare(case.prompt, out, ref_out, fast_prefill_dist(engine, params),
                          lambda _: sampling.dist(logits[-1], params), bound)
            tokens_row = Row("decode.tokens", "first_divergence", res.l1, bound, res.explained, total,
                             f"{tag}: {res}")
    else:
        tokens_row = Row("decode.tokens", "first_divergence", 0.0, 1.0, True, total, f"{tag}: agree on all {total} tokens")
    n = min(len(acc), len(ref_acc))
    r = next((j for j in range(n) if acc[j] != ref_acc[j]), n)
    if r < n:
        worst = max([v for k, v in round_ratio.items() if 0 <= k <= r] or [math.inf])
        acc_row = Row("decode.acceptance", "first_divergence", worst, 1.0, worst <= 1.0, n,
                      f"{tag}: (drafts, accepted) agree for {r}/{n} rounds, then fast {acc[r]} vs reference "
                      f"{ref_acc[r]}; worst distribution L1/bound (greedy: logit gap/bound) up to that round "
                      f"{worst:.3g}")
    else:
        acc_row = Row("decode.acceptance", "first_divergence", 0.0, 1.0, True, n,
                      f"{tag}: acceptance sequences agree for all {n} rounds")
    return [tokens_row, acc_row]


def logprob_row(blocks, case: Case, out: list[int], logprobs: list[float], tol: float) -> Row:
    """decode.logprobs: each emitted token's reported log-probability against the reference's (float64 log-softmax of
    the raw logits, reference.speculative.model_logprobs: the model's own, docs/round.md) applied to the fast engine's
    own fp32 logits of the row that drew it, as numerics.sampler isolates the sampler: the logits themselves are
    numerics.logits'. That row is the last recorded live row at the token's previous position (a rejected draft's
    row there comes before the round that committed it); it needs the whole vocabulary (TP 1)."""
    P = len(case.prompt)
    drew = {}  # position -> the logits of the last live row recorded there
    for b in blocks:
        if b.kind in ("prefill", "verify"):
            for r, (pos, live) in enumerate(zip(b.positions, b.live)):
                if live:
                    drew[pos] = b.logits[r]
    tag = f"prompt {P} tokens, seed {case.seed}, drafts {case.drafts}"
    worst, where = 0.0, f"{tag}: no token emitted"
    for i, (token, lp) in enumerate(zip(out, logprobs)):
        if P - 1 + i not in drew:
            return Row("decode.logprobs", "emitted", math.inf, tol, False, len(out),
                       f"{tag}: no recorded row drew emitted token {i} (position {P - 1 + i})")
        want = float(model_logprobs(drew[P - 1 + i])[token])
        if abs(lp - want) >= worst:
            worst, where = abs(lp - want), f"{tag}: emitted token {i}: {lp:.7g} against {want:.7g}"
    return Row("decode.logprobs", "emitted", worst, tol, worst <= tol, len(out), where)


ORDER = ("numerics.logits", "numerics.hidden", "numerics.kl", "numerics.topk", "numerics.sampler", "numerics.router",
         "numerics.router_scores", "cache.window", "fp8w.logits", "fp8w.hidden", "fp8w.kl")


RMS_CHECKS = ("fp8w.logits", "fp8w.hidden")  # held as the RMS over a class's rows (tolerances.json says why)


def merged_rows(merged: Scores, classes: list[str]) -> list[Row]:
    """One row per (metric, class): a class no row of which was exercised fails (nothing was checked there). The
    RMS_CHECKS compare the RMS of their rows' values with the tolerance (the largest row is named beside it)."""
    rows = []
    for m in sorted({m for m, _ in merged.table}, key=ORDER.index):
        for c in classes:
            w = merged.table.get((m, c))
            if w is None:
                rows.append(Row(m, c, math.nan, math.nan, False, 0, "no rows of this class were exercised"))
            elif m in RMS_CHECKS:
                rms = math.sqrt(w.sumsq / w.rows)
                rows.append(Row(m, c, rms, w.tol, rms <= w.tol, w.rows,
                                f"RMS over {w.rows} rows; the largest, {w.value:.3g}, at {w.where}"))
            else:
                rows.append(Row(m, c, w.value, w.tol, w.failures == 0, w.rows, w.where))
    return rows


def session_rows(sessions: list[Session], classes: list[str]) -> list[Row]:
    """Numerics per (metric, class) over all sessions, then decode agreement (worst session first), then the fp8w.*
    rows of sessions scored against a BF16 source."""
    merged = Scores()
    for s in sessions:
        merged.merge(s.scores)
    rows = merged_rows(merged, classes)
    for check in ("decode.tokens", "decode.acceptance", "decode.logprobs"):
        mine = [r for s in sessions for r in s.agreement_rows if r.check == check]
        if not mine:  # decode.logprobs under tensor parallelism
            continue
        worst = max(mine, key=lambda r: (not r.passed, r.value / r.tol if r.tol else r.value))
        checked = sum(r.rows for r in mine)  # a check no session exercised fails: nothing was checked
        rows.append(Row(check, worst.cls, worst.value, worst.tol, all(r.passed for r in mine) and checked > 0,
                        checked, worst.where))
    if any(s.source_scores is not None for s in sessions):
        source = Scores()
        for s in sessions:
            source.merge(s.source_scores)
        rows += merged_rows(source, classes)
    return rows


# ---- append-one / append-eight stability ---------------------------------------------------------------------
def stability(engine: RankEngine, ref: RefSpec, prefix: list[int], extra: list[int], column: str) -> list[Row]:
    ref = ref.model()
    m = len(prefix)

    def ref_run(seq):
        logits, hidden = ref.forward(torch.tensor(seq), torch.arange(len(seq)), ref.new_cache())
        return logits[:m], hidden[:m]

    def fast_run(seq):
        engine.cache.reset()
        pos = torch.arange(len(seq), device=engine.par.device)
        logits, hidden = engine.model.forward(torch.tensor(seq, device=pos.device), pos,
                                              torch.ones_like(pos, dtype=torch.bool))
        return logits[:m].double().cpu(), hidden[:m].double().cpu()

    def rel(a, b):
        return float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())

    rows = []
    ref_tol = tolerances.value("stability.reference", "float64")
    cand_tol = tolerances.value("stability.candidate", column)
    r0, f0 = ref_run(prefix), fast_run(prefix)
    off = engine.model.w.vocab_offset
    for name, n in (("append1", 1), ("append8", 8)):
        seq = prefix + extra[:n]
        r1, f1 = ref_run(seq), fast_run(seq)
        rv = max(rel(r1[0], r0[0]), rel(r1[1], r0[1]))
        fv = max(rel(f1[0], f0[0]), rel(f1[1], f0[1]))
        err = rel(f1[0], r1[0][:, off:off + f1[0].shape[1]])
        rows.append(Row("stability.reference", name, rv, ref_tol, rv <= ref_tol, m,
                        f"float64 reference, positions 0..{m - 1} of a {m}-token prefix, +{n} token(s)"))
        rows.append(Row("stability.candidate", name, fv, cand_tol, fv <= cand_tol, m,
                        f"variation {fv:.3g} beside error vs reference {err:.3g} at the same positions "
                        f"(reported, never added to a tolerance)"))
    return rows


# ---- lossless sampling ------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def micro_fixture() -> str:
    from ..fixtures.make import make_fixture

    out = Path(tempfile.mkdtemp(prefix="iquest-qualify-micro-")) / "micro"
    make_fixture("micro", out, seed=0)
    return str(out)


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (closed forms for integer dof)."""
    if x <= 0:
        return 1.0
    h = x / 2
    if dof % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, dof // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(h) / math.gamma(1.5)
    for i in range(1, (dof + 1) // 2):
        total += math.exp(-h) * term
        term *= h / (i + 0.5)
    return total


def exact_second_token(model_dir: str, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    ref = reference(model_dir)
    V = ref.config.vocab_size
    logits, _ = ref.forward(torch.tensor(prompt), torch.arange(len(prompt)), ref.new_cache())
    p1 = sampling.dist(logits[-1], params)
    out = torch.zeros(V, dtype=torch.float64)
    for t1, w in zip(p1.ids.tolist(), p1.probs.tolist()):
        seq = prompt + [t1]
        lg, _ = ref.forward(torch.tensor(seq), torch.arange(len(seq)), ref.new_cache())
        p2 = sampling.dist(lg[-1], params)
        out[p2.ids] += w * p2.probs
    return out


def lossless(samples: int, options: EngineOptions = EngineOptions(dtype="fp32", kernels="torch"),
             parts: EngineParts = EngineParts(), drafts: int = 3, device: str = "cpu", seed: int = 0,
             progress: Callable[[int, int], None] | None = None) -> tuple[Row, dict]:
    """Chi-square of the first speculative token (output index 1) against its exact distribution, over the request
    seeds (seed << 32) + i, i < samples (`seed`: the run's --seed, so each run draws its own sample), drawn by one
    rank of the candidate's engine (`options`: its dtype, kernels, router fold and kernel settings) on the micro
    fixture. `progress(done, samples)` after each request."""
    model_dir = micro_fixture()
    engine = RankEngine(model_dir, Parallel.single(device),
                        replace(options, max_context=64, graphs=False, shared_gpu=False, weights="auto"), parts)
    g = engine.generation
    params = SamplingParams(g.temperature, min(g.top_k, engine.config.vocab_size), g.top_p)
    prompt = [3, 5, 2, 7, 1, 4]
    expected = exact_second_token(model_dir, prompt, params) * samples
    counts = torch.zeros_like(expected)
    replaced = rejected = 0
    for i in range(samples):
        req = Request(tuple(prompt), (seed << 32) + i, params.temperature, params.top_k, params.top_p, 2, drafts, ())
        steps = list(engine.decode(req))
        counts[steps[1].tokens[0]] += 1
        rejected += steps[1].accepted < steps[1].drafts   # the replacement branch ran this round
        replaced += steps[1].accepted == 0                # ... and drew the tested token
        if progress is not None:
            progress(i + 1, samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]) if (~big).any() else counts[big]
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]) if (~big).any() else expected[big]
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    pval = chi2_sf(stat, dof)
    alpha = tolerances.entry("lossless", "speculative_token")["alpha"]
    need = tolerances.entry("lossless", "replacement_runs")["min"]
    passed = pval >= alpha and replaced >= need
    where = (f"micro preset, {samples} requests (seeds {seed} << 32 + i), drafts {drafts}: chi2 {stat:.1f} on {dof} dof, p = {pval:.2e}; "
             f"replacement branch ran in {rejected} rounds ({replaced} drew the tested token)")
    fallbacks = getattr(engine.model.ops, "fallbacks", {})
    if fallbacks:  # the micro preset's 8-wide blocks and heads are below what some kernels take
        where += (f"; kernels {engine.plan.name}: op groups on their torch forms for this model's shapes: "
                  f"{sorted(fallbacks)}")
    info = {"p_value": pval, "chi2": stat, "dof": dof, "samples": samples, "seed": seed, "replacement_rounds": rejected,
            "replacement_drew_tested_token": replaced, "observed": counts.tolist(), "expected": expected.tolist()}
    # The verdict is on the p-value; the tolerance column shows alpha (a p-value below it fails).
    return Row("lossless", "speculative_token", pval, alpha, passed, samples, where), info

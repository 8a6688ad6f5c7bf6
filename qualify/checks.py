"""The checks of `iquest qualify`, each producing rows of (check, class, worst error, tolerance, verdict).

- decode sessions: one real decode of the fast engine, recorded and replayed against the float64 reference
  (per-position numerics, qualify/replay.py), and compared with the reference's own decode of the same request
  (tokens and acceptance sequences until the first divergence, each divergence explained: qualify/agreement.py);
- stability: the same prefix alone, +1 and +8 tokens, on both engines;
- lossless: chi-square of the first speculative token against its exact distribution (micro preset).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from ..fast.cache import StaticKV, layer_slots
from ..fast.parallel import Parallel
from ..fast.plan import KernelPlan
from ..fast.rank import PREFILL_BLOCK, EngineOptions, EngineParts, RankEngine, Request, cache_capacity
from ..reference.config import Config
from ..reference import sampling
from ..reference.model import ReferenceModel
from ..reference.sampling import SamplingParams
from ..reference.speculative import generate
from . import tolerances
from .agreement import compare
from .replay import Recorder, Scores, score


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
def reference(model_dir: str) -> ReferenceModel:
    return ReferenceModel.load(model_dir)


def params_for(engine: RankEngine) -> SamplingParams:
    g = engine.generation
    return SamplingParams(g.temperature, g.top_k, g.top_p)


@dataclass(frozen=True)
class Case:
    prompt: tuple[int, ...]
    seed: int
    drafts: int | str
    max_new_tokens: int


@dataclass
class Session:
    """One recorded decode of the fast engine and what the checks made of it."""

    case: Case
    steps: list
    blocks: list
    scores: Scores
    round_ratio: dict
    ring: int
    params: SamplingParams
    agreement_rows: list[Row] = field(default_factory=list)


def _tokens(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def _acceptance(steps) -> list[tuple[int, int]]:
    return [(s.drafts, s.accepted) for s in steps[1:]]


@lru_cache(maxsize=None)
def reference_decode(model_dir: str, case: Case, params: SamplingParams) -> tuple:
    from ..reference.depth import load_controller

    controller = load_controller(model_dir) if case.drafts == "auto" else None  # the model's own rule, as fast/
    steps = list(generate(reference(model_dir), list(case.prompt), seed=case.seed, params=params,
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


def reference_dist(model_dir: str, params: SamplingParams):
    model = reference(model_dir)

    def dist(prefix):
        logits, _ = model.forward(torch.tensor(prefix), torch.arange(len(prefix)), model.new_cache())
        return sampling.dist(logits[-1], params)
    return dist


def sliding_ring(config: Config, options: EngineOptions, cache: type[StaticKV] = StaticKV) -> int:
    """Slots of a main sliding layer's ring under `options` with the cache class `cache` (a negative control's may
    hold fewer spare slots); the whole capacity when no layer slides."""
    sliding = any(config.layer_type(i) == "sliding_attention" for i in range(config.num_hidden_layers))
    return layer_slots(config, "sliding_attention" if sliding else "full_attention", cache_capacity(options),
                       cache.ring_slack)


def record(engine: RankEngine, case: Case, run=None, taps: bool = False) -> tuple[SamplingParams, list, list]:
    """Decode `case` on `engine` (or through `run(req)`) under a Recorder: (params, steps, recorded blocks)."""
    params = params_for(engine)
    req = Request(case.prompt, case.seed, params.temperature, params.top_k, params.top_p, case.max_new_tokens,
                  case.drafts, ())
    runner, _ = engine.runner(case.drafts, params.top_k)
    rec = Recorder(engine, runner, taps)
    with rec.active():
        steps = list((run or engine.decode)(req))
    return params, steps, rec.blocks


def decode_session(engine: RankEngine, model_dir: str, case: Case, tol: str, run=None,
                   dist_engine: RankEngine | None = None) -> Session:
    """`engine`: the (rank-0) engine recorded; `run(req)`: how a request is decoded (default engine.decode; a
    FastEngine's generate under TP); `dist_engine`: a single-rank engine for fresh-prefill distributions."""
    params, steps, blocks = record(engine, case, run, taps=True)  # draft taps: numerics.router
    out = _tokens(steps)
    stream = list(case.prompt) + out
    tol_rel = tolerances.value("numerics.logits", tol)
    ref = reference(model_dir)
    ring = sliding_ring(engine.config, engine.options, type(engine.cache))
    result = score(blocks, ref, stream, params, tol_rel, engine.config.sliding_window, ring,
                   engine.model.w.vocab_offset, full_vocab=engine.par.world == 1,
                   sampler_tol=tolerances.value("numerics.sampler", tol),
                   router_tol=tolerances.value("numerics.router", tol),
                   window_tol=tolerances.value("cache.window", tol))
    session = Session(case, steps, blocks, result.scores, result.round_ratio, ring, params)
    session.agreement_rows = agreement(dist_engine or engine, model_dir, case, params, out, _acceptance(steps), result.round_ratio,
                                       tol_rel)
    return session


def agreement(engine, model_dir, case: Case, params, out, acc, round_ratio, tol_rel) -> list[Row]:
    ref_out, ref_acc = reference_decode(model_dir, case, params)
    t = params.temperature if params.temperature > 0 else 1.0
    total = min(len(out), len(ref_out))
    i = next((j for j in range(total) if out[j] != ref_out[j]), total)
    tag = f"prompt {len(case.prompt)} tokens, seed {case.seed}, drafts {case.drafts}"
    if i < total:
        prefix = list(case.prompt) + list(out[:i])
        logits, _ = reference(model_dir).forward(torch.tensor(prefix), torch.arange(len(prefix)),
                                                 reference(model_dir).new_cache())
        bound = 2 * tol_rel * float(logits[-1].abs().max()) / t
        # The reference's distribution at the divergence is the forward just run (compare asks for this prefix only).
        res = compare(case.prompt, out, ref_out, fast_prefill_dist(engine, params),
                      lambda _: sampling.dist(logits[-1], params), bound)
        tokens_row = Row("decode.tokens", "first_divergence", res.l1, bound, res.explained, total, f"{tag}: {res}")
    else:
        tokens_row = Row("decode.tokens", "first_divergence", 0.0, 1.0, True, total, f"{tag}: agree on all {total} tokens")
    n = min(len(acc), len(ref_acc))
    r = next((j for j in range(n) if acc[j] != ref_acc[j]), n)
    if r < n:
        worst = max([v for k, v in round_ratio.items() if 0 <= k <= r] or [math.inf])
        acc_row = Row("decode.acceptance", "first_divergence", worst, 1.0, worst <= 1.0, n,
                      f"{tag}: (drafts, accepted) agree for {r}/{n} rounds, then fast {acc[r]} vs reference "
                      f"{ref_acc[r]}; worst distribution L1/bound up to that round {worst:.3g}")
    else:
        acc_row = Row("decode.acceptance", "first_divergence", 0.0, 1.0, True, n,
                      f"{tag}: acceptance sequences agree for all {n} rounds")
    return [tokens_row, acc_row]


def session_rows(sessions: list[Session], classes: list[str]) -> list[Row]:
    """Numerics per (metric, class) over all sessions, then decode agreement (worst session first)."""
    merged = Scores()
    for s in sessions:
        merged.merge(s.scores)
    rows = []
    metrics = sorted({m for m, _ in merged.table},
                     key=lambda m: ("logits", "hidden", "kl", "topk", "sampler", "router", "window").index(m.split(".")[1]))
    for m in metrics:
        for c in classes:
            if m == "numerics.router" and not c.startswith("draft_depth"):
                continue  # the draft layer's router only (qualify/router.py)
            w = merged.table.get((m, c))
            if w is None:
                rows.append(Row(m, c, math.nan, math.nan, False, 0, "no rows of this class were exercised"))
            else:
                rows.append(Row(m, c, w.value, w.tol, w.failures == 0, w.rows, w.where))
    for check in ("decode.tokens", "decode.acceptance"):
        mine = [r for s in sessions for r in s.agreement_rows if r.check == check]
        worst = max(mine, key=lambda r: (not r.passed, r.value / r.tol if r.tol else r.value))
        rows.append(Row(check, worst.cls, worst.value, worst.tol, all(r.passed for r in mine),
                        sum(r.rows for r in mine), worst.where))
    return rows


# ---- append-one / append-eight stability ---------------------------------------------------------------------
def stability(engine: RankEngine, model_dir: str, prefix: list[int], extra: list[int], tol: str) -> list[Row]:
    ref = reference(model_dir)
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
    cand_tol = tolerances.value("stability.candidate", tol)
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


def lossless(dtype: str, samples: int, parts: EngineParts = EngineParts(), drafts: int = 3,
             device: str = "cpu", kernels: str | KernelPlan = "torch") -> tuple[Row, dict]:
    """Chi-square of the first speculative token (output index 1) against its exact distribution."""
    model_dir = micro_fixture()
    engine = RankEngine(model_dir, Parallel.single(device),
                        EngineOptions(max_context=64, dtype=dtype, graphs=False, kernels=kernels), parts)
    g = engine.generation
    params = SamplingParams(g.temperature, min(g.top_k, engine.config.vocab_size), g.top_p)
    prompt = [3, 5, 2, 7, 1, 4]
    expected = exact_second_token(model_dir, prompt, params) * samples
    counts = torch.zeros_like(expected)
    replaced = rejected = 0
    for seed in range(samples):
        req = Request(tuple(prompt), seed, params.temperature, params.top_k, params.top_p, 2, drafts, ())
        steps = list(engine.decode(req))
        counts[steps[1].tokens[0]] += 1
        rejected += steps[1].accepted < steps[1].drafts   # the replacement branch ran this round
        replaced += steps[1].accepted == 0                # ... and drew the tested token
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
    where = (f"micro preset, {samples} requests, drafts {drafts}: chi2 {stat:.1f} on {dof} dof, p = {pval:.2e}; "
             f"replacement branch ran in {rejected} rounds ({replaced} drew the tested token)")
    fallbacks = getattr(engine.model.ops, "fallbacks", {})
    if fallbacks:  # the micro preset's 8-wide blocks and heads are below what some kernels take
        where += (f"; kernels {engine.plan.name}: op groups on their torch forms for this model's shapes: "
                  f"{sorted(fallbacks)}")
    info = {"p_value": pval, "chi2": stat, "dof": dof, "samples": samples, "replacement_rounds": rejected,
            "replacement_drew_tested_token": replaced, "observed": counts.tolist(), "expected": expected.tolist()}
    # The verdict is on the p-value; the tolerance column shows alpha (a p-value below it fails).
    return Row("lossless", "speculative_token", pval, alpha, passed, samples, where), info

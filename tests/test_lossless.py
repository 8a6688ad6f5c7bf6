"""Speculative decoding is lossless: the decisive statistical test of reference/speculative.py.

What is compared
    The joint distribution of the first L = 5 emitted tokens (the prefill's first token, then round
    tokens) of `generate(..., drafts=3, controller=FixedDepth(3))` over N request seeds, against the
    EXACT target distribution: every continuation of length L is enumerated with its probability
    prod_j p_j(x_j), where p_j = `sampling.dist` of the main model's logits for prompt + x_<j, each
    computed by a fresh-cache `forward` over the whole prefix (float64, independent of the decoder's
    KV bookkeeping and of the verification block). L = 5 = first token + 3 accepted drafts + bonus, so
    a first round that accepts everything puts its bonus token inside the window.

Statistic
    Pearson chi-square goodness of fit. Cells (length-5 sequences) are sorted by expected count,
    ascending, and consecutive cells are pooled until each pool expects >= 5 (the last remainder joins
    the previous pool); the pooling depends only on the exact distribution, never on the data, so the
    statistic is chi-square with (pools - 1) df under H0. A sequence outside the exact support (an
    emitted token the target gives probability 0) makes the test fail outright.
    N = 600 seeds (0..599) per run; alpha = 1e-3 for the correct rules (plain and speculative);
    a negative control must give p < 1e-6.

Model (micro preset, vocab 8, random_weights(seed=2, lm_head_gain=1.0)), with three edits that turn
the random fixture into a "noisy bigram" model on which drafting is worth something:
    * token embeddings x2, so the residual stream is dominated by the current token;
    * the MTP eh_proj = [I | 0]: the draft layer reads the token embedding, as the target's residual does;
    * lm_head row sigma(x) += 0.7 * e_x / |e_x| with sigma(x) = x + 3 mod 8: token x prefers to be
      followed by sigma(x) (a permutation without short cycles), so consecutive positions have
      different distributions (otherwise a bonus drawn from the previous draft's q would be harmless).
    Sampling: temperature 1, top_k 8, top_p 0.8 (top-p truncation is active: asserted on the rows
    of the enumeration). With these, drafts are accepted often but not always (a replacement inside
    the window in ~70% of requests, a bonus in ~30%), and the joint of 5 tokens has
    a few dozen cells (24 pools, 23 df).

Negative controls (each must FAIL the same test, with its broken branch counted as taken in >= 5%
of the runs, inside the compared window):
    FromP      replacement drawn from p instead of normalize(max(0, p - q));
    Inverted   acceptance ratio q/p instead of p/q;
    BonusFromQ the bonus token drawn from the last draft's q instead of p_k.

Observed (this model, N = 600, 2 loaded CPU cores): plain chi2 = 22.8 on 23 df, p = 0.47;
speculative chi2 = 18.3 on 23 df, p = 0.74 (426/600 runs with a replacement and 174/600 with a bonus
inside the window). FromP p = 3e-20 (chi2 = 148); Inverted and BonusFromQ emit tokens the target
cannot (307 and 94 runs outside the support: p = 0), and on the runs inside the support alone they
still give p = 2e-39 and 2e-18 (printed as a diagnostic, not asserted).

CI form and full form: CI runs each test on seeds 0..299 (N_CI); `pytest -m slow` runs them on 0..599 (N). The
power argument for the smaller N: a defect moves the chi-square by its non-centrality lambda = N * sum (p1 - p0)^2 / p0,
linear in N. FromP, the one control that stays inside the support, measured chi2 = 148 on 23 df at N = 600
(lambda ~ 125) and chi2 = 72.1 on 20 df at N = 300 (lambda ~ 52, p = 8e-8, 12x below BROKEN_P); Inverted and
BonusFromQ leave the support in 162 and 41 of 300 runs (p = 0). So the CI form still catches every control with
margin, and a healthy rule's p (0.44 at N = 300) is far from ALPHA; what it gives up is the power against a defect
under half FromP's size, which the full form keeps (lambda ~ 60 at N = 600 for such a defect).

Speed: the reference decodes a micro request in ~15-20 ms CPU. The per-request uniforms are the
project's own `rng.rand(seed, offsets)` for the whole offset range the request can touch, computed in
one vectorized call and looked up by `rng.offset(position, purpose, depth)`: bit-identical to
`RequestRNG.uniform` (asserted), ~10x cheaper than one Philox call per decision. Each variant is its
own test so pytest-xdist spreads them over workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from iquest.fixtures.make import preset_config, random_weights
from iquest.reference import rng as rngmod
from iquest.reference import sampling, speculative
from iquest.reference.checkpoint import layer_prefix
from iquest.reference.depth import FixedDepth
from iquest.reference.model import ReferenceModel
from iquest.reference.sampling import Dist, SamplingParams
from iquest.reference.speculative import Rules, generate

L = 5                      # first token + 3 accepted drafts + bonus
N = 600                    # request seeds per run of the full-power form (`pytest -m slow`)
N_CI = 300                 # the CI form's seeds 0..299 (the power argument in the module docstring)
K = 3                      # FixedDepth(3)
ALPHA = 1e-3               # significance for the correct rules
BROKEN_P = 1e-6            # a negative control must fall below this
MIN_BRANCH_SHARE = 0.05    # a control's broken branch must run (inside the window) in >= 5% of runs
MIN_EXPECTED = 5.0         # pooling threshold
PROMPT = [1, 2, 3, 4, 5, 6]  # 6 > sliding_window 4: the sliding layer's window is already full
PARAMS = SamplingParams(temperature=1.0, top_k=8, top_p=0.8)


# ---- the model ---------------------------------------------------------------------------------
def bigram_micro(seed: int = 2, gain: float = 1.0, embed_scale: float = 2.0, pull: float = 0.7) -> ReferenceModel:
    """The micro preset turned into a noisy bigram model (module docstring); weights are real float64."""
    config = preset_config("micro")
    w = random_weights(config, seed, lm_head_gain=gain)
    H, V = config.hidden_size, config.vocab_size
    emb = w["model.embed_tokens.weight"].to(torch.float64) * embed_scale
    w["model.embed_tokens.weight"] = emb
    w[layer_prefix(config.mtp_layer_index) + "eh_proj.weight"] = torch.cat(
        [torch.eye(H), torch.zeros(H, H)], 1).to(torch.float64)
    head = w["lm_head.weight"].to(torch.float64)
    for x in range(V):
        head[(x + 3) % V] += pull * emb[x] / emb[x].norm()
    w["lm_head.weight"] = head
    return ReferenceModel(config, w)


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return bigram_micro()


@dataclass
class Exact:
    probs: dict[tuple[int, ...], float]
    rows: int          # target rows enumerated
    truncated: int     # rows where top-p dropped tokens (top_k = vocab, so only top-p truncates)


def exact_joint(model: ReferenceModel, prompt: list[int], params: SamplingParams, length: int) -> Exact:
    """Every continuation of `length` tokens with its exact target probability (fresh cache per prefix)."""
    probs: dict[tuple[int, ...], float] = {}
    counter = {"rows": 0, "truncated": 0}
    V = model.config.vocab_size

    def row(prefix: tuple[int, ...]) -> Dist:
        seq = prompt + list(prefix)
        logits, _ = model.forward(torch.tensor(seq), torch.arange(len(seq)), model.new_cache())
        d = sampling.dist(logits[-1], params)
        counter["rows"] += 1
        counter["truncated"] += d.ids.numel() < min(params.top_k, V)
        return d

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == length:
            probs[prefix] = mass
            return
        d = row(prefix)
        for t, pt in zip(d.ids.tolist(), d.probs.tolist()):
            walk(prefix + (t,), mass * pt)

    walk((), 1.0)
    return Exact(probs, counter["rows"], counter["truncated"])


@pytest.fixture(scope="module")
def exact(model) -> Exact:
    return exact_joint(model, PROMPT, PARAMS, L)


# ---- fast, bit-identical uniforms -------------------------------------------------------------------
class TableRNG:
    """RequestRNG with every uniform of positions [lo, hi) precomputed by one `rng.rand` call."""

    lo, hi = len(PROMPT), len(PROMPT) + L + 2 * (K + 1)

    def __init__(self, seed: int):
        self.seed = seed
        start = self.lo * rngmod.SLOTS_PER_POSITION
        stop = self.hi * rngmod.SLOTS_PER_POSITION
        self.start = start
        self.table = rngmod.rand(seed, torch.arange(start, stop, dtype=torch.int64)).tolist()

    def uniform(self, position: int, purpose: int, depth: int = 0) -> float:
        i = rngmod.offset(position, purpose, depth) - self.start
        if not 0 <= i < len(self.table):
            raise AssertionError(f"position {position} outside the precomputed range [{self.lo}, {self.hi})")
        return self.table[i]


def test_table_rng_is_request_rng():
    for seed in (0, 7, 599):
        fast, slow = TableRNG(seed), rngmod.RequestRNG(seed)
        for pos in range(TableRNG.lo, TableRNG.hi):
            for purpose, depth in [(rngmod.PURPOSE_COMMIT, 0), (rngmod.PURPOSE_ACCEPT, 0)] + \
                    [(rngmod.PURPOSE_DRAFT, d) for d in range(1, 8)]:
                assert fast.uniform(pos, purpose, depth) == slow.uniform(pos, purpose, depth)


# ---- sampling and the test ------------------------------------------------------------------------
@dataclass
class Sampled:
    counts: dict[tuple[int, ...], int]
    runs: int = 0
    replacements: int = 0   # runs with >= 1 rejection whose replacement token is inside the window
    bonuses: int = 0        # runs with >= 1 all-accepted round whose bonus token is inside the window


def sample(model, drafts: int, rules: Rules = Rules(), seeds=range(N)) -> Sampled:
    out = Sampled({})
    orig = speculative.RequestRNG
    speculative.RequestRNG = TableRNG
    try:
        for seed in seeds:
            toks: list[int] = []
            rep = bon = False
            for step in generate(model, PROMPT, seed=seed, params=PARAMS, max_new_tokens=L, drafts=drafts,
                                 controller=FixedDepth(K) if drafts else None, rules=rules):
                if step.drafts and len(step.tokens) == step.accepted + 1:  # its last token is in the window
                    bon |= step.bonus
                    rep |= not step.bonus
                toks += step.tokens
            assert len(toks) == L
            out.runs += 1
            out.replacements += rep
            out.bonuses += bon
            out.counts[tuple(toks)] = out.counts.get(tuple(toks), 0) + 1
    finally:
        speculative.RequestRNG = orig
    return out


def chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> tuple[float, int, float]:
    """(statistic, df, p) with cells pooled in ascending expected count until each pool expects >= 5.
    p = 0 when a sampled sequence has target probability 0."""
    n = sum(counts.values())
    if any(seq not in probs for seq in counts):  # a token the target could never emit
        return float("inf"), 0, 0.0
    cells = sorted(probs, key=lambda s: (probs[s], s))
    pools_e, pools_o, e, o = [], [], 0.0, 0
    for s in cells:
        e += probs[s] * n
        o += counts.get(s, 0)
        if e >= MIN_EXPECTED:
            pools_e.append(e)
            pools_o.append(o)
            e, o = 0.0, 0
    if e > 0 or o > 0:
        pools_e[-1] += e
        pools_o[-1] += o
    E, O = np.array(pools_e), np.array(pools_o, dtype=float)
    stat = float(((O - E) ** 2 / E).sum())
    df = len(E) - 1
    return stat, df, float(stats.chi2.sf(stat, df))


# ---- broken rules (negative controls) ---------------------------------------------------------------
@dataclass(frozen=True)
class FromP(Rules):
    def replacement(self, p: Dist, q: Dist) -> Dist:
        return p


@dataclass(frozen=True)
class Inverted(Rules):
    def accept(self, p: Dist, q: Dist, token: int, u: float) -> bool:
        pt = p.prob(token)
        return True if pt == 0 else u < min(1.0, q.prob(token) / pt)


@dataclass(frozen=True)
class BonusFromQ(Rules):
    def bonus(self, p_last: Dist, q_last: Dist) -> Dist:
        return q_last


# ---- tests ----------------------------------------------------------------------------------------
def test_exact_enumeration(exact):
    assert abs(sum(exact.probs.values()) - 1.0) < 1e-12
    assert exact.truncated > 0, "top-p never truncated a target row: the test would not exercise it"
    assert 10 <= len(exact.probs) <= 2000


def test_plain_sampling_matches_target(model, exact):
    s = sample(model, drafts=0)
    stat, df, p = chi_square(s.counts, exact.probs)
    print(f"plain: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p > ALPHA, f"plain sampling departs from the exact target distribution: chi2={stat:.1f} df={df} p={p:.3g}"


SIZES = [pytest.param(N_CI, id="ci"), pytest.param(N, id="full", marks=pytest.mark.slow)]


@pytest.mark.parametrize("n", SIZES)
def test_speculative_matches_target(model, exact, n):
    s = sample(model, drafts=K, seeds=range(n))
    stat, df, p = chi_square(s.counts, exact.probs)
    print(f"speculative: chi2={stat:.1f} df={df} p={p:.3g} replacements={s.replacements} bonuses={s.bonuses}")
    # Both branches of the round must actually be exercised inside the window.
    assert s.replacements >= MIN_BRANCH_SHARE * n and s.bonuses >= MIN_BRANCH_SHARE * n
    assert p > ALPHA, f"speculative decoding is not lossless: chi2={stat:.1f} df={df} p={p:.3g}"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rules, branch", [(FromP(), "replacements"), (Inverted(), "replacements"),
                                           (BonusFromQ(), "bonuses")], ids=["FromP", "Inverted", "BonusFromQ"])
def test_negative_control_fails(model, exact, rules, branch, n):
    s = sample(model, drafts=K, rules=rules, seeds=range(n))
    stat, df, p = chi_square(s.counts, exact.probs)
    taken = getattr(s, branch)
    outside = sum(c for seq, c in s.counts.items() if seq not in exact.probs)
    inside = {seq: c for seq, c in s.counts.items() if seq in exact.probs}
    # Diagnostic only: the same test on the runs that stayed inside the support (power beyond support).
    print("  in-support runs only: chi2=%.1f df=%d p=%.3g" % chi_square(inside, exact.probs))
    print(f"{type(rules).__name__}: chi2={stat:.1f} df={df} p={p:.3g} {branch}={taken}/{s.runs} "
          f"outside the target support={outside}")
    assert taken >= MIN_BRANCH_SHARE * n, f"the broken branch ran in only {taken}/{s.runs} runs"
    assert p < BROKEN_P, f"the test failed to detect {type(rules).__name__}: p={p:.3g}"

"""Speculative decoding is lossless: the decisive statistical test of reference/speculative.py.

What is compared
    The joint distribution of the first L = 5 emitted tokens (the prefill's first token, then round
    tokens) of `generate(..., drafts=3, controller=FixedDepth(3))` over N request seeds, against the
    EXACT target distribution: every continuation of length L is enumerated with its probability
    prod_j p_j(x_j), where p_j = `sampling.dist` of the main model's logits for prompt + x_<j, each
    computed by a fresh-cache `forward` over the whole prefix (float64, independent of the decoder's
    KV bookkeeping and of the verification block). L = 5 = first token + 3 accepted drafts + bonus, so
    a first round that accepts everything puts its bonus token inside the window. The drafts come from
    the recursive MTP layer as docs/round.md places it: depth 0 over the whole prompt (row p consumes the
    target's post-norm h_p and the token x_{p+1}, the last row the first output token), then one row per
    further depth at the next position, fed the previous depth's output and its sampled token.

Statistic
    Pearson chi-square goodness of fit. Cells (length-5 sequences) are sorted by expected count,
    ascending, and consecutive cells are pooled until each pool expects >= 5 (the last remainder joins
    the previous pool); the pooling depends only on the exact distribution, never on the data, so the
    statistic is chi-square with (pools - 1) df under H0. A sequence outside the exact support (an
    emitted token the target gives probability 0) makes the test fail outright.
    N = 600 seeds (0..599) in the full form; alpha = 1e-3 for the correct rules (plain and speculative);
    a negative control must give p < 1e-6.

Model (the micro preset of the published architecture: vocab 8, hidden 16, a sliding dense layer 0 and a full MoE
layer 1, partial RoPE, the sink key, windows of 4 for the target and the draft; random_weights(seed=2,
lm_head_gain=1.0), FP8 dequantized), with edits that turn the random fixture into a "noisy bigram" model on which
drafting is worth something:
    * token embeddings x2, so the residual stream is dominated by the current token;
    * lm_head row sigma(x) += 0.7 * e_x / |e_x| with sigma(x) = x + 3 mod 8: token x prefers to be
      followed by sigma(x) (a permutation without short cycles), so consecutive positions have
      different distributions (otherwise a bonus drawn from the previous draft's q would be harmless);
    * the draft's own mtp/embed_tokens and mtp/lm_head hold copies of those two, and its eh_proj = [I | 0]: the
      draft layer reads the embedding of the token x_{p+1} it is given and predicts x_{p+2} with the same pull.
    Sampling: temperature 1, top_k 8, top_p 0.8 (top-p truncation is active: asserted on the rows
    of the enumeration). With these, drafts are accepted often but not always (a replacement inside
    the window in ~65% of requests, a bonus in ~35%), and the joint of 5 tokens has 64 cells
    (30 pools at N = 300, 40 at N = 600).

Negative controls (each must FAIL the same test, with its broken branch counted as taken in >= 5%
of the runs, inside the compared window):
    FromP      replacement drawn from p instead of normalize(max(0, p - q));
    Inverted   acceptance ratio q/p instead of p/q;
    BonusFromQ the bonus token drawn from the last draft's q instead of p_k.

Observed (this model, one CPU thread): at N = 600, plain chi2 = 51.4 on 39 df (p = 0.09), speculative chi2 = 42.1 on
39 df (p = 0.34; 383/600 runs with a replacement and 217/600 with a bonus inside the window); FromP p = 2e-43
(chi2 = 308); Inverted and BonusFromQ emit tokens the target cannot (331 and 71 runs outside the support: p = 0),
and on the runs inside the support alone they still give p = 2e-61 and 4e-11 (printed as a diagnostic, not
asserted).

CI form and full form: CI runs each test on seeds 0..299 (N_CI); `pytest -m slow` runs them on 0..599 (N). The
power argument for the smaller N: a defect moves the chi-square by its non-centrality lambda = N * sum (p1 - p0)^2 / p0,
linear in N. FromP, the one control that stays inside the support, measured chi2 = 308 on 39 df at N = 600 and
chi2 = 146 on 29 df at N = 300 (p = 1e-17, 11 orders below BROKEN_P); Inverted and BonusFromQ leave the support in
165 and 36 of 300 runs (p = 0). So the CI form still catches every control with margin, and a healthy rule's p
(0.37 speculative, 0.15 plain at N = 300) is far from ALPHA; what it gives up is the power against a defect under
half FromP's size, which the full form keeps.

Speed: the reference decodes a micro request in ~15 ms on one CPU thread (~5 s per 300 requests; the CI form of the
whole module takes ~25 s). The per-request uniforms are the project's own `rng.rand(seed, offsets)` for the whole
offset range the request can touch, computed in one vectorized call and looked up by `rng.offset(position, purpose,
depth)`: bit-identical to `RequestRNG.uniform` (asserted), ~10x cheaper than one Philox call per decision. Each
variant is its own test so pytest-xdist could spread them over workers (the project runs a module per worker).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from iquest.fixtures.make import preset_config, random_weights
from iquest.reference import rng as rngmod
from iquest.reference import sampling, speculative
from iquest.reference.checkpoint import DRAFT
from iquest.reference.depth import FixedDepth
from iquest.reference.model import ReferenceModel
from iquest.reference.sampling import Dist, SamplingParams
from iquest.reference.speculative import Rules, generate
from iquest.tests.helpers import chi_square

L = 5                      # first token + 3 accepted drafts + bonus
N = 600                    # request seeds per run of the full-power form (`pytest -m slow`)
N_CI = 300                 # the CI form's seeds 0..299 (the power argument in the module docstring)
K = 3                      # FixedDepth(3)
ALPHA = 1e-3               # significance for the correct rules
BROKEN_P = 1e-6            # a negative control must fall below this
MIN_BRANCH_SHARE = 0.05    # a control's broken branch must run (inside the window) in >= 5% of runs
PROMPT = [1, 2, 3, 4, 5, 6]  # 6 > the windows (4): the sliding layer's and the draft's are already full
PARAMS = SamplingParams(temperature=1.0, top_k=8, top_p=0.8)


# ---- the model ---------------------------------------------------------------------------------
def bigram_micro(seed: int = 2, gain: float = 1.0, embed_scale: float = 2.0, pull: float = 0.7) -> ReferenceModel:
    """The micro preset turned into a noisy bigram model (module docstring); weights are real float64."""
    config = preset_config("micro")
    w = dict(ReferenceModel(config, random_weights(config, seed, lm_head_gain=gain)).w)  # FP8 dequantized
    H, V = config.hidden_size, config.vocab_size
    emb = w["model.embed_tokens.weight"] * embed_scale
    head = w["lm_head.weight"].clone()
    for x in range(V):
        head[(x + 3) % V] += pull * emb[x] / emb[x].norm()
    w["model.embed_tokens.weight"], w["lm_head.weight"] = emb, head
    # the draft's own embedding and head: copies of the target's (its own tensors, equal values)
    w[DRAFT + "embed_tokens.weight"], w[DRAFT + "lm_head.weight"] = emb.clone(), head.clone()
    w[DRAFT + "mtp.eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1).to(torch.float64)
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


SIZES = [pytest.param(N_CI, id="ci"), pytest.param(N, id="full", marks=pytest.mark.slow)]


@pytest.mark.parametrize("n", SIZES)
def test_plain_sampling_matches_target(model, exact, n):
    s = sample(model, drafts=0, seeds=range(n))
    stat, df, p = chi_square(s.counts, exact.probs)
    print(f"plain: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p > ALPHA, f"plain sampling departs from the exact target distribution: chi2={stat:.1f} df={df} p={p:.3g}"


class RecordingModel:
    """A model wrapper that records every draft call's (tokens, positions) and returns the real results."""

    def __init__(self, model: ReferenceModel):
        self.model, self.config, self.calls = model, model.config, []

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, positions, cache):
        return self.model.forward(tokens, positions, cache)

    def draft(self, tokens, hidden, positions, cache):
        self.calls.append((tokens.tolist(), positions.tolist()))
        return self.model.draft(tokens, hidden, positions, cache)


def test_draft_rows_sit_where_round_md_puts_them(model):
    """The decoder this test certifies drafts at docs/round.md's positions: after the prefill, depth 0 over positions
    0..m-1 with the tokens x_1..x_m (the last the first output token); depth d >= 1 one row at m-1+d with the draft
    just sampled; after a round that commits a+1 tokens, depth 0 over the a+1 positions n..n+a."""
    rec = RecordingModel(model)
    steps = list(generate(rec, PROMPT, seed=3, params=PARAMS, max_new_tokens=12, drafts=K, controller=FixedDepth(K)))
    call, committed = iter(rec.calls), list(PROMPT)
    for i, step in enumerate(steps[:-1]):
        committed += step.tokens
        n = len(committed) - 1  # x_n: the newest committed token, not yet run through the target
        start = 0 if i == 0 else n - len(step.tokens)
        toks, pos = next(call)
        assert pos == list(range(start, n)) and toks == committed[start + 1:], f"depth 0 after step {i}"
        nxt = steps[i + 1]
        for d in range(1, nxt.drafts):  # depth d: one row at n-1+d consuming draft d
            toks, pos = next(call)
            assert pos == [n - 1 + d] and len(toks) == 1, f"depth {d} after step {i}"
            if d <= nxt.accepted:
                assert toks == [nxt.tokens[d - 1]]
    assert next(call, None) is None
    assert sum(s.drafts for s in steps) > sum(s.accepted for s in steps) > 0


class Always:
    def __init__(self, answer: bool):
        self.answer, self.depths = answer, []

    def more(self, f) -> bool:
        self.depths.append(f.depth)
        return self.answer


@pytest.mark.parametrize("answer, k", [(False, 3), (True, 7)])
def test_a_round_drafts_3_to_7_whatever_the_controller_says(model, answer, k):
    """docs/round.md: drafts d_1..d_3 always run; the controller is asked after each of d_3..d_6, never after d_7."""
    ctl = Always(answer)
    steps = list(generate(model, PROMPT, seed=1, params=PARAMS, max_new_tokens=20, drafts=K, controller=ctl))
    assert {s.drafts for s in steps[1:]} == {k}
    assert set(ctl.depths) == ({3} if not answer else {3, 4, 5, 6})


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

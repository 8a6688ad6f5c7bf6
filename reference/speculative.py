"""Speculative decoding with the recursive MTP draft layer: docs/round.md in code.

`generate` yields one `Step` per round (and one for the first token after prefill). The rule of the
round, verify -> accept -> settle -> draft, reads top to bottom in `speculative_round`.
Uniforms come from the request's counter-based RNG, keyed by (position, purpose, depth), so a
position's decision does not depend on how the work was batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch

from . import sampling
from .depth import MAX_DRAFTS, MIN_DRAFTS, DraftFeatures, FixedDepth
from .rng import PURPOSE_ACCEPT, PURPOSE_COMMIT, PURPOSE_DRAFT, RequestRNG
from .sampling import Dist, SamplingParams


class Controller(Protocol):
    def more(self, f: DraftFeatures) -> bool: ...


@dataclass(frozen=True)
class Rules:
    """The three rules that make speculative sampling lossless. Tests swap in broken ones
    (negative controls) to prove the lossless test can fail."""

    def accept(self, p: Dist, q: Dist, token: int, u: float) -> bool:
        return sampling.accept(p, q, token, u)

    def replacement(self, p: Dist, q: Dist) -> Dist:
        return sampling.residual(p, q)

    def bonus(self, p_last: Dist, q_last: Dist) -> Dist:
        return p_last


@dataclass
class Step:
    """What one round (or the prefill) emitted, with the statistics users and tests read."""

    tokens: list[int]
    logprobs: list[float]          # log p(token) under the model at its position (log-softmax of the raw logits)
    drafts: int = 0                # drafts verified this round (0 for prefill / plain sampling)
    accepted: int = 0
    served_probs: list[float] = field(default_factory=list)  # q_i(d_i) of the verified drafts
    bonus: bool = False            # every draft accepted and the target's extra row supplied a token
    stopped: bool = False
    # per token, when generate(top_logprobs=N) asks: the model's N most likely (id, log p) at its position
    # distribution at its position, in Dist order; fewer where top-k/top-p left fewer tokens
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def cut(self, n: int) -> None:
        """Keep the first n tokens (a budget or a stop id ended the decode inside this Step)."""
        self.tokens, self.logprobs = self.tokens[:n], self.logprobs[:n]
        if self.top_logprobs is not None:
            self.top_logprobs = self.top_logprobs[:n]


@dataclass
class _Drafts:
    tokens: list[int]
    dists: list[Dist]


def _entropy(d: Dist) -> float:
    p = d.probs[d.probs > 0]
    return float(-(p * p.log()).sum())


def model_logprobs(logits_row: torch.Tensor) -> torch.Tensor:
    """The model's own log-probabilities [V] at a position: log-softmax of its raw logits in float64, before
    temperature, top-k and top-p (what a token's logprob reports, as vLLM's default; docs/round.md)."""
    return torch.log_softmax(logits_row.double(), dim=-1)


class SpeculativeDecoder:
    """One request's decode state over a reference model (anything with forward/draft/new_cache)."""

    def __init__(self, model, params: SamplingParams, seed: int, controller: Controller,
                 rules: Rules = Rules(), redraft: bool = True, top_logprobs: int = 0):
        self.model, self.params, self.controller, self.rules = model, params, controller, rules
        self.rng = RequestRNG(seed)
        self.redraft = redraft  # False only in the "depth-0 redraft skipped" negative control
        self.top_logprobs = top_logprobs
        self.cache = model.new_cache()
        self.seq: list[int] = []

    def _dist(self, logits_row: torch.Tensor) -> Dist:
        return sampling.dist(logits_row, self.params)

    def _tops(self, lps: list[torch.Tensor]) -> list[list[tuple[int, float]]] | None:
        """Step.top_logprobs of tokens drawn at positions with these model log-probabilities [V]: the N most likely,
        ties to the lower id."""
        if not self.top_logprobs:
            return None
        n = self.top_logprobs
        return [[(int(t), float(lp[t])) for t in torch.sort(-lp, stable=True).indices[:n]] for lp in lps]

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int]) -> tuple[Step, torch.Tensor]:
        """Run the prompt, draw the first token, return it and the prompt's final hiddens."""
        m = len(prompt)
        logits, hidden = self.model.forward(torch.tensor(prompt), torch.arange(m), self.cache)
        p, lp = self._dist(logits[-1]), model_logprobs(logits[-1])
        first = sampling.draw(p, self.rng.uniform(m, PURPOSE_COMMIT))
        self.seq = list(prompt) + [first]
        return Step([first], [float(lp[first])], top_logprobs=self._tops([lp])), hidden

    # ---- drafting -------------------------------------------------------------------------------
    def draft(self, start: int, main_hidden: torch.Tensor) -> _Drafts:
        """Depth 0 over rows at positions start..n-1 (row p: the target's hidden h_p and the token x_{p+1}), then one
        row per further depth at the next position (the previous depth's output and its draft). Drafts 1-3 always
        run; the controller decides 4-7 (whatever it answers, a round drafts 3 to 7)."""
        n = len(self.seq) - 1
        positions = torch.arange(start, n)
        logits, h = self.model.draft(torch.tensor(self.seq[start + 1:]), main_hidden, positions, self.cache)
        tokens, dists, product = [], [], 1.0
        while True:
            depth = len(tokens) + 1
            q = self._dist(logits[-1])
            d = sampling.draw(q, self.rng.uniform(n + depth, PURPOSE_DRAFT, depth))
            tokens.append(d)
            dists.append(q)
            product *= q.prob(d)
            # docs/round.md: d_1..d_3 always run, the controller decides after each of d_3..d_6, never past d_7
            if depth >= MAX_DRAFTS or (depth >= MIN_DRAFTS
                                       and not self.controller.more(DraftFeatures(depth, q.prob(d), _entropy(q),
                                                                                  product))):
                return _Drafts(tokens, dists)
            logits, h = self.model.draft(torch.tensor([d]), h[-1:], torch.tensor([n + depth - 1]), self.cache)

    # ---- one round ------------------------------------------------------------------------------
    def speculative_round(self, drafts: _Drafts) -> tuple[Step, torch.Tensor]:
        n, k = len(self.seq) - 1, len(drafts.tokens)
        # 1. Verify: x_n and the k drafts at positions n..n+k; row i gives p_i for position n+i+1.
        rows = torch.tensor([self.seq[n]] + drafts.tokens)
        logits, hidden = self.model.forward(rows, torch.arange(n, n + k + 1), self.cache)
        p = [self._dist(logits[i]) for i in range(k + 1)]
        lp = [model_logprobs(logits[i]) for i in range(k + 1)]  # row i: the model at position n+i+1
        # 2. Accept d_i with probability min(1, p(d)/q(d)); at the first rejection draw the
        #    replacement from normalize(max(0, p - q)); if all pass, the extra row gives a bonus.
        out: list[int] = []
        logprobs: list[float] = []
        bonus = False
        for i, (d, q) in enumerate(zip(drafts.tokens, drafts.dists), start=1):
            if self.rules.accept(p[i - 1], q, d, self.rng.uniform(n + i, PURPOSE_ACCEPT)):
                out.append(d)
                logprobs.append(float(lp[i - 1][d]))
                continue
            r = sampling.draw(self.rules.replacement(p[i - 1], q), self.rng.uniform(n + i, PURPOSE_COMMIT))
            out.append(r)
            logprobs.append(float(lp[i - 1][r]))
            break
        else:
            b = sampling.draw(self.rules.bonus(p[k], drafts.dists[-1]), self.rng.uniform(n + k + 1, PURPOSE_COMMIT))
            out.append(b)
            logprobs.append(float(lp[k][b]))
            bonus = True
        a = len(out) - 1
        # 3. Settle: main KV is valid through n+a; later rows are stale and get overwritten before
        #    any query can read them (a query at t reads only positions <= t).
        self.seq += out
        served = [q.prob(d) for d, q in zip(drafts.tokens, drafts.dists)]
        return Step(out, logprobs, k, a, served, bonus, top_logprobs=self._tops(lp[: a + 1])), hidden[: a + 1]


def controller_for(drafts: int | str, model_dir=None) -> Controller:
    if drafts == "auto":
        from .depth import load_controller

        return load_controller(model_dir)
    return FixedDepth(int(drafts))


def generate(model, prompt: Sequence[int], *, seed: int, params: SamplingParams = SamplingParams(),
             max_new_tokens: int = 64, drafts: int | str = "auto", controller: Controller | None = None,
             stop_ids: Sequence[int] = (), rules: Rules = Rules(), redraft: bool = True,
             top_logprobs: int = 0) -> Iterator[Step]:
    """Decode one request. `drafts=0` is plain autoregressive sampling (the lossless baseline).
    `top_logprobs=N` also gives each token's N most likely alternatives (`Step.top_logprobs`)."""
    if len(prompt) < 1:
        raise ValueError("the prompt must hold at least one token")
    limit = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens + 8 > limit:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"context of {limit} positions (8 reserved for the verification block)")
    if controller is None and drafts != 0:
        controller = controller_for(drafts, getattr(model, "model_dir", None))  # "auto": the model's fitted rule
    if top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
    dec = SpeculativeDecoder(model, params, seed, controller, rules, redraft, top_logprobs)
    step, hidden = dec.prefill(prompt)
    emitted = 0
    while True:
        if len(step.tokens) > max_new_tokens - emitted:  # the budget cuts this round short
            step.cut(max_new_tokens - emitted)
            step.bonus = False  # the bonus token, if any, was the last one and is gone
        for j, t in enumerate(step.tokens):
            if t in stop_ids:
                step.cut(j + 1)
                step.stopped = True
                break
        emitted += len(step.tokens)
        yield step
        if step.stopped or emitted >= max_new_tokens:
            return
        if drafts == 0:
            step, hidden = _plain_step(dec)
            continue
        n = len(dec.seq) - 1
        committed = hidden.shape[0]  # the rows whose target hiddens are new: positions n-committed..n-1
        start = n - committed if dec.redraft or step.drafts == 0 else n - 1
        drafted = dec.draft(start, hidden[-(n - start):])
        step, hidden = dec.speculative_round(drafted)


def _plain_step(dec: SpeculativeDecoder) -> tuple[Step, torch.Tensor]:
    n = len(dec.seq) - 1
    logits, hidden = dec.model.forward(torch.tensor([dec.seq[n]]), torch.tensor([n]), dec.cache)
    p, lp = dec._dist(logits[-1]), model_logprobs(logits[-1])
    t = sampling.draw(p, dec.rng.uniform(n + 1, PURPOSE_COMMIT))
    dec.seq.append(t)
    return Step([t], [float(lp[t])], top_logprobs=dec._tops([lp])), hidden

"""Sampling of one speculative round on the device (docs/round.md): `reference/sampling.py` as fixed-shape float32 math.

Every function works on R rows at once (8 verification rows or 1 draft row) and stays usable inside a
CUDA graph: no host sync, no data-dependent shape, no Python branch on a tensor value. temperature and
top_p are 0-dim device tensors (a request changes them without recapture); top_k is a static int.

A distribution is a pair `ids [R, K] int64, probs [R, K] float32` in Dist order (descending
probability, ties: lower id). Where the reference's sparse `Dist` is shorter, the extra entries carry
probability 0 and sit at the end of the order, so every inverse-CDF walk sees the reference's tokens in
the reference's order.

Ordering uses one int64 *rank key* per (value, id): the float32 bits mapped to an order-preserving
int32 in the high word, `0xFFFFFFFF - id` in the low word. Keys are unique, so `topk`/`sort` on them
are exact and deterministic (no reliance on tie order), and a key carries its value and id both: under
tensor parallelism the ranks all-gather one int64 tensor of candidate keys.

Dist order of `dist()` is the order of the logits (descending, ties: lower id). The exact
probabilities are a strictly increasing function of the logits, so this is exactly the Dist order; a
re-sort by float32 probabilities would instead invent ties (and id-ordered swaps) wherever rounding
makes two nearby probabilities equal.
"""

from __future__ import annotations

from typing import Callable

import torch

_LOW = 0xFFFFFFFF
_ABS = 0x7FFFFFFF


# ---- rank keys ---------------------------------------------------------------------------------
def _keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (value descending, id ascending) as plain descending integers.

    values float32 (not NaN), ids int64 in [0, 2**32). -0.0 is folded onto +0.0 (they compare equal).
    """
    v = torch.where(values == 0, 0.0, values.to(torch.float32)).contiguous()
    bits = v.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ _ABS, bits)  # negative floats: flip magnitude bits
    return (ordered << 32) | (_LOW - ids)


def unkey(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, ids int64) of rank keys: the inverse of `_keys`."""
    ordered = keys >> 32  # arithmetic shift: the signed high word
    bits = torch.where(ordered < 0, ordered ^ _ABS, ordered)
    return bits.to(torch.int32).view(torch.float32), _LOW - (keys & _LOW)


def _local_keys(logits: torch.Tensor, k: int, vocab_offset: int) -> torch.Tensor:
    """Rank keys of this rank's top-min(k, Vr) logits [R, Vr], global ids, in rank-key order."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [R, Vr], got {logits.dtype} {tuple(logits.shape)}")
    ids = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64) + vocab_offset
    return torch.topk(_keys(logits, ids), min(k, logits.shape[1]), dim=-1, sorted=True).values


def local_candidates(logits: torch.Tensor, k: int, vocab_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's top-k (values [R, k'], global ids [R, k'] int64), k' = min(k, Vr); descending, ties: lower id.

    logits [R, Vr] float32 hold global tokens [vocab_offset, vocab_offset + Vr).
    """
    return unkey(_local_keys(logits, k, vocab_offset))


# ---- the sampling distribution -----------------------------------------------------------------
def _dist_from_keys(keys: torch.Tensor, top_k: int, temperature: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/round.md's dist() of the candidates whose rank keys are `keys` [R, C]."""
    K = min(top_k, keys.shape[-1])
    values, ids = unkey(torch.topk(keys, K, dim=-1, sorted=True).values)  # global top-k, Dist order
    # Softmax of values / T, shifted by the max (column 0) so that no temperature overflows exp().
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    e = torch.exp((values - values[:, :1]) / t)
    probs = e / e.sum(-1, keepdim=True)
    # Greedy (T == 0): one-hot on column 0, the highest logit with the lowest id.
    first = torch.arange(K, device=keys.device) == 0
    probs = torch.where(temperature == 0, first.to(probs.dtype).expand_as(probs), probs)
    kept = torch.where(_top_p_keep(probs, top_p), probs, torch.zeros_like(probs))
    return ids, kept / kept.sum(-1, keepdim=True)


def _top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask of the shortest prefix of probs [R, K] (Dist order) whose mass reaches top_p.

    A token stays while the mass before it is still below top_p, so the crossing token stays (and all
    stay when rounding keeps the total below top_p). Probabilities are non-increasing along the order,
    so the dropped tokens (probability 0 from here on) form a suffix and the order stays Dist order.
    """
    cum = torch.cumsum(probs, -1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], -1)
    return before < top_p


def global_dist(values: torch.Tensor, ids: torch.Tensor, top_k: int, temperature: torch.Tensor,
                top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dist() of R rows from their gathered candidates: values [R, C] float32, global ids [R, C] int64.

    The candidates must contain each row's global top_k (ties: lower id): every rank's local top-top_k
    does. Returns ids [R, K] int64 and probs [R, K] float32 in Dist order, K = min(top_k, C); entries
    cut by top-p keep their place with probability 0. temperature == 0 is greedy.
    """
    if values.shape != ids.shape or values.dim() != 2:
        raise ValueError(f"values and ids must both be [R, C], got {tuple(values.shape)}, {tuple(ids.shape)}")
    return _dist_from_keys(_keys(values, ids), top_k, temperature, top_p)


def sample_rows(local_logits: torch.Tensor, k: int, vocab_offset: int, gather: Callable[[torch.Tensor], torch.Tensor],
                top_k: int, temperature: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocabulary-parallel dist(): local top-k -> all-gather -> the same global dist on every rank.

    gather: [R, k] int64 -> [R, tp*k] int64, concatenating the ranks' tensors along the last dim in rank
    order (an all-gather; the identity for tp = 1). One collective: a rank key holds value and id.
    k: candidates per rank, at least min(top_k, Vr) (normally top_k itself).
    """
    vr = local_logits.shape[-1]
    if min(k, vr) < min(top_k, vr):
        raise ValueError(f"each rank must contribute min(top_k, Vr)={min(top_k, vr)} candidates, got k={k}")
    return _dist_from_keys(gather(_local_keys(local_logits, k, vocab_offset)), top_k, temperature, top_p)


# ---- the model's own log-probabilities ---------------------------------------------------------------
def logprob_parts(x: torch.Tensor, tokens: torch.Tensor, vocab_offset: int) -> torch.Tensor:
    """A rank's part of `model_logprobs`: [R, 1 + m] int64, its log-normalizer over its logits x [R, Vr] fp32 and
    the logits of the tokens [R, m] it holds (-inf for the others), each an fp32's bits (kernels/logprobs.py is this
    in one launch)."""
    vr = x.shape[-1]
    peak = x.amax(-1, keepdim=True)
    lse = peak + torch.log(torch.exp(x - peak).sum(-1, keepdim=True))  # this rank's log-normalizer [R, 1]
    local = tokens - vocab_offset
    held = (local >= 0) & (local < vr)
    values = torch.where(held, x.gather(-1, local.clamp(0, vr - 1)), torch.full_like(local, float("-inf"),
                                                                                     dtype=torch.float32))
    return torch.cat([lse, values], -1).contiguous().view(torch.int32).to(torch.int64)


def model_logprobs(local_logits: torch.Tensor, tokens: torch.Tensor, n_top: int, vocab_offset: int,
                   gather: Callable[[torch.Tensor], torch.Tensor], local_parts: Callable | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The model's log-probabilities (log-softmax of the raw logits over the whole vocabulary: no temperature, top-k
    or top-p; reference.speculative.model_logprobs) of tokens [R, m], and with n_top > 0 each row's n_top most
    likely tokens (ids [R, n_top], logprobs [R, n_top]; ties: lower id). Vocabulary-parallel: each rank's
    log-normalizer, its logits of the tokens it holds (-inf elsewhere) and its top-n_top keys travel in one all-gather
    (the floats as their bits), and every rank combines the same gathered values in rank order: equal bits.
    `local_parts`: how a rank makes its part (`logprob_parts`'s contract; default that torch form)."""
    x = local_logits.float()
    R = x.shape[0]
    floats = (local_parts or logprob_parts)(x, tokens, vocab_offset)
    parts = [floats] + ([_local_keys(x, n_top, vocab_offset)] if n_top else [])
    width = sum(p.shape[-1] for p in parts)
    g = gather(torch.cat(parts, -1) if n_top else floats)
    g = g.view(R, g.shape[-1] // width, width)  # [R, ranks, width]
    f = g[..., :floats.shape[-1]].to(torch.int32).view(torch.float32)
    total = torch.logsumexp(f[..., 0], dim=-1, keepdim=True)  # [R, 1]
    token_lp = f[..., 1:].amax(dim=1) - total  # exactly one rank holds each token
    if not n_top:
        return token_lp, None, None
    top_values, top_ids = unkey(torch.topk(g[..., floats.shape[-1]:].reshape(R, -1), n_top, dim=-1).values)
    return token_lp, top_ids, top_values - total


# ---- draws and probabilities -------------------------------------------------------------------
def draw(ids: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in Dist order: per row, the first token whose cumulative probability exceeds u [R].

    If rounding leaves u at or above the total, the last token of positive probability.
    """
    cum = torch.cumsum(probs, -1)
    first_above = (cum <= u.unsqueeze(-1)).sum(-1)  # cum is non-decreasing
    last_positive = (probs > 0).sum(-1) - 1  # positive probabilities form a prefix
    i = torch.minimum(first_above, last_positive).clamp(min=0)
    return torch.gather(ids, -1, i.unsqueeze(-1)).squeeze(-1)


def prob_of(ids: torch.Tensor, probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Probability of token [R] under each row's distribution (0 where it is outside the support)."""
    hit = ids == token.unsqueeze(-1)
    return torch.where(hit, probs, torch.zeros_like(probs)).sum(-1)


def residual(p_ids: torch.Tensor, p_probs: torch.Tensor, q_ids: torch.Tensor,
             q_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """normalize(max(0, p - q)) per row, in Dist order; p itself where that has no mass.

    max(0, p - q) vanishes outside p's support, so the result lives on p's candidate ids ([R, Kp]).
    """
    same = p_ids.unsqueeze(-1) == q_ids.unsqueeze(-2)  # [R, Kp, Kq]
    q_at_p = torch.where(same, q_probs.unsqueeze(-2), torch.zeros_like(q_probs).unsqueeze(-2)).sum(-1)
    r = torch.clamp(p_probs - q_at_p, min=0.0)
    total = r.sum(-1, keepdim=True)
    has_mass = total > 0
    r = r / torch.where(has_mass, total, torch.ones_like(total))
    r_probs, r_ids = unkey(torch.sort(_keys(r, p_ids), dim=-1, descending=True).values)
    return torch.where(has_mass, r_ids, p_ids), torch.where(has_mass, r_probs, p_probs)


# ---- the accept step ---------------------------------------------------------------------------
def acceptance(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor,
               live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts d_1..d_7 in order until the first rejection: d_i passes when u_i < min(1, p(d_i) / q(d_i)).

    p_d, q_d, u: [..., 7] float32 (target and proposal probability of each draft, its acceptance
    uniform); live: [..., 7] bool, the drafts actually generated (a prefix). Returns the accepted mask
    (the leading run of live passing drafts) and a = its length (int64, [...]); a dead draft always stops
    the run, whatever its inputs hold.
    """
    q_safe = torch.where(live, q_d, torch.ones_like(q_d))
    passes = live & (u < torch.clamp(p_d / q_safe, max=1.0))
    accepted = torch.cumprod(passes.to(torch.int64), -1).bool()
    return accepted, accepted.sum(-1)


def commit_dist(p_ids: torch.Tensor, p_probs: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                a: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution the round's last token is drawn from: ([1, Kp] ids, [1, Kp] probs).

    p: the k_max+1 verification rows ([k_max+1, Kp], row i = p_i); q: the k_max proposals ([k_max, Kq],
    row i = q_{i+1}); a: accepted drafts, k: live drafts (0-dim int64, a <= k). A rejection (a < k) is
    replaced from residual(p_a, q_{a+1}); with all k accepted the bonus comes from p_k. Only row a's
    residual is formed (0-dim indices go through index_select: plain indexing may read them on the host).
    """
    pa_ids, pa_probs = p_ids.index_select(0, a.view(1)), p_probs.index_select(0, a.view(1))
    qi = a.clamp(max=q_ids.shape[0] - 1).view(1)  # a = k_max has no proposal after it: its residual is unused
    r_ids, r_probs = residual(pa_ids, pa_probs, q_ids.index_select(0, qi), q_probs.index_select(0, qi))
    rejected = a < k
    return torch.where(rejected, r_ids, pa_ids), torch.where(rejected, r_probs, pa_probs)

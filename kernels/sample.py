"""Global top-k/top-p and the draw, and the accept step, as kernels (docs/round.md; seed: "Include sampling and
acceptance in the execution path").

`fast.sampler` is the contract; these kernels compute the same float32 math with the same orderings:

- `global_sample`: one program per row over the ranks' gathered candidate keys [R, C] (C = tp * k, rank
  order; `kernels.topk.local_topk_keys` makes them): the global top-k by rank key (ties: lower id),
  softmax of values / temperature, top-p (the crossing token stays), renormalize, and the inverse-CDF
  draw with `tl.rand(seed, offset)`, the uniform `fast.philox.uniforms` gives. Every rank runs it on
  the same keys and uniforms, so every rank draws the same token. Without offsets it only builds the
  distribution (the verification rows: their draws happen in the accept step).
- `accept_settle`: one program for the whole round's decision: acceptance of up to 7 drafts
  (u < min(1, p/q), leading run), the replacement from normalize(max(0, p - q)) or the bonus from p_k,
  the commit draw at position n+a+1, and the emitted tokens settle takes.
  Uniforms: `reference.rng.offset` layout, position * 16 + slot (slot 0 commit, 1 accept).

Both read temperature, top_p, seed, n and k from device tensors (no host sync, graph-capturable).
Dist order needs no sort in registers: the global top-k comes out of `tl.topk` in key order, and the
residual is ordered by counting, for each entry, the entries whose (probability, -id) is larger.
Arithmetic differences from torch: exp (libdevice on the GPU, NumPy's under the interpreter) and the
summation order of sums and cumulative sums; the tests bound them (1e-6) and compare draws away from
rounding boundaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import libm
from .topk import SENTINEL, _unkey
from .launch import launch_options, wait_for_inputs

INTERPRETED = libm.INTERPRETED
MAX_K = 64
MAX_DRAFTS = 7


@triton.jit
def _draw_at(probs, ok, u):
    """fast.sampler.draw's index on one row in Dist order: the first token whose cumulative probability exceeds u,
    else the last of positive probability."""
    cum = tl.cumsum(probs, 0)
    first_above = tl.sum(((cum <= u) & ok).to(tl.int32), 0)
    last_positive = tl.sum(((probs > 0) & ok).to(tl.int32), 0) - 1
    return tl.maximum(tl.minimum(first_above, last_positive), 0)


@triton.jit
def _draw(ids, probs, ok, u):
    """fast.sampler.draw on one row: the token at `_draw_at`."""
    j = tl.arange(0, probs.shape[0])
    return tl.sum(tl.where(j == _draw_at(probs, ok, u), ids, 0), 0)


# ---- global top-k / top-p / draw -----------------------------------------------------------------
@triton.jit
def _global_sample_kernel(keys_ptr, stride_keys, C, K, temp_ptr, top_p_ptr, seed_ptr, offsets_ptr,
                          ids_ptr, probs_ptr, tokens_ptr, served_ptr,
                          CP: tl.constexpr, KP: tl.constexpr, DRAW: tl.constexpr, LIBDEVICE: tl.constexpr,
                          PDL: tl.constexpr = False, GIVEN_U: tl.constexpr = False,
                          k_ptr=None, depth=0, product_ptr=None, CHAIN: tl.constexpr = False):
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    c = tl.arange(0, CP)
    keys = tl.load(keys_ptr + r * stride_keys + c, mask=c < C, other=SENTINEL)
    values, ids = _unkey(tl.topk(keys, KP))  # global top-k in Dist order (descending keys)
    j = tl.arange(0, KP)
    ok = j < K
    temperature = tl.load(temp_ptr)
    top_p = tl.load(top_p_ptr)
    # Softmax of values / T shifted by the max (column 0); T == 0 is greedy: one-hot on column 0.
    t = tl.where(temperature > 0, temperature, 1.0)
    v0 = tl.max(tl.where(j == 0, values, float("-inf")), 0)
    e = tl.where(ok, libm.exp(tl.math.div_rn(values - v0, t), LIBDEVICE), 0.0)
    probs = tl.math.div_rn(e, tl.sum(e, 0))
    probs = tl.where(temperature == 0, tl.where(j == 0, 1.0, 0.0), probs)
    # Top-p: a token stays while the mass before it is below top_p (exclusive cumulative sum).
    shifted = tl.sum(tl.where(j[None, :] == j[:, None] - 1, probs[None, :], 0.0), 1)  # probs[j - 1], exact
    kept = tl.where(ok & (tl.cumsum(shifted, 0) < top_p), probs, 0.0)
    probs = tl.math.div_rn(kept, tl.sum(kept, 0))
    tl.store(ids_ptr + r * K + j, ids, mask=ok)
    tl.store(probs_ptr + r * K + j, probs, mask=ok)
    if DRAW:
        if GIVEN_U:  # the uniforms themselves (offsets_ptr: float32 [R])
            u = tl.load(offsets_ptr + r)
        else:
            u = tl.rand(tl.load(seed_ptr), tl.load(offsets_ptr + r))
        at = j == _draw_at(probs, ok, u)
        tl.store(tokens_ptr + r, tl.sum(tl.where(at, ids, 0), 0))
        # the drawn token's probability, fast.sampler.prob_of's value: the ids are distinct, so one term
        served = tl.sum(tl.where(at, probs, 0.0), 0)
        tl.store(served_ptr + r, served)
        if CHAIN:  # a draft depth's row (R = 1): the drafts made so far, and the served probabilities' product
            tl.store(k_ptr, tl.zeros([], tl.int64) + depth)  # depth 1 arrives as a constexpr
            tl.store(product_ptr, tl.load(product_ptr) * served)


def _check(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {message}")


def _scalar(t: torch.Tensor, dtype: torch.dtype, name: str, where: str, device: torch.device) -> None:
    _check(isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == dtype and t.device == device, where,
           f"{name} must be a 0-dim {dtype} tensor on {device}")


def global_sample(keys: torch.Tensor, top_k: int, temperature: torch.Tensor, top_p: torch.Tensor,
                  seed: torch.Tensor | None = None, offsets: torch.Tensor | None = None, *,
                  uniforms: torch.Tensor | None = None, out: tuple[torch.Tensor, ...] | None = None,
                  served: torch.Tensor | None = None, chain: tuple | None = None, num_warps: int = 4,
                  pdl: bool = False):
    """dist() of R rows from their gathered candidate keys [R, C] int64, and a draw per row.

    Equal to `fast.sampler._dist_from_keys` (= `global_dist` of the unkeyed values and ids) and
    `draw(ids, probs, philox.uniforms(seed, offsets))`. temperature, top_p: 0-dim float32 tensors; seed:
    0-dim int64 (`rng.int64_bits`); offsets: [R] int32 Philox counters; or `uniforms` [R] float32, the draws'
    uniforms themselves. Returns (tokens [R] int64, ids [R, K] int64, probs [R, K] float32), K = min(top_k, C);
    without a draw, (None, ids, probs). out: preallocated (tokens, ids, probs) (tokens None without a draw; views of
    a larger buffer's rows are fine). `served` [R] float32, when drawing: receives each drawn token's probability
    (`fast.sampler.prob_of`'s value). `chain` = (k, depth, product), when drawing one row (a draft depth's): also
    k = depth (int64 0-dim) and product *= the served probability (float32 0-dim), as fast/round.py's sample_draft
    did with two torch kernels.
    """
    where = "global_sample"
    _check(keys.dim() == 2 and keys.dtype == torch.int64 and keys.stride(1) == 1, where,
           f"keys must be int64 [R, C] with unit stride, got {keys.dtype} {tuple(keys.shape)}")
    R, C = keys.shape
    dev = keys.device
    _check(R >= 1 and C >= 1, where, "empty keys")
    _check(1 <= top_k <= MAX_K, where, f"top_k must be in [1, {MAX_K}], got {top_k}")
    _scalar(temperature, torch.float32, "temperature", where, dev)
    _scalar(top_p, torch.float32, "top_p", where, dev)
    _check(offsets is None or uniforms is None, where, "give offsets (with seed) or uniforms, not both")
    draw = offsets is not None or uniforms is not None
    _check((offsets is not None) == (seed is not None), where, "seed and offsets go together")
    if offsets is not None:
        _scalar(seed, torch.int64, "seed", where, dev)
        _check(tuple(offsets.shape) == (R,) and offsets.dtype == torch.int32 and offsets.device == dev
               and offsets.is_contiguous(), where, f"offsets must be contiguous int32 [{R}] (int64 is another stream)")
    if uniforms is not None:
        _check(tuple(uniforms.shape) == (R,) and uniforms.dtype == torch.float32 and uniforms.device == dev
               and uniforms.is_contiguous(), where, f"uniforms must be contiguous float32 [{R}]")
    if served is not None:
        _check(draw and tuple(served.shape) == (R,) and served.dtype == torch.float32 and served.device == dev
               and served.is_contiguous(), where, f"served must be contiguous float32 [{R}], with a draw")
    K = min(top_k, C)
    kp = max(2, triton.next_power_of_2(K))  # tl.topk needs at least two
    cp = max(kp, triton.next_power_of_2(C))
    if out is None:
        out = (torch.empty(R, dtype=torch.int64, device=dev) if draw else None,
               torch.empty((R, K), dtype=torch.int64, device=dev), torch.empty((R, K), dtype=torch.float32, device=dev))
    tokens, ids, probs = out
    rows = lambda t: t.stride(1) == 1 and (R == 1 or t.stride(0) == K)  # row-major [R, K], e.g. rows of a buffer
    _check(tuple(ids.shape) == (R, K) and ids.dtype == torch.int64 and rows(ids)
           and tuple(probs.shape) == (R, K) and probs.dtype == torch.float32 and rows(probs), where,
           f"out ids/probs must be row-major [{R}, {K}] int64/float32")
    _check((tokens is not None) == draw, where, "out tokens must be given exactly when drawing")
    if draw:
        _check(tuple(tokens.shape) == (R,) and tokens.dtype == torch.int64 and tokens.is_contiguous(), where,
               f"out tokens must be contiguous int64 [{R}]")
    chain_args = {}
    if chain is not None:
        k, depth, product = chain
        _check(draw and R == 1, where, "chain updates a draft depth's state: one row, with a draw")
        _scalar(k, torch.int64, "chain's k", where, dev)
        _scalar(product, torch.float32, "chain's product", where, dev)
        chain_args = dict(k_ptr=k, depth=int(depth), product_ptr=product, CHAIN=True)
    u_arg = uniforms if uniforms is not None else offsets if offsets is not None else keys  # unused without a draw
    served_arg = served if served is not None else _scratch(R, dev) if draw else probs
    _global_sample_kernel[(R,)](
        keys, keys.stride(0), C, K, temperature, top_p, seed if seed is not None else keys, u_arg,
        ids, probs, tokens if draw else ids, served_arg,
        CP=cp, KP=kp, DRAW=draw, LIBDEVICE=not INTERPRETED, GIVEN_U=uniforms is not None,
        num_warps=num_warps, **chain_args, **launch_options(pdl, dev))
    return tokens, ids, probs


def _scratch(R: int, device: torch.device) -> torch.Tensor:
    """Where a draw's served probabilities go when the caller does not want them."""
    return torch.empty(R, dtype=torch.float32, device=device)


def global_dist(keys: torch.Tensor, top_k: int, temperature: torch.Tensor, top_p: torch.Tensor, **kw):
    """(ids, probs) of dist(): `global_sample` without a draw."""
    _, ids, probs = global_sample(keys, top_k, temperature, top_p, **kw)
    return ids, probs


# ---- accept and settle ---------------------------------------------------------------------------
@triton.jit
def _accept_settle_kernel(p_ids_ptr, p_probs_ptr, q_ids_ptr, q_probs_ptr, drafts_ptr, k_ptr, n_ptr, seed_ptr,
                          a_ptr, token_ptr, emitted_ptr, f_ids_ptr, f_probs_ptr,
                          Kp, Kq, KMAX,
                          ROWS: tl.constexpr, KPP: tl.constexpr, KPQ: tl.constexpr,
                          PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    i = tl.arange(0, ROWS)  # row i: p_i, and draft d_{i+1} with its proposal q_{i+1}
    cp = tl.arange(0, KPP)
    cq = tl.arange(0, KPQ)
    p_ok = (i <= KMAX)[:, None] & (cp < Kp)[None, :]
    q_ok = (i < KMAX)[:, None] & (cq < Kq)[None, :]
    P_ids = tl.load(p_ids_ptr + i[:, None] * Kp + cp[None, :], mask=p_ok, other=-1)
    P = tl.load(p_probs_ptr + i[:, None] * Kp + cp[None, :], mask=p_ok, other=0.0)
    Q_ids = tl.load(q_ids_ptr + i[:, None] * Kq + cq[None, :], mask=q_ok, other=-2)
    Q = tl.load(q_probs_ptr + i[:, None] * Kq + cq[None, :], mask=q_ok, other=0.0)
    d = tl.load(drafts_ptr + i, mask=i < KMAX, other=-3)
    n = tl.load(n_ptr)
    k = tl.load(k_ptr)
    seed = tl.load(seed_ptr)

    # Accept d_{i+1} when u < min(1, p_i(d) / q_{i+1}(d)); a = the leading run of live passing drafts.
    p_d = tl.sum(tl.where(P_ids == d[:, None], P, 0.0), 1)
    q_d = tl.sum(tl.where(Q_ids == d[:, None], Q, 0.0), 1)
    live = (i < k) & (i < KMAX)
    u_accept = tl.rand(seed, ((n + 1 + i) * 16 + 1).to(tl.int32))  # position n+i+1, slot 1
    ratio = tl.math.div_rn(p_d, tl.where(live, q_d, 1.0))
    ratio = tl.where(ratio > 1.0, 1.0, ratio)  # torch.clamp(max=1): NaN stays NaN and fails
    passes = live & (u_accept < ratio)
    a = tl.min(tl.where(passes, ROWS, i), 0)  # first failing row; row KMAX never passes

    # The commit distribution: residual(p_a, q_{a+1}) after a rejection, else p_a (= p_k, the bonus).
    pa_ids = tl.sum(tl.where(i[:, None] == a, P_ids, 0), 0)
    pa = tl.sum(tl.where(i[:, None] == a, P, 0.0), 0)
    qi = tl.minimum(a, KMAX - 1)
    qa_ids = tl.sum(tl.where(i[:, None] == qi, Q_ids, 0), 0)
    qa = tl.sum(tl.where(i[:, None] == qi, Q, 0.0), 0)
    q_at_p = tl.sum(tl.where(pa_ids[:, None] == qa_ids[None, :], qa[None, :], 0.0), 1)
    res = tl.maximum(pa - q_at_p, 0.0)
    total = tl.sum(res, 0)
    res = tl.math.div_rn(res, tl.where(total > 0, total, 1.0))
    res = tl.where(res == 0.0, 0.0, res)  # -0.0 -> 0.0, as the rank keys fold it
    p_col = cp < Kp
    # Residual Dist order: rank = entries with a larger (probability, then lower id).
    before = ((res[None, :] > res[:, None]) | ((res[None, :] == res[:, None]) & (pa_ids[None, :] < pa_ids[:, None])))
    res_rank = tl.sum((before & p_col[None, :]).to(tl.int32), 1)
    use_res = (a < k) & (total > 0)
    rank = tl.where(use_res, res_rank, cp)  # p_a keeps its own (logit) order
    f = tl.where(use_res, res, pa)
    at = rank[None, :] == cp[:, None]  # [position in Dist order, entry]
    f_ids = tl.sum(tl.where(at & p_col[None, :], pa_ids[None, :], 0), 1)
    f_probs = tl.sum(tl.where(at & p_col[None, :], f[None, :], 0.0), 1)
    u_commit = tl.rand(seed, ((n + a + 1) * 16).to(tl.int32))  # position n+a+1, slot 0
    token = _draw(f_ids, f_probs, p_col, u_commit)

    # Settle: a accepted drafts then the new token.
    emitted = tl.where(i < a, d, token)
    rows_ok = i <= KMAX
    tl.store(a_ptr, a.to(tl.int64))
    tl.store(token_ptr, token)
    tl.store(emitted_ptr + i, emitted, mask=rows_ok)
    tl.store(f_ids_ptr + cp, f_ids, mask=p_col)
    tl.store(f_probs_ptr + cp, f_probs, mask=p_col)


def accept_settle(p_ids: torch.Tensor, p_probs: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                  drafts: torch.Tensor, k: torch.Tensor, n: torch.Tensor, seed: torch.Tensor, *,
                  out: dict[str, torch.Tensor] | None = None, num_warps: int = 4,
                  pdl: bool = False) -> dict[str, torch.Tensor]:
    """The accept step of `fast.round.RoundRunner.speculative_round` (step 2) in one program.

    p_ids/p_probs [KMAX+1, Kp]: the verification rows' distributions (row i = p_i); q_ids/q_probs
    [KMAX, Kq]: the proposals (row i = q_{i+1}); drafts [KMAX] int64; k: live drafts, n: position of x_n,
    seed: 0-dim int64 tensors. KMAX <= 7. Returns a dict of device tensors:
    a (0-dim int64, accepted drafts), token (0-dim int64, the replacement or bonus: x at n+a+1),
    emitted [KMAX+1] int64 (d_1..d_a, then token), ids/probs [Kp]: the distribution the token was drawn from, in Dist order.
    """
    where = "accept_settle"
    dev = p_ids.device
    _check(p_ids.dim() == 2 and p_ids.shape == p_probs.shape and q_ids.dim() == 2 and q_ids.shape == q_probs.shape,
           where, "p and q must be [rows, K] ids/probs pairs")
    kmax, kq = q_ids.shape
    _check(1 <= kmax <= MAX_DRAFTS and p_ids.shape[0] == kmax + 1, where,
           f"need KMAX+1 p rows for KMAX <= {MAX_DRAFTS} q rows, got {tuple(p_ids.shape)}, {tuple(q_ids.shape)}")
    kp = p_ids.shape[1]
    _check(1 <= kp <= MAX_K and 1 <= kq <= MAX_K, where, f"distributions must have 1..{MAX_K} entries")
    for t, dt, name in ((p_ids, torch.int64, "p_ids"), (q_ids, torch.int64, "q_ids"),
                        (p_probs, torch.float32, "p_probs"), (q_probs, torch.float32, "q_probs"),
                        (drafts, torch.int64, "drafts")):
        _check(t.dtype == dt and t.is_contiguous() and t.device == dev, where,
               f"{name} must be contiguous {dt} on {dev}")
    _check(tuple(drafts.shape) == (kmax,), where, f"drafts must be [{kmax}]")
    for t, name in ((k, "k"), (n, "n"), (seed, "seed")):
        _scalar(t, torch.int64, name, where, dev)
    if out is None:
        i64, f32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.float32, device=dev)
        out = dict(a=torch.empty((), **i64), token=torch.empty((), **i64), emitted=torch.empty(kmax + 1, **i64),
                   ids=torch.empty(kp, **i64), probs=torch.empty(kp, **f32))
    _accept_settle_kernel[(1,)](
        p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed,
        out["a"], out["token"], out["emitted"], out["ids"], out["probs"], kp, kq, kmax,
        ROWS=triton.next_power_of_2(kmax + 1), KPP=triton.next_power_of_2(kp), KPQ=triton.next_power_of_2(kq),
        num_warps=num_warps, **launch_options(pdl, dev))
    return out

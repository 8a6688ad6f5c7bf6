"""fast/philox.py and fast/sampler.py against the float64 reference (reference/rng.py, reference/sampling.py).

Tensor parallelism is simulated on the CPU: the logits are split into tp contiguous vocabulary shards,
and the ranks' candidates are concatenated in rank order (directly, or through a threaded all-gather
for `sample_rows`). Float32 against float64: probabilities agree within TOL, and cases where the
reference's top-p cut or a draw's uniform sits within rounding of a boundary are skipped.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from iquest.fast import philox, sampler
from iquest.reference import rng
from iquest.reference.sampling import Dist, SamplingParams, accept, dist, draw, residual

TOL = 1e-5  # float32 probabilities against float64 ones (sums of at most 40 terms)
MARGIN = 1e-4  # keep uniforms and top-p this far from the reference's cumulative boundaries

# ---- philox ------------------------------------------------------------------------------------
# Rows of tests/test_rng.py's GOLDEN (Triton 3.6 under the interpreter): (seed, offset, tl.rand bits).
GOLDEN = [(0x0, 0, 0x3F4C4FD1), (0x3039, -1, 0x3ED5D272), (0x8000000000000000, 2097152, 0x3ED0407D),
          (0xFFFFFFFFFFFFFFFF, 123456789, 0x3F17CE8E)]
_int32 = st.integers(-(2**31), 2**31 - 1)


def _bits(u: torch.Tensor) -> list[int]:
    return u.view(torch.int32).tolist()


def _seed(seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(rng.int64_bits(seed), dtype=torch.int64, device=device)


def test_uniforms_golden():
    for seed, off, bits in GOLDEN:
        u = philox.uniforms(_seed(seed), torch.tensor([off], dtype=torch.int32))
        assert _bits(u) == [bits - 2**32 if bits >= 2**31 else bits]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(0, 2**64 - 1), st.integers(2**63, 2**64 - 1), st.sampled_from([0, 2**31, 2**63])),
       st.lists(_int32, min_size=1, max_size=64), st.sampled_from([torch.int32, torch.int64]))
def test_uniforms_match_reference(seed, offs, dtype):
    offsets = torch.tensor(offs, dtype=dtype)
    assert _bits(philox.uniforms(_seed(seed), offsets)) == _bits(rng.rand(seed, offsets))


def test_uniforms_shape_and_edges():
    offs = torch.tensor([[0, 1, 2**31 - 1], [-1, -(2**31), 16]], dtype=torch.int32)
    for seed in (0, 2**63, 2**64 - 1):
        u = philox.uniforms(_seed(seed), offs)
        assert u.shape == offs.shape and u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
        assert _bits(u) == _bits(rng.rand(seed, offs))
    with pytest.raises(ValueError):
        philox.uniforms(torch.tensor([0]), offs)  # not 0-dim
    with pytest.raises(ValueError):
        philox.uniforms(torch.tensor(0, dtype=torch.int32), offs)
    with pytest.raises(ValueError):
        philox.uniforms(_seed(0), offs.float())


@given(st.lists(st.integers(0, rng.MAX_POSITION), min_size=1, max_size=16),
       st.sampled_from([(rng.PURPOSE_COMMIT, 0), (rng.PURPOSE_ACCEPT, 0)]
                       + [(rng.PURPOSE_DRAFT, d) for d in range(1, rng.MAX_DRAFT_DEPTH + 1)]))
def test_offsets_match_reference(positions, purpose_depth):
    purpose, depth = purpose_depth
    pos = torch.tensor(positions, dtype=torch.int64)
    got = philox.offsets(pos, purpose, depth)
    assert got.dtype == torch.int32 and got.tolist() == [rng.offset(p, purpose, depth) for p in positions]
    if purpose == rng.PURPOSE_DRAFT:  # a per-element depth tensor gives the same counters
        assert philox.offsets(pos, purpose, torch.full_like(pos, depth)).tolist() == got.tolist()


def test_offsets_depth_tensor_and_errors():
    pos = torch.tensor([10, 11, 12], dtype=torch.int64)
    got = philox.offsets(pos, rng.PURPOSE_DRAFT, torch.tensor([1, 4, 7]))
    assert got.tolist() == [rng.offset(10, 2, 1), rng.offset(11, 2, 4), rng.offset(12, 2, 7)]
    for purpose, depth in ((rng.PURPOSE_DRAFT, 0), (rng.PURPOSE_DRAFT, 8), (rng.PURPOSE_COMMIT, 1), (3, 0),
                           (rng.PURPOSE_ACCEPT, torch.tensor([1, 1, 1]))):
        with pytest.raises(ValueError):
            philox.offsets(pos, purpose, depth)
    with pytest.raises(ValueError):
        philox.offsets(pos.to(torch.int32), rng.PURPOSE_COMMIT)


# ---- global_dist against reference.dist --------------------------------------------------------
# Logits on a 1/64 grid, made by torch from a drawn seed (cheap to generate): integers in [-3, 3] make
# exact ties (the lower-id rules) common; distinct values stay far enough apart that float64
# probabilities never tie where the logits differ. -inf is masking.
_params = st.builds(SamplingParams, temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
                    top_k=st.integers(1, 40), top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)))


def _logits(seed: int, rows: int, v: int, tied: float, masked: float, scale: float = 20.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ties = torch.randint(-3, 4, (rows, v), generator=gen).float()
    spread = torch.randint(-int(scale * 64), int(scale * 64) + 1, (rows, v), generator=gen).float() / 64
    x = torch.where(torch.rand(rows, v, generator=gen) < tied, ties, spread)
    x = torch.where(torch.rand(rows, v, generator=gen) < masked, -math.inf, x)
    x[:, int(torch.randint(v, (1,), generator=gen))] = 0.0  # every row keeps a finite logit
    return x


@st.composite
def _case(draw_, max_rows: int = 3):
    tp, vr, rows = draw_(st.sampled_from([1, 2, 4, 8])), draw_(st.integers(1, 12)), draw_(st.integers(1, max_rows))
    tied, masked = draw_(st.sampled_from([0.0, 0.5, 1.0])), draw_(st.sampled_from([0.0, 0.0, 0.2]))
    return _logits(draw_(st.integers(0, 2**32)), rows, tp * vr, tied, masked), tp, draw_(_params)


def _scalars(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(params.temperature, dtype=torch.float32), torch.tensor(params.top_p, dtype=torch.float32)


def _tp_dist(x: torch.Tensor, tp: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """global_dist over the candidates of tp simulated ranks, concatenated in rank order."""
    vr = x.shape[1] // tp
    cands = [sampler.local_candidates(x[:, r * vr:(r + 1) * vr].contiguous(), params.top_k, r * vr) for r in range(tp)]
    values, ids = torch.cat([c[0] for c in cands], -1), torch.cat([c[1] for c in cands], -1)
    return sampler.global_dist(values, ids, params.top_k, *_scalars(params))


def _clear_of_top_p(row: torch.Tensor, params: SamplingParams) -> bool:
    """False where the reference's top-p cut sits within rounding of a prefix sum (then either cut is right)."""
    if params.temperature == 0:
        return True
    full = dist(row, SamplingParams(params.temperature, params.top_k, 1.0)).probs
    cum = torch.cumsum(full, 0)
    # A cut moving past index j matters only when the token after j has visible mass.
    near = ((cum[:-1] - params.top_p).abs() < MARGIN) & (full[1:] > 1e-7)
    return not bool(near.any())


def check_row(ids: torch.Tensor, probs: torch.Tensor, ref: Dist) -> None:
    """One fast row against the reference's Dist: same tokens in the same order, probabilities within TOL.

    Only tokens of probability < TOL may be present on one side alone (float32 underflow, or a top-p = 1
    cut in float32 rounding): the longer list's tail.
    """
    assert ids.unique().numel() == ids.numel()
    nz = probs > 0
    assert bool((nz[:-1] >= nz[1:]).all()), "zero probabilities must form a suffix"
    ours_ids, ours_p = ids[nz].tolist(), probs[nz].tolist()
    ref_ids, ref_p = ref.ids.tolist(), ref.probs.tolist()
    n = min(len(ours_ids), len(ref_ids))
    assert ours_ids[:n] == ref_ids[:n], f"order differs: {ours_ids} vs reference {ref_ids}"
    assert all(abs(a - b) < TOL for a, b in zip(ours_p, ref_p)), f"{ours_p} vs reference {ref_p}"
    assert sum(ours_p[n:]) + sum(ref_p[n:]) < TOL, f"support differs: {ours_ids} vs reference {ref_ids}"
    assert abs(sum(ours_p) - 1) < TOL


@settings(max_examples=250, deadline=None)
@given(_case())
def test_global_dist_matches_reference(case):
    x, tp, params = case
    ids, probs = _tp_dist(x, tp, params)
    assert ids.shape == probs.shape == (x.shape[0], min(params.top_k, x.shape[1]))
    assert ids.dtype == torch.int64 and probs.dtype == torch.float32
    for row in range(x.shape[0]):
        assume(_clear_of_top_p(x[row], params))
        check_row(ids[row], probs[row], dist(x[row], params))


def test_ties_and_greedy():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, -1.0, 3.0]])
    t1, p1, t0 = torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0)
    for tp in (1, 2, 4, 8):
        ids, probs = _tp_dist(x, tp, SamplingParams(1.0, 3, 1.0))
        assert ids.tolist() == [[1, 2, 4]] and torch.allclose(probs, torch.full((1, 3), 1 / 3))
        ids, probs = _tp_dist(x, tp, SamplingParams(0.0, 3, 1.0))
        assert ids[0, 0] == 1 and probs.tolist() == [[1.0, 0.0, 0.0]]
    v, i = sampler.local_candidates(x, 20, 100)  # k > Vr: the whole shard
    assert i.tolist() == [[101, 102, 104, 105, 107, 100, 103, 106]] and v.shape == (1, 8)
    ids, probs = sampler.global_dist(v, i, 2, t1, p1)
    assert ids.tolist() == [[101, 102]] and probs.tolist() == [[0.5, 0.5]]
    ids, probs = sampler.global_dist(v, i, 4, t0, p1)
    assert ids[0, 0] == 101 and probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    neg = torch.tensor([[-0.0, 0.0, -math.inf, -2.5]])  # -0.0 and 0.0 tie; -inf never has mass
    ids, probs = sampler.global_dist(*sampler.local_candidates(neg, 4, 0), 4, t1, p1)
    assert ids.tolist() == [[0, 1, 3, 2]] and probs[0, 3] == 0 and probs[0, 0] == probs[0, 1]


# ---- sample_rows through a simulated all-gather ------------------------------------------------
def _run_ranks(x: torch.Tensor, tp: int, params: SamplingParams) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """sample_rows on tp threads, one per rank, joined by an all-gather that concatenates in rank order."""
    vr = x.shape[1] // tp
    slots: list[torch.Tensor | None] = [None] * tp
    barrier = threading.Barrier(tp)
    out: list = [None] * tp

    def rank(r: int) -> None:
        def gather(t: torch.Tensor) -> torch.Tensor:
            slots[r] = t.clone()
            barrier.wait()
            return torch.cat(slots, -1)
        try:
            out[r] = sampler.sample_rows(x[:, r * vr:(r + 1) * vr].contiguous(), params.top_k, r * vr, gather,
                                         params.top_k, *_scalars(params))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            barrier.abort()
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


@settings(max_examples=50, deadline=None)
@given(_case(max_rows=8))
def test_sample_rows_all_ranks_agree(case):
    x, tp, params = case
    results = _run_ranks(x, tp, params)
    ids, probs = _tp_dist(x, tp, params)
    for r_ids, r_probs in results:  # bit-identical on every rank, and to the unpacked path
        assert torch.equal(r_ids, ids) and torch.equal(r_probs.view(torch.int32), probs.view(torch.int32))


# ---- draw, prob_of ------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(_case(), st.lists(st.floats(0, 1, exclude_max=True, width=32), min_size=3, max_size=3))
def test_draw_matches_reference(case, us):
    x, tp, params = case
    ids, probs = _tp_dist(x, tp, params)
    u = torch.tensor(us[: x.shape[0]], dtype=torch.float32)
    tokens = sampler.draw(ids, probs, u)
    for row in range(x.shape[0]):
        assume(_clear_of_top_p(x[row], params))
        ref = dist(x[row], params)
        assume(bool(((torch.cumsum(ref.probs, 0) - float(u[row])).abs() > MARGIN).all()))
        assert int(tokens[row]) == draw(ref, float(u[row]))
        assert abs(float(sampler.prob_of(ids, probs, tokens)[row]) - ref.prob(int(tokens[row]))) < TOL


def test_draw_boundaries():
    ids = torch.tensor([[4, 2, 9, 7], [1, 3, 5, 6]])
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.5, 0.4999, 0.0, 0.0]])
    for u, want in ((0.0, [4, 1]), (0.4999, [4, 1]), (0.5, [2, 3]), (0.75, [9, 3]), (0.99995, [9, 3])):
        assert sampler.draw(ids, probs, torch.tensor([u, u])).tolist() == want  # never a zero-prob token
    assert sampler.prob_of(ids, probs, torch.tensor([2, 8])).tolist() == [0.25, 0.0]


# ---- residual, acceptance, commit_dist ----------------------------------------------------------
def _padded(d: Dist, width: int, pad_from: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference Dist as one fast row [1, width]: float32 probs, zero-prob padding on unused ids."""
    n = d.ids.numel()
    ids = torch.cat([d.ids, torch.arange(pad_from, pad_from + width - n)])
    probs = torch.cat([d.probs.float(), torch.zeros(width - n)])
    return ids[None], probs[None]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0.0, 0.5]), _params, _params, st.booleans())
def test_residual_matches_reference(seed, tied, pp, qp, same):
    x = _logits(seed, 2, 30, tied, 0.0, scale=8.0)
    p = dist(x[0], pp)
    q = p if same else dist(x[1], qp)
    ref = residual(p, q)
    mass = sum(max(0.0, p.prob(t) - q.prob(t)) for t in p.ids.tolist())
    assume(mass == 0 or mass > 1e-2)  # float32 inputs cannot resolve a vanishing residual
    ids, probs = sampler.residual(*_padded(p, 40, 1000), *_padded(q, 40, 2000))
    if mass == 0:
        assert ref is p
    gaps = torch.diff(ref.probs).abs()
    assume(bool((gaps > TOL).all()))  # near-equal residuals may swap order under float32 rounding
    check_row(ids[0], probs[0], ref)


def _accept_loop(p_d, q_d, u, k) -> int:
    a = 0
    while a < k and u[a] < min(1.0, p_d[a] / q_d[a]):
        a += 1
    return a


@given(st.lists(st.tuples(st.floats(0, 1, width=32), st.floats(2**-10, 1, width=32),
                          st.floats(0, 1, exclude_max=True, width=32)), min_size=7, max_size=7),
       st.integers(0, 7))
def test_acceptance(triples, k):
    p_d, q_d, u = (torch.tensor(c, dtype=torch.float32) for c in zip(*triples))
    for i in range(7):
        assume(abs(float(u[i]) - min(1.0, float(p_d[i]) / float(q_d[i]))) > 1e-6)
    live = torch.arange(7) < k
    mask, a = sampler.acceptance(p_d, q_d, u, live)
    want = _accept_loop(p_d.tolist(), q_d.tolist(), u.tolist(), k)
    event("a < k" if want < k else "a == k")
    assert a.dim() == 0 and a.dtype == torch.int64 and int(a) == want
    assert mask.tolist() == [i < want for i in range(7)]
    # Past k nothing is accepted, whatever the dead entries hold (even q = 0).
    p_bad, q_bad, u_bad = p_d.clone(), q_d.clone(), u.clone()
    p_bad[k:], q_bad[k:], u_bad[k:] = 1.0, 0.0, 0.0
    assert int(sampler.acceptance(p_bad, q_bad, u_bad, live)[1]) == want
    rows, rows_a = sampler.acceptance(p_d.expand(3, 7), q_d.expand(3, 7), u.expand(3, 7), live.expand(3, 7))
    assert rows_a.tolist() == [want] * 3 and rows.shape == (3, 7)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), _params, _params, st.integers(3, 7))
def test_commit_dist_follows_the_round(seed, pp, qp, k):
    """Drafts from q, the acceptance rule, then residual-or-bonus: commit_dist against the reference."""
    x = _logits(seed, 15, 30, 0.3, 0.0, scale=3.0)
    gen = torch.Generator().manual_seed(seed)
    us = torch.rand(14, generator=gen).tolist()
    ps = [dist(r, pp) for r in x[:8]]
    # Most proposals equal their target (always accepted), so runs reach the bonus too.
    qs = [p if bool(torch.rand(1, generator=gen) < 0.85) else dist(r, qp) for p, r in zip(ps, x[8:])]
    drafts = [draw(q, u) for q, u in zip(qs, us[:7])]
    a = 0
    while a < k and accept(ps[a], qs[a], drafts[a], us[7 + a]):
        a += 1
    # The float32 ratio test agrees with the float64 one away from its boundary.
    for i in range(k):
        assume(abs(us[7 + i] - min(1.0, ps[i].prob(drafts[i]) / qs[i].prob(drafts[i]))) > 1e-6)
    p_ids, p_probs = (torch.cat(t) for t in zip(*[_padded(p, 30, 1000) for p in ps]))
    q_ids, q_probs = (torch.cat(t) for t in zip(*[_padded(q, 30, 2000) for q in qs]))
    d = torch.tensor(drafts)
    p_d, q_d = sampler.prob_of(p_ids[:7], p_probs[:7], d), sampler.prob_of(q_ids, q_probs, d)
    _, got_a = sampler.acceptance(p_d, q_d, torch.tensor(us[7:]), torch.arange(7) < k)
    assert int(got_a) == a
    event("rejected: residual" if a < k else "all accepted: bonus")
    ref = residual(ps[a], qs[a]) if a < k else ps[a]
    if a < k:
        mass = sum(max(0.0, ps[a].prob(t) - qs[a].prob(t)) for t in ps[a].ids.tolist())
        assume(mass == 0 or mass > 1e-2)
        assume(bool((torch.diff(ref.probs).abs() > TOL).all()))
    ids, probs = sampler.commit_dist(p_ids, p_probs, q_ids, q_probs, got_a, torch.tensor(k))
    check_row(ids[0], probs[0], ref)


# ---- negative control: a top-p that drops the crossing token must be caught -------------------
def test_broken_top_p_is_caught(monkeypatch):
    x, params = torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(1.0, 20, 0.9)
    check_row(*(t[0] for t in _tp_dist(x, 2, params)), dist(x[0], params))  # the real one passes

    def drops_crossing(probs, top_p):  # keeps only the tokens strictly before the crossing one
        keep = torch.cumsum(probs, -1) < top_p
        keep[:, 0] = True
        return keep

    monkeypatch.setattr(sampler, "_top_p_keep", drops_crossing)
    with pytest.raises(AssertionError):
        check_row(*(t[0] for t in _tp_dist(x, 2, params)), dist(x[0], params))


# ---- no host sync: the whole path captured in a CUDA graph -------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_matches_eager():
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 1024, generator=gen).round(decimals=1).to(dev)  # rounding makes ties
    seed = _seed(2**63 + 5, dev)
    temperature, top_p = torch.tensor(0.7, device=dev), torch.tensor(0.9, device=dev)
    positions = torch.arange(100, 108, device=dev)
    live = torch.arange(7, device=dev) < 5

    def step():
        ids, probs = sampler.sample_rows(x, 20, 0, lambda t: t, 20, temperature, top_p)
        u = philox.uniforms(seed, philox.offsets(positions, rng.PURPOSE_COMMIT))
        tokens = sampler.draw(ids, probs, u)
        p_d = sampler.prob_of(ids[:7], probs[:7], tokens[1:])
        q_d = sampler.prob_of(ids[1:], probs[1:], tokens[1:])
        ua = philox.uniforms(seed, philox.offsets(positions[1:], rng.PURPOSE_ACCEPT))
        _, a = sampler.acceptance(p_d, q_d, ua, live)
        r = sampler.residual(ids[:7], probs[:7], ids[1:], probs[1:])
        c = sampler.commit_dist(ids, probs, ids[1:], probs[1:], a, live.sum())
        return ids, probs, u, tokens, a, *r, *c

    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t_val, p_val in ((0.7, 0.9), (0.0, 0.9), (1.3, 0.5)):  # new sampling values without recapture
        temperature.fill_(t_val)
        top_p.fill_(p_val)
        graph.replay()
        eager = step()
        for c, e in zip(captured, eager):
            assert torch.equal(c, e)
        u_cpu = philox.uniforms(_seed(2**63 + 5), positions.cpu() * rng.SLOTS_PER_POSITION)
        assert torch.equal(captured[2].cpu().view(torch.int32), u_cpu.view(torch.int32))
        params = SamplingParams(t_val, 20, p_val)
        for row in range(8):
            if _clear_of_top_p(x[row].cpu(), params):
                check_row(captured[0][row].cpu(), captured[1][row].cpu(), dist(x[row].cpu(), params))


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_model_logprobs_are_the_same_bits_on_every_rank(ranks):
    """The model's own logprobs under vocabulary parallelism: each rank contributes its slice, the gather
    concatenates in rank order, and every rank computes identical bits, equal to the float64 log-softmax of the whole
    row to fp32 rounding, with the model's top tokens (ties: lower id) as the alternatives."""
    g = torch.Generator().manual_seed(ranks)
    R, V, n_top = 3, 96, 5
    logits = torch.randn(R, V, generator=g) * 4
    logits[1, 10] = logits[1, 70] = logits[1].max() + 1  # a tie across two ranks' slices: the lower id first
    tokens = torch.tensor([[5], [70], [95]])
    vr = V // ranks
    contributions = {}

    def record(rank):  # what rank `rank` sends (its result this time is discarded)
        return lambda x: contributions.setdefault(rank, x).repeat(1, ranks)

    for r in range(ranks):  # every rank's contribution first (as the all-gather waits for all), then its result
        sampler.model_logprobs(logits[:, r * vr:(r + 1) * vr], tokens, n_top, r * vr, record(r))
    results = [sampler.model_logprobs(logits[:, r * vr:(r + 1) * vr], tokens, n_top, r * vr,
                                      lambda x: torch.cat([contributions[q] for q in range(ranks)], -1))
               for r in range(ranks)]
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))
    lp, top_ids, top_lp = results[0]
    exact = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(lp.double(), exact.gather(-1, tokens), atol=1e-5)
    want = torch.sort(-exact, dim=-1, stable=True).indices[:, :n_top]
    assert torch.equal(top_ids, want) and top_ids[1, 0] == 10 and top_ids[1, 1] == 70
    assert torch.allclose(top_lp.double(), exact.gather(-1, want), atol=1e-5)

"""kernels/sample.py against fast/sampler.py + fast/philox.py, and the accept step against its torch form
(fast/torch_ops.TorchOps.accept).

global_sample: tensor parallelism is simulated by splitting the logits into tp vocabulary shards and
concatenating each rank's local candidate keys in rank order (tp 1, 2, 8). The global ids must be
identical, the probabilities within 1e-6, and the drawn tokens identical wherever the uniform is not
within rounding (1e-5) of a cumulative boundary (the skipped draws are counted and must be rare).
Cases: 1 and 8 rows, exact ties across ranks (integer logits: equal probabilities, so top_p is kept off
multiples of 1/K, where the rounding of a cumulative sum decides the cut), greedy (T = 0), top-p 1.0 and
small, tiny and large temperatures, fewer candidates than top_k, seeds >= 2**63, offsets near the int32 limit, the whole
kernel pipeline (local_topk per rank -> global_sample) against `sampler.sample_rows` + `draw`.
The in-kernel uniforms are checked bit for bit against `philox.uniforms` through greedy-free draws.

accept_settle: kmax 7 and 3, every live count, proposals close to / far from / equal to the target
(all accepted: the bonus path), a proposal that leaves the residual without mass (the fallback to p
and a 0/0 ratio), dead rows poisoned with NaN and garbage drafts; many (seed, n) trials per case.
Outputs are pre-filled with NaN / -1. `@pytest.mark.gpu` cases use real shapes (C = 8 x 20, R = 8, 1).
The interpreter runs INTERPRETED_CASES: the same properties at one or two rows and one draw (a row's program costs it
~0.4 s a call), 8 rows and several draws once each, 3 trials a live count; the GPU runs those, CASES and GPU_CASES.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.fast import philox, sampler
from iquest.fast.torch_ops import TorchOps
from iquest.kernels import sample as sm
from iquest.kernels import topk as tk
from iquest.reference import rng
from iquest.kernels.testing import interpreted_tests

PROB_TOL = 1e-6
MARGIN = 1e-5  # draws and top-p cuts this close to a boundary may differ by rounding

BASE = dict(kind="sample", R=8, tp=8, Vr=100, k=20, top_k=20, T=1.0, top_p=0.95, scale=3.0, data="randn",
            seed=0, rng_seed=1234, draws=2, pos=1000, e2e=False, draw=True)
ABASE = dict(kind="accept", kmax=7, ks=(3, 4, 5, 6, 7), Kp=20, Kq=20, vocab=48, q="close", poison=False,
             trials=12, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


def acase(name: str, **kw) -> dict:
    return dict(ABASE, name=name, **kw)


CASES = [
    case("tp1_8rows", tp=1, Vr=300),
    case("tp2_1row", R=1, tp=2, Vr=200, draws=16),
    case("tp8_8rows", draws=4),
    case("tp8_ties", data="ties", top_p=0.82),
    case("greedy", T=0.0),
    case("greedy_ties", T=0.0, data="ties", top_p=0.82),
    case("top_p_1", top_p=1.0),
    case("top_p_small", top_p=0.05),
    case("top_p_mid_flat", top_p=0.5, scale=0.5),
    case("temperature_small", T=0.05),
    case("temperature_large", T=5.0),
    case("top_k_7", k=7, top_k=7),
    case("top_k_1", k=1, top_k=1, tp=2),
    case("fewer_candidates_than_top_k", tp=1, Vr=10),
    case("seed_high_bit", rng_seed=2**64 - 1),
    case("seed_2_63_offsets_near_int32_max", rng_seed=2**63, pos=rng.MAX_POSITION - 8),
    case("no_draw", draw=False),
    case("e2e_kernels_tp8", e2e=True, Vr=500, R=2),
    case("e2e_kernels_tp2_ties", e2e=True, tp=2, Vr=700, R=2, data="ties", top_p=0.82),
    acase("accept_close"),
    acase("accept_far", q="far"),
    acase("accept_same_bonus", q="same"),
    acase("accept_no_mass_fallback", q="no_mass", ks=(3, 5, 7)),
    acase("accept_poisoned_dead_rows", poison=True),
    acase("accept_kmax3", kmax=3, ks=(1, 2, 3)),
    acase("accept_kp20_kq16", Kq=16),
    acase("accept_kp1_greedy_target", Kp=1, ks=(3, 7)),
]

# The interpreter's set: the same properties with one or two rows and one draw (a row's program costs the
# interpreter ~0.4 s a call), eight rows once, several draws once, the kernel pipeline over one tile a rank, and 3
# trials a live count in the accept cases (enough to take each case's paths). The GPU runs these and all of the above.
INTERPRETED_CASES = [
    case("tp1_2rows", R=2, tp=1, Vr=300, draws=1),
    case("tp2_1row_4draws", R=1, tp=2, Vr=200, draws=4),
    case("8rows_tp2_1draw", tp=2, draws=1),
    case("tp8_ties_2rows", R=2, data="ties", top_p=0.82, draws=1),
    case("greedy_ties_2rows", R=2, T=0.0, data="ties", top_p=0.82, draws=1),
    case("top_p_1_1row", R=1, top_p=1.0, draws=1),
    case("top_p_small_1row", R=1, top_p=0.05, draws=1),
    case("temperature_small_1row", R=1, T=0.05, draws=1),
    case("temperature_large_1row", R=1, T=5.0, draws=1),
    case("top_k_7_1row", R=1, k=7, top_k=7, draws=1),
    case("top_k_1_1draw", k=1, top_k=1, tp=2, R=2, draws=1),
    case("fewer_candidates_than_top_k_1row", R=1, tp=1, Vr=10, draws=1),
    case("seed_high_bit_1row", R=1, rng_seed=2**64 - 1, draws=1),
    case("seed_2_63_offsets_near_int32_max_1row", R=1, rng_seed=2**63, pos=rng.MAX_POSITION - 8, draws=1),
    case("no_draw_1row", R=1, draw=False),
    case("e2e_kernels_tp8_one_tile_1row", e2e=True, Vr=150, R=1, draws=1),
    case("e2e_kernels_tp2_ties_two_tiles_1row", e2e=True, tp=2, Vr=300, R=1, data="ties", top_p=0.82, draws=1),
    *[dict(c, name=c["name"] + "_3trials", trials=3) for c in CASES if c["kind"] == "accept"],
]

GPU_CASES = [
    *INTERPRETED_CASES,
    case("gpu_tp8_8rows_k20", Vr=20000, draws=32),
    case("gpu_tp8_1row_k20", R=1, Vr=20000, draws=64),
    case("gpu_tp8_greedy", Vr=20000, T=0.0),
    case("gpu_e2e_kernels_tp8_8rows", e2e=True, Vr=20000),
    acase("gpu_accept_close", trials=64),
    acase("gpu_accept_far", q="far", trials=64),
]


# ---- global_sample ---------------------------------------------------------------------------------
def torch_sample(keys, top_k, temperature, top_p, seed=None, offsets=None):
    """(tokens or None, ids, probs): fast.sampler's distribution of the keys, and its draw with fast.philox's
    uniforms."""
    ids, probs = sampler._dist_from_keys(keys, top_k, temperature, top_p)
    tokens = None if offsets is None else sampler.draw(ids, probs, philox.uniforms(seed, offsets))
    return tokens, ids, probs


def _seed(seed: int, device: str) -> torch.Tensor:
    return torch.tensor(rng.int64_bits(seed), dtype=torch.int64, device=device)


def _logits(c: dict, gen: torch.Generator) -> torch.Tensor:
    shape = (c["R"], c["tp"] * c["Vr"])
    if c["data"] == "ties":
        return torch.randint(-3, 4, shape, generator=gen).float()
    return torch.randn(shape, generator=gen) * c["scale"]


def _near(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows whose uniform lies within MARGIN of a cumulative boundary of probs (Dist order)."""
    return ((torch.cumsum(probs, -1) - u[:, None]).abs() < MARGIN).any(-1)


def _top_p_near(keys: torch.Tensor, top_k: int, T: float, top_p: float) -> bool:
    """Whether any row's top-p cut sits within MARGIN of a cumulative probability (torch's math)."""
    values, _ = sampler.unkey(torch.topk(keys, min(top_k, keys.shape[1]), dim=-1).values)
    probs = torch.softmax(values.double() / (T if T > 0 else 1.0), -1)
    if T == 0:
        return False
    cum = torch.cumsum(probs, -1)
    return bool(((cum - top_p).abs() < MARGIN).any()) and top_p < 1.0


def run_sample(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    logits = _logits(c, gen).to(device)
    R, tp, Vr = c["R"], c["tp"], c["Vr"]
    shards = logits.split(Vr, dim=-1)
    if c["e2e"]:
        st = tk.TopKSettings(tile=256)
        keys = torch.cat([tk.local_topk_keys(s, c["k"], r * Vr, settings=st)[0] for r, s in enumerate(shards)], -1)
    else:
        keys = torch.cat([sampler._local_keys(s, c["k"], r * Vr) for r, s in enumerate(shards)], -1)
    T = torch.tensor(c["T"], device=device)
    top_p = torch.tensor(c["top_p"], device=device)
    seed = _seed(c["rng_seed"], device)
    res = dict(ids=True, prob_err=0.0, tokens_equal=0, tokens_skipped=0, tokens_differ=0, finite=True,
               top_p_near=_top_p_near(keys.cpu(), c["top_k"], c["T"], c["top_p"]))
    if c["e2e"]:  # the torch pipeline: fast.sampler.sample_rows over the same shards, torch candidates
        ref_keys = torch.cat([sampler._local_keys(s, c["k"], r * Vr) for r, s in enumerate(shards)], -1)
        res["ids"] &= torch.equal(keys, ref_keys)
        r_ids, r_probs = sampler.sample_rows(shards[0], c["k"], 0, lambda mine: ref_keys, c["top_k"], T, top_p)
    K = min(c["top_k"], keys.shape[1])
    for d in range(c["draws"] if c["draw"] else 1):
        positions = torch.arange(R, dtype=torch.int64, device=device) + c["pos"] + d * R
        offsets = philox.offsets(positions, rng.PURPOSE_COMMIT) if c["draw"] else None
        i64 = dict(dtype=torch.int64, device=device)
        out = (torch.full((R,), -1, **i64) if c["draw"] else None, torch.full((R, K), -1, **i64),
               torch.full((R, K), float("nan"), device=device))
        got = sm.global_sample(keys, c["top_k"], T, top_p, seed if c["draw"] else None, offsets, out=out)
        assert all(g is o for g, o in zip(got, out))
        ref = torch_sample(keys, c["top_k"], T, top_p, seed if c["draw"] else None, offsets)
        if c["e2e"]:
            res["ids"] &= torch.equal(got[1], r_ids)
            res["prob_err"] = max(res["prob_err"], (got[2] - r_probs).abs().max().item())
        res["ids"] &= torch.equal(got[1], ref[1])
        res["prob_err"] = max(res["prob_err"], (got[2] - ref[2]).abs().max().item())
        res["finite"] &= bool(torch.isfinite(got[2]).all())
        if c["draw"]:
            u = philox.uniforms(seed, offsets)
        if c["draw"] and d == 0:
            # The same draw from the uniforms themselves (the draft path), with each drawn token's probability
            out_u = tuple(torch.full_like(t, -1) for t in out)
            served = torch.full((R,), float("nan"), device=device)
            sm.global_sample(keys, c["top_k"], T, top_p, uniforms=u, out=out_u, served=served)
            res["uniforms_same"] = res.get("uniforms_same", True) and all(torch.equal(a, b) for a, b in zip(out_u, got))
            res["served_exact"] = res.get("served_exact", True) and torch.equal(
                served, sampler.prob_of(got[1], got[2], got[0]))
            # A draft depth's row with its state update (chain): k = depth, product *= the served probability
            k, product = torch.zeros((), dtype=torch.int64, device=device), torch.full((), 0.37, device=device)
            want = product * served[0]
            row = tuple(torch.full_like(t[:1], -1) for t in out)
            sm.global_sample(keys[:1], c["top_k"], T, top_p, uniforms=u[:1], out=row, chain=(k, 3 + R, product))
            res["chain_exact"] = res.get("chain_exact", True) and int(k) == 3 + R and torch.equal(product, want) \
                and all(torch.equal(a, b[:1]) for a, b in zip(row, got))
        if c["draw"]:
            near = _near(ref[2], u)
            same = got[0] == ref[0]
            res["tokens_equal"] += int(same.sum())
            res["tokens_skipped"] += int((~same & near).sum())
            res["tokens_differ"] += int((~same & ~near).sum())
    return res


# ---- accept_settle ---------------------------------------------------------------------------------
def _dist_rows(logits: torch.Tensor, K: int, top_p: float = 0.95):
    ids = torch.arange(logits.shape[1]).expand_as(logits)
    return sampler.global_dist(logits, ids, K, torch.tensor(1.0), torch.tensor(top_p))


def _accept_inputs(c: dict, gen: torch.Generator, k: int):
    kmax, V = c["kmax"], c["vocab"]
    p_logits = torch.randn(kmax + 1, V, generator=gen) * 2
    noise = {"close": 0.3, "far": 3.0, "same": 0.0, "no_mass": 0.0}[c["q"]]
    q_logits = p_logits[:kmax] + noise * torch.randn(kmax, V, generator=gen)
    if c["q"] == "far":
        q_logits = q_logits[:, torch.randperm(V, generator=gen)]
    p_ids, p_probs = _dist_rows(p_logits, c["Kp"])
    q_ids, q_probs = _dist_rows(q_logits, c["Kq"])
    if c["q"] == "same":  # q_i = p_{i-1}: every live draft passes, the bonus comes from p_k
        q_ids, q_probs = p_ids[:kmax].clone(), p_probs[:kmax].clone()
    u = torch.rand(kmax, generator=gen)
    drafts = sampler.draw(q_ids, q_probs, u)
    if c["q"] == "no_mass":  # p one-hot, q the same one-hot, the draft outside both: 0/0, no residual mass
        p_probs = torch.zeros_like(p_probs)
        p_probs[:, 0] = 1.0
        q_ids, q_probs = p_ids[:kmax].clone(), p_probs[:kmax].clone()
        drafts = p_ids[:kmax, 0] + V  # not a candidate anywhere
    if c["poison"]:  # dead rows: q_{k+1..}, p_{k+1..} and drafts past k hold garbage
        q_probs[k:] = float("nan")
        p_probs[k + 1:] = float("nan")
        drafts[k:] = torch.randint(0, 2**40, (kmax - k,), generator=gen)
    return p_ids, p_probs, q_ids, q_probs, drafts


def torch_accept(p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed) -> dict[str, torch.Tensor]:
    """The accept step's torch form (fast/torch_ops.TorchOps.accept) as the kernel's outputs, with the distribution
    the new token is drawn from (fast.sampler.commit_dist of the accepted count)."""
    a, token, emitted = TorchOps().accept(p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed)
    f_ids, f_probs = sampler.commit_dist(p_ids, p_probs, q_ids, q_probs, a, k)
    return dict(a=a, token=token, emitted=emitted, ids=f_ids[0], probs=f_probs[0])


def run_accept(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    res = dict(exact=0, skipped=0, differ=[], prob_err=0.0, ids=True, bonus=0, residual=0, fallback=0, a_hist=[0] * 8)
    for k in c["ks"]:
        for trial in range(c["trials"]):
            p_ids, p_probs, q_ids, q_probs, drafts = (t.to(device) for t in _accept_inputs(c, gen, k))
            seed = _seed(int(torch.randint(0, 2**62, (), generator=gen)) + (trial % 2) * 2**63, device)
            n = torch.tensor(int(torch.randint(0, 10**6, (), generator=gen)), device=device)
            kt = torch.tensor(k, device=device)
            kmax, Kp = c["kmax"], p_ids.shape[1]
            out = dict(a=torch.full((), -1, dtype=torch.int64, device=device),
                       token=torch.full((), -1, dtype=torch.int64, device=device),
                       emitted=torch.full((kmax + 1,), -1, dtype=torch.int64, device=device),
                       ids=torch.full((Kp,), -1, dtype=torch.int64, device=device),
                       probs=torch.full((Kp,), float("nan"), device=device))
            got = sm.accept_settle(p_ids, p_probs, q_ids, q_probs, drafts, kt, n, seed, out=out)
            assert got is out
            ref = torch_accept(p_ids, p_probs, q_ids, q_probs, drafts, kt, n, seed)
            a = int(ref["a"])
            res["a_hist"][a] += 1
            if a == k:
                res["bonus"] += 1
            elif torch.equal(ref["ids"], p_ids[a]) and torch.equal(ref["probs"], p_probs[a]):
                res["fallback"] += 1
            else:
                res["residual"] += 1
            res["ids"] &= int(got["a"]) == a and torch.equal(got["ids"], ref["ids"])
            res["prob_err"] = max(res["prob_err"], (got["probs"] - ref["probs"]).abs().max().item())
            same = int(got["token"]) == int(ref["token"]) and torch.equal(got["emitted"], ref["emitted"])
            u = philox.uniforms(seed, philox.offsets((n + a + 1).view(1), rng.PURPOSE_COMMIT))
            if same:
                res["exact"] += 1
            elif bool(_near(ref["probs"].view(1, -1), u)[0]):
                res["skipped"] += 1
            else:
                res["differ"].append(dict(k=k, trial=trial, a=a, got=int(got["token"]), ref=int(ref["token"])))
    return res


def run_case(c: dict, device: str) -> dict:
    return run_sample(c, device) if c["kind"] == "sample" else run_accept(c, device)


def _check(c: dict, r: dict) -> None:
    name = c["name"]
    assert r["ids"], f"{name}: ids (or accepted counts) differ from fast.sampler"
    assert r["prob_err"] <= PROB_TOL, f"{name}: max |probs - ref| = {r['prob_err']:.2e} > {PROB_TOL:.0e}"
    if c["kind"] == "sample":
        assert not r["top_p_near"], f"{name}: test data puts a top-p cut within rounding; change its seed"
        assert r["finite"], f"{name}: NaN left in probs"
        assert r["tokens_differ"] == 0, f"{name}: {r['tokens_differ']} draws differ away from any boundary"
        if c["draw"]:
            total = c["R"] * c["draws"]
            assert r["tokens_equal"] + r["tokens_skipped"] == total and r["tokens_skipped"] <= max(1, total // 20)
            assert r["uniforms_same"], f"{name}: drawing from the uniforms differs from drawing from their counters"
            assert r["served_exact"], f"{name}: the served probabilities differ from prob_of of the drawn tokens"
            assert r["chain_exact"], f"{name}: a draft row's k or running product differs from the torch update"
        return
    assert not r["differ"], f"{name}: accept step differs: {r['differ'][:3]}"
    total = len(c["ks"]) * c["trials"]
    assert r["exact"] + r["skipped"] == total and r["skipped"] <= max(1, total // 20)
    # the paths each case exists for were taken
    if c["q"] == "same":
        assert r["bonus"] == total
    elif c["q"] == "no_mass":
        assert r["fallback"] == total and r["a_hist"][0] == total
    elif c["Kp"] > 1:
        assert r["residual"] > 0 and (r["bonus"] > 0 or c["q"] == "far")


# ---- interpreter tests ---------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, INTERPRETED_CASES, _check)


def _scalars():
    return dict(temperature=torch.tensor(1.0), top_p=torch.tensor(0.9), seed=torch.tensor(7),
                offsets=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("over, message", [
    (dict(keys=torch.zeros(2, 40, dtype=torch.int32)), "keys must be int64"),
    (dict(top_k=0), "top_k must be"),
    (dict(temperature=torch.tensor([1.0])), "temperature must be"),
    (dict(top_p=torch.tensor(0.9, dtype=torch.float64)), "top_p must be"),
    (dict(seed=torch.tensor(7, dtype=torch.int32)), "seed must be"),
    (dict(offsets=torch.zeros(2, dtype=torch.int64)), "offsets must be"),
    (dict(seed=None), "go together"),
])
def test_global_sample_rejects_bad_inputs(over, message):
    args = dict(keys=torch.zeros(2, 40, dtype=torch.int64), top_k=20, **_scalars())
    args.update(over)
    with pytest.raises(ValueError, match=message):
        sm.global_sample(**args)


def test_accept_settle_rejects_bad_inputs():
    ids, probs = torch.zeros(8, 20, dtype=torch.int64), torch.zeros(8, 20)
    one = torch.tensor(1)
    with pytest.raises(ValueError, match="KMAX\\+1 p rows"):
        sm.accept_settle(ids[:7], probs[:7], ids[:7], probs[:7], torch.zeros(7, dtype=torch.int64), one, one, one)
    with pytest.raises(ValueError, match="k must be"):
        sm.accept_settle(ids, probs, ids[:7], probs[:7], torch.zeros(7, dtype=torch.int64), one.int(), one, one)
    with pytest.raises(ValueError, match="drafts must be"):
        sm.accept_settle(ids, probs, ids[:7], probs[:7], torch.zeros(6, dtype=torch.int64), one, one, one)


# ---- GPU tests (real shapes) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


@pytest.mark.gpu
def test_gpu_graph_capture():
    """Both kernels replay inside a CUDA graph with new temperature/top_p/seed/n values (no recapture)."""
    dev = "cuda"
    keys = torch.cat([sampler._local_keys(torch.randn(8, 20000, device=dev), 20, r * 20000) for r in range(8)], -1)
    T, top_p, seed = torch.tensor(1.0, device=dev), torch.tensor(0.95, device=dev), _seed(5, dev)
    offsets = torch.arange(8, dtype=torch.int32, device=dev) * 16
    sm.global_sample(keys, 20, T, top_p, seed, offsets)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tokens, ids, probs = sm.global_sample(keys, 20, T, top_p, seed, offsets)
    for t, p, s in ((0.7, 0.9, 11), (0.0, 0.95, 2**63), (1.5, 1.0, 3)):
        T.fill_(t), top_p.fill_(p), seed.copy_(_seed(s, dev))
        g.replay()
        r_tokens, r_ids, r_probs = torch_sample(keys, 20, T, top_p, seed, offsets)
        assert torch.equal(ids, r_ids) and (probs - r_probs).abs().max().item() <= PROB_TOL
        assert torch.equal(tokens, r_tokens)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in INTERPRETED_CASES])

"""`iquest bench tune`: candidate lists (default first, no duplicate launches, every keyword one the wrapper
takes), the launch configurations they resolve to against the wrappers' own helpers, the routings the MoE
rotates over, the output comparison with its negative controls, the verdict and the table/JSON on a
fabricated result, and the CLI without CUDA. Under the Triton interpreter (a worker subprocess), the
sweep itself at small shapes with CUDA graphs and timing faked: every candidate checked, failing ones
reported (error, mismatch, replay mismatch, skipped by the time budget), none dropped; on a 64-wide hidden size and
one MoE routing, since every interpreted call costs the sweep's time and the checks need only a few. The real run
is `@pytest.mark.gpu`."""

from __future__ import annotations

import inspect
import io
import json
import sys
from dataclasses import replace

import pytest
import torch

from iquest.bench import tune as t
from iquest.cli.main import main
from iquest.kernels import decode_attention as da
from iquest.kernels import fp8_linear as fl
from iquest.kernels import moe as mk
from iquest.kernels import router as rt
from iquest.reference.config import Config

SHAPE = t.tune_shape(Config.from_file(t.FULL_CONFIG))
SMALL = t.TuneShape(rows=2, hidden=256, q_heads=2, kv_heads=1, head_dim=16, experts=16, top_k=4, inter=32,
                    block=(16, 16), context=40, window=32, ring_slots=48, full_slots=128, distinct=6)
CPU_SMS = 8  # what the wrappers' helpers assume off CUDA
# The interpreted sweep's shape: SMALL with a narrower hidden size (each interpreted call's cost scales with it)
SWEPT = replace(SMALL, hidden=64)


# ---- candidate lists ---------------------------------------------------------------------------------------
def test_shape_is_one_tp8_rank_at_decode():
    assert (SHAPE.rows, SHAPE.hidden, SHAPE.q_heads, SHAPE.kv_heads, SHAPE.head_dim) == (6, 6144, 6, 1, 128)
    assert (SHAPE.experts, SHAPE.top_k, SHAPE.inter, SHAPE.block) == (256, 8, 256, (128, 128))
    assert SHAPE.qkv == (1024, 6144) and SHAPE.o == (6144, 768)
    assert (SHAPE.ring_slots, SHAPE.full_slots, SHAPE.kv_len) == (4160, 196_608, 1030)


@pytest.mark.parametrize("shape, sms", [(SHAPE, t.H200_SMS), (SHAPE, CPU_SMS), (SMALL, CPU_SMS)],
                         ids=["h200", "full-8sms", "small"])
@pytest.mark.parametrize("op", t.OPS)
def test_candidates_default_first_unique_and_accepted(op, shape, sms):
    cands = t.candidates(op, shape, sms)
    assert cands[0].kwargs == () and cands[0] == t.cand(), "the default (no keywords) comes first"
    # The MoE sweeps two kernels' launch settings, with bf16 and fp16 operands
    assert 1 <= len(cands) <= (40 if op == "moe" else 24 if op.startswith("linear") else 16)
    resolved = [tuple(t.resolve(op, c.kw, shape, sms).items()) for c in cands]
    assert len(set(resolved)) == len(resolved), "two candidates launch the same configuration"
    assert len({c.kwargs for c in cands}) == len(cands)
    params = inspect.signature(t.WRAPPERS[op]).parameters
    for c in cands:
        for name, value in c.kw.items():
            assert name in params and params[name].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                             inspect.Parameter.POSITIONAL_OR_KEYWORD), (op, name)
            assert name in t.TUNABLES[t.family(op)], (op, name)
            if name in ("f16", "f16_input", "tma", "packed_topk", "f16_out", "preload", "fp8_down",
                        "early_down", "direct"):
                assert isinstance(value, bool), (op, value)
                continue
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (op, name, value)
            if name in ("block_n", "block_k", "block_e", "block_h", "down_block_n", "down_block_k", "num_warps",
                        "gate_up_block_n", "gate_up_warps", "down_warps", "select_warps", "combine_splits",
                        "combine_cols", "combine_warps"):
                assert value & (value - 1) == 0, (op, name, value)
        r = t.resolve(op, c.kw, shape, sms)
        if t.family(op) == "attention":
            assert r["min_split"] % r["block_n"] == 0 and r["live_splits"] <= r["num_splits"]


def test_only_keeps_the_default_and_the_matching_candidates():
    """`--only engine`: the default and the MoE as fast/triton_ops.py calls it (fp8_down, early_down), nothing else; a
    string no candidate holds leaves the default alone."""
    cands = t.candidates("moe", SHAPE, t.H200_SMS, ("engine",))
    assert cands[1].kw == {"fp8_down": True, "early_down": True}
    assert len(cands) > 2 and all("engine" in c.note and c.kw["early_down"] for c in cands[1:])
    assert [c.kw for c in t.candidates("router", SHAPE, t.H200_SMS, ("no such candidate",))] == [{}]
    # a label matches too: every router candidate with a 256-wide tile
    wide = t.candidates("router", SHAPE, t.H200_SMS, ("block_h=256",))
    assert len(wide) >= 2 and all(c.kw.get("block_h") == 256 for c in wide[1:])


def test_budget_of_the_full_sweep():
    """~115 candidates over the six ops at the H200 shapes (the MoE's fp16-operand variants and, since the
    fourteenth session, the ops' engine forms and the linears' shorter-chain forms included): ~1 s of compilation each
    keeps the whole sweep near 5 minutes; `--only` times a few."""
    total = sum(len(t.candidates(op, SHAPE, t.H200_SMS)) for op in t.OPS)
    assert 40 <= total <= 125, total


def test_h200_defaults_and_the_suggested_variants():
    r = {op: [t.resolve(op, c.kw, SHAPE, t.H200_SMS) for c in t.candidates(op, SHAPE, t.H200_SMS)] for op in t.OPS}
    # defaults (tuned at 932ec08; the MoE's Gate/Up warps at a788a79, fp16 operands and Down stages at ef1c46c), by hand:
    # MoE 264 programs / (16 expected segments x 2 I tiles) = 8 splits;
    # q/k/v 264 / 32 N tiles = 8; o_proj 264 // 192 = 1; attention 17 live splits of 64 slots for 1030 (the ring's
    # 4161 slots: 66 splits); router min(12 H tiles, 17) = 12
    assert r["moe"][0] == {"split_k": 8, "block_k": 128, "gate_up_block_n": 128, "gate_up_warps": 4,
                           "gate_up_stages": 3, "down_block_n": 128, "down_block_k": 64, "down_warps": 4,
                           "down_stages": 3, "f16": True, "f16_input": True, "tma": True, "fp8_down": False,
                           "early_down": False}
    assert r["linear_qkv"][0] == {"split_k": 8, "block_n": 32, "num_warps": 4, "num_stages": 4, "preload": False}
    assert r["linear_o"][0]["split_k"] == 1
    assert r["attention_sliding"][0] == {"num_splits": 66, "live_splits": 17, "block_n": 64, "min_split": 64,
                                         "num_warps": 4, "num_stages": 2, "combine_splits": 128, "combine_cols": 32,
                                         "combine_warps": 4}
    assert r["attention_full"][0]["num_splits"] == 264 and r["attention_full"][0]["live_splits"] == 17
    assert r["attention_full"][0]["num_stages"] == 3  # decode_attention.default_num_stages: full 3, sliding 2
    assert r["router"][0] == {"split": 12, "block_e": 4, "block_h": 512, "num_warps": 1, "select_warps": 4,
                              "packed_topk": True, "preload": False}
    assert r["norm"][0] == {"num_warps": 8, "f16_out": True}  # as the engine calls the post-attention norm

    def values(op, key):
        return {x[key] for x in r[op]}

    # 4x: capped; 4 = the default split for 64-wide Gate/Up tiles (twice the tiles, half the splits)
    assert values("moe", "split_k") == {4, 8, 16, 24} and values("moe", "block_k") == {64, 128}
    assert values("moe", "gate_up_block_n") == {64, 128} and values("moe", "gate_up_warps") == {4, 8}
    assert values("moe", "gate_up_stages") == {2, 3, 4, 5} and values("moe", "down_stages") == {1, 2, 3, 4}
    assert values("moe", "down_warps") == {4, 8} and values("moe", "f16") == {False, True}
    assert values("moe", "f16_input") == {False, True} and values("moe", "tma") == {False, True}
    assert values("moe", "down_block_n") == {32, 64, 128, 256} and values("moe", "down_block_k") == {64, 128}
    for op in ("linear_qkv", "linear_o"):
        assert values(op, "block_n") == {16, 32, 64, 128} and values(op, "num_warps") == {1, 2, 4, 8}
        assert values(op, "num_stages") == {3, 4} and len(values(op, "split_k")) >= 3
    assert values("attention_sliding", "live_splits") == {5, 9, 17, 33}
    assert values("router", "split") == {6, 12, 24} and values("router", "select_warps") == {1, 2, 4, 8}
    assert values("norm", "num_warps") == {1, 2, 4, 8, 16} and values("norm", "f16_out") == {False, True}
    assert values("router", "packed_topk") == {False, True} and values("router", "block_h") == {256, 512, 1024}
    # the weights read before the PDL wait: the preload is taken at both linears' and the router's default plans
    for op in ("linear_qkv", "linear_o", "router"):
        assert values(op, "preload") == {False, True}


@pytest.mark.parametrize("n, k", [(1024, 6144), (6144, 768), (128, 6144), (64, 256), (300, 1000)])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_resolution_matches_the_wrappers_helpers(n, k, block_n):
    """The sweep's copies of the split rules (the wrappers read the SM count from the device) agree with the
    wrappers' helpers where those run off CUDA (8 SMs)."""
    cpu = torch.device("cpu")
    assert t._linear_auto_split(n, k, block_n, 128, CPU_SMS) == fl.choose_split_k(n, k, block_n, 128, cpu)
    assert t._attention_auto_splits(k, 1, 4 * block_n, CPU_SMS) == da.default_num_splits(k, 1, cpu, 4 * block_n)
    assert t._router_auto_split(n // 4, k, block_n // 16, 4 * block_n, CPU_SMS) == rt.choose_split(
        n // 4, k, block_n // 16, 4 * block_n, cpu)


def test_moe_resolution_uses_plan_split():
    P, E, k, H, I, bn = t._moe_dims(SHAPE)
    assert (P, bn) == (48, 128)
    for kw in ({}, {"split_k": 16}, {"block_k": 128}, {"block_k": 128, "split_k": 16}):
        bk = kw.get("block_k", 64)
        want = mk.plan_split(P, E, k, H, I, bn, bk, kw.get("split_k"), 132)[0]
        assert t.resolve("moe", kw, SHAPE, 132)["split_k"] == want


# ---- inputs ----------------------------------------------------------------------------------------------
def test_routings_choose_13_fresh_experts_per_call():
    routes = t.routings(SHAPE, t.ROUTINGS, "cpu")
    assert len(routes) == 16
    pools = []
    for experts, weights in routes:
        assert experts.shape == (6, 8) and experts.dtype == torch.int64 and weights.dtype == torch.float32
        assert all(len(set(row.tolist())) == 8 for row in experts), "a row chooses distinct experts"
        assert torch.allclose(weights.sum(1), torch.ones(6))
        pools.append(set(experts.flatten().tolist()))
    assert all(len(p) == 13 for p in pools), "6 rows x 8 over a pool of 13: all 13 used"
    assert len(set().union(*pools)) == 16 * 13, "disjoint pools: consecutive calls read other experts"
    small = t.routings(SMALL, 4, "cpu")
    assert all(len(set(e.flatten().tolist())) == 6 for e, _ in small)


@pytest.mark.parametrize("distinct", [18, 38, 48])
def test_routings_cover_a_larger_pool(distinct):
    """`bench tune --distinct 38` (real requests' routing): every routing visits exactly that many experts."""
    for experts, _ in t.routings(replace(SHAPE, distinct=distinct), 4, "cpu"):
        assert all(len(set(row.tolist())) == 8 for row in experts)
        assert len(set(experts.flatten().tolist())) == distinct


def test_attention_case_reads_disjoint_slots_per_copy():
    case = t.build_case("attention_full", SMALL, torch.device("cpu"), CPU_SMS, rotate=1 << 16)
    assert case.copies == -(-(1 << 16) // (2 * SMALL.kv_len * 16 * 2)) and case.facts["kv_len"] == 42
    assert case.facts["stride"] >= case.facts["kv_len"] and case.facts["slots"] == 129
    assert case.launches == 2 and case.ref.shape == (2, 2, 16)


# ---- comparison ------------------------------------------------------------------------------------------
def test_compare_and_its_negative_controls():
    y = torch.randn(6, 64)
    assert t.compare("linear_o", y.to(torch.bfloat16), y.double())[1] is None
    assert t.compare("linear_o", y * 1.05, y)[1] is not None  # 5% off
    nan = y.clone()
    nan[0, 0] = float("nan")
    assert t.compare("moe", nan, y)[1] is not None
    w, e, s = torch.rand(6, 8), torch.arange(48).view(6, 8), torch.rand(6, 256)
    assert t.compare("router", (w, e, s), (w, e, s)) == (0.0, None)
    assert t.compare("router", (w, e.flip(1), s), (w, e, s))[1] == "chosen experts differ"
    assert t.compare("router", (w, e, s * (1 + 1e-4)), (w, e, s))[1] is not None
    assert t.bit_equal(torch.tensor([0.0]), torch.tensor([0.0])) and not t.bit_equal(torch.tensor([0.0]),
                                                                                       torch.tensor([-0.0]))


# ---- verdict, table, JSON --------------------------------------------------------------------------------
def _row(label, median, spread=0.01, default=False, **kw):
    kwargs = {} if default else {"split_k": 16}
    return {"label": label, "kwargs": kwargs, "resolved": {}, "note": "", "default": default, "status": "ok",
            "median_us": median, "min_us": median * 0.98, "spread": spread, "times_us": [median] * 3,
            "rel_diff_vs_ref": 3e-3, "rel_diff_vs_default": None if default else 1e-3, **kw}


def test_pick():
    assert t.pick([_row("d", 10.0, default=True), _row("a", 11.0)])["verdict"] == "keep the default (fastest)"
    within = t.pick([_row("d", 10.0, default=True), _row("a", 9.9)])
    assert within["recommend"] == "d" and within["best"] == "a" and "within noise" in within["verdict"]
    noisy = t.pick([_row("d", 10.0, 0.05, default=True), _row("a", 9.5, 0.05)])
    assert noisy["recommend"] == "d"
    use = t.pick([_row("d", 10.0, default=True), _row("a", 8.0), {"label": "x", "status": "error", "error": "E"}])
    assert use["recommend"] == "a" and use["verdict"].startswith("use it: 20.0% faster")
    assert use["recommend_kwargs"] == {"split_k": 16} and within["recommend_kwargs"] == {}
    failed_default = t.pick([{"label": "d", "default": True, "status": "mismatch"}, _row("a", 8.0)])
    assert failed_default["recommend"] == "a" and "default not timed" in failed_default["verdict"]
    assert t.pick([{"label": "d", "default": True, "status": "error"}])["best"] is None


def fabricated_report() -> dict:
    moe = [_row("split_k=8 block_k=64", 43.5, default=True), _row("split_k=16 block_k=64", 38.2, note="2x auto split"),
           {"label": "split_k=8 block_k=128", "kwargs": {"block_k": 128}, "resolved": {}, "note": "", "default": False,
            "status": "error", "error": "OutOfResources: out of resource: shared memory\nmore"},
           {"label": "split_k=32 block_k=64", "kwargs": {}, "resolved": {}, "note": "", "default": False,
            "status": "mismatch", "error": "vs the reference: 5.0e-02 > tol 1e-02", "rel_diff_vs_ref": 0.05},
           {"label": "down_block_n=32", "kwargs": {}, "resolved": {}, "note": "", "default": False,
            "status": "skipped", "error": "time budget (240 s) spent before this candidate"}]
    ops = {"moe": {"op": "moe", "desc": "x [6, 6144] bf16 ...", "bytes": 61_400_000, "floor_us": 14.3, "launches": 5,
                   "launch_bound_us": 10.5, "copies": 16, "tolerance": 1e-2, "facts": {}, "candidates": moe,
                   "elapsed_s": 30.0},
           "router": {"op": "router", "error": "RuntimeError: CUDA out of memory", "candidates": []}}
    for op in ops.values():
        if op["candidates"]:
            op.update(t.pick(op["candidates"]))
    return {"bench": "tune", "commit": "abc1234", "device": "NVIDIA H200", "sms": 132, "torch": "2.11",
            "triton": "3.6.0",
            "shape_text": SHAPE.text(), "copy_bandwidth_bytes_per_s": 4.27e12, "timing": "graphs", "repeats": 3,
            "launch": {"op": "launch", "candidates": [_row("empty kernel, 1 program", 2.1),
                                                      _row("empty kernel, 264 programs", 2.4)]},
            "ops": ops, "elapsed_s": 171.0, "notes": t.NOTES}


def test_report_table_marks_best_and_lists_every_failure():
    r = fabricated_report()
    buf = io.StringIO()
    t.print_report(r, buf)
    text = buf.getvalue()
    lines = text.splitlines()
    best = [x for x in lines if x.startswith("  * ")]
    assert len(best) == 1 and "38.20" in best[0] and "-12.2%" in best[0] and "2x auto split" in best[0]
    assert any(x.startswith("   d ") and "43.50" in x for x in lines)
    for needle in ("split_k=8 block_k=128  <- OutOfResources: out of resource: shared memory",
                   "split_k=32 block_k=64  <- vs the reference", "down_block_n=32  <- time budget",
                   "router: ERROR RuntimeError: CUDA out of memory",
                   "-> use it: 12.2% faster than the default (43.50 -> 38.20 us): split_k=16 block_k=64 [keywords: "
                   "split_k=16]",
                   "launch floor (an empty Triton kernel per call, same timing): empty kernel, 1 program 2.10 us",
                   "3 candidate(s) not timed", "byte floor 14.30 us; 5 launches per call (launch floor 10.50 us)",
                   "total 171 s"):
        assert needle in text, needle
    assert "moe                   43.50 ->    38.20   split_k=16 block_k=64 [keywords: split_k=16]" in text
    back = json.loads(json.dumps(r))
    assert back["ops"]["moe"]["recommend"] == "split_k=16 block_k=64"
    assert [x["status"] for x in back["ops"]["moe"]["candidates"]] == ["ok", "ok", "error", "mismatch", "skipped"]


# ---- CLI without CUDA ------------------------------------------------------------------------------------
@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("argv, needle", [
    ([], "iquest bench tune needs 1 CUDA device, found 0"),
    (["--ops", "moe,router"], "needs 1 CUDA device"),
    (["--ops", "moe,mlp"], "--ops: unknown op(s) mlp; choose from moe, linear_qkv"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--rows", "40"], "--rows must be in 1..16"),
    (["--distinct", "0"], "--distinct must be in 1..256"),
    (["--distinct", "38"], "needs 1 CUDA device"),
])
def test_cli_without_cuda(capsys, no_cuda, argv, needle):
    assert main(["bench", "tune", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and needle in err[0], err


def test_cli_help_names_every_op(capsys):
    assert main(["bench", "tune", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(op in text for op in t.OPS)


def test_run_refuses_without_cuda(no_cuda):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        t.run(("moe",), 3, None)


# ---- the sweep under the interpreter, graphs and timing faked ---------------------------------------------
class FakeGraph:
    """A 'graph' whose replay runs the captured calls eagerly."""

    def __init__(self, seq):
        self.seq = seq

    def replay(self):
        for c in self.seq:
            c()


def fake_capture(calls):
    for c in calls:
        c()
    seq = calls * -(-t.MIN_CALLS // len(calls))
    return FakeGraph(seq), len(seq)


def fake_time_graphs(graphs, repeats):
    """Later captures are faster, so the verdict has something to pick."""
    return [[100.0 / (1 + 0.1 * i) + 0.01 * r for r in range(repeats)] for i in range(len(graphs))]


def sweep_job() -> dict:
    # interpreted calls are slow: one routing, graphs of one pass over the copies
    t.capture, t.time_graphs, t.ROUTINGS, t.MIN_CALLS = fake_capture, fake_time_graphs, 1, 1
    original, build = t._raw_candidates, t.build_case

    def raw(op, shape, sms):
        if op == "moe":  # a Gate/Up and a Down variant: the combined best is a third, new configuration
            return [t.cand(), t.cand(split_k=4), t.cand(down_block_n=32)]
        extra = {"linear_o": [t.cand(block_n=48, num_stages=3), t.cand(block_n=64, num_stages=5),
                              t.cand(block_n=64, num_stages=6)],
                 "router": [t.cand(num_warps=3)]}.get(op, [])
        return original(op, shape, sms)[:3] + extra

    def build_case(op, shape, device, sms, rotate=t.ROTATE_BYTES):
        case = build(op, shape, device, sms, rotate)
        run = case.run

        def spoiled(kw, i, out=None, **extra):
            y = run(kw, i, out, **extra)
            if kw.get("num_stages") == 5:  # wrong in every call: a mismatch at the check
                y.mul_(1.5)
            if kw.get("num_stages") == 6 and out is not None:  # wrong only in the graph's calls
                y.add_(1.0)
            return y

        case.run = spoiled
        return case

    t._raw_candidates, t.build_case = raw, build_case
    results = {}
    for op in t.OPS:
        clock = t.Clock(1e9, log=sys.stderr)
        results[op] = t.sweep_op(op, SWEPT, torch.device("cpu"), CPU_SMS, 3, clock, 4e12, 2.0, rotate=1 << 15)
    results["budget"] = t.sweep_op("router", SWEPT, torch.device("cpu"), CPU_SMS, 3, t.Clock(0.0, log=sys.stderr),
                                   4e12, 2.0, rotate=1 << 15)
    return json.loads(json.dumps(results, default=str))


@pytest.fixture(scope="module")
def swept():
    from iquest.kernels.testing import run_worker

    return run_worker(__file__)["sweep"]


def test_sweep_checks_times_and_reports_every_candidate(swept):
    for op in t.OPS:
        rows = swept[op]["candidates"]
        assert rows[0]["default"] and rows[0]["status"] == "ok" and "median_us" in rows[0], (op, rows[0])
        assert all(r["status"] in ("ok", "error", "mismatch", "replay_mismatch") for r in rows)
        ok = [r for r in rows if r["status"] == "ok"]
        assert all("median_us" in r and len(r["times_us"]) == 3 and r["x_floor"] > 0 for r in ok), op
        assert all(r["rel_diff_vs_ref"] <= t.TOL[op] for r in ok)
        assert all(r["rel_diff_vs_default"] <= t.TOL[op] for r in ok[1:])
        if op != "router":  # the ops with `out=`: graph outputs checked against eager ones
            assert all(r.get("replay_bit_equal") for r in ok), op
        fastest = min(ok, key=lambda r: r["median_us"])["label"]
        assert swept[op]["best"] == fastest and swept[op]["recommend"] == fastest, op
        assert swept[op]["launch_bound_us"] == 2.0 * swept[op]["launches"]


def test_sweep_reports_failures_instead_of_dropping_them(swept):
    status = {r["status"] for r in swept["linear_o"]["candidates"]}
    assert status == {"ok", "error", "mismatch", "replay_mismatch"}
    by = {(r["resolved"]["block_n"], r["resolved"]["num_stages"]): r for r in swept["linear_o"]["candidates"]}
    assert by[(48, 3)]["status"] == "error" and "power of two" in by[(48, 3)]["error"]
    assert by[(64, 5)]["status"] == "mismatch" and "vs the reference" in by[(64, 5)]["error"]
    assert by[(64, 6)]["status"] == "replay_mismatch" and by[(64, 6)]["replay_bit_equal"] is False
    assert all("median_us" not in by[k] for k in ((48, 3), (64, 5), (64, 6)))
    router = swept["router"]["candidates"][-1]
    assert router["status"] == "error" and "num_warps 3" in router["error"]


def test_sweep_adds_the_combined_moe_candidate(swept):
    rows = swept["moe"]["candidates"]
    assert [r["note"] for r in rows][-1] == "combined best" and len(rows) == 4
    assert rows[-1]["kwargs"] == {"split_k": 4, "down_block_n": 32} and rows[-1]["status"] == "ok"
    assert rows[-1]["median_us"] == pytest.approx(100.01)  # timed on its own: the fake's first graph


def test_sweep_budget_skips_but_reports(swept):
    rows = swept["budget"]["candidates"]
    assert rows[0]["status"] == "ok" and len(rows) == 3  # the worker's router list, deduplicated on SMALL
    assert all(r["status"] == "skipped" and "time budget" in r["error"] for r in rows[1:])


# ---- GPU: the command itself, briefly ----------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_tune(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(["bench", "tune", "--ops", "linear_o,router", "--repeats", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "launch floor" in text and "summary" in text
    r = json.loads(out.read_text())
    assert all("median_us" in x for x in r["launch"]["candidates"])
    for op in ("linear_o", "router"):
        rows = r["ops"][op]["candidates"]
        assert rows[0]["default"] and rows[0]["status"] == "ok" and len(rows[0]["times_us"]) == 3
        assert all(x["status"] in ("ok", "error", "mismatch", "replay_mismatch") for x in rows)
        assert r["ops"][op]["best"] is not None
    assert all(x.get("replay_bit_equal") for x in r["ops"]["linear_o"]["candidates"] if x["status"] == "ok")


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([("sweep", sweep_job)])

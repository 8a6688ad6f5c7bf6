"""`iquest bench tune` on the CPU: every candidate of the grids is a valid setting of its kernel (each field exists,
each value passes the kernel's own checks), the rank shapes are the published TP8 ones, the options' errors are one
line, and without CUDA the command says so in one line; the fused q/k/v op's case runs under Triton's CPU interpreter
(one worker subprocess) with each candidate's settings reaching its launch. The timing itself needs the GPU
(`@pytest.mark.gpu`)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from iquest.bench import tune
from iquest.cli.main import main
from iquest.kernels import decode_attention, lm_head, qkv_rope_kv, router, topk
from iquest.kernels.testing import worker_fixture


# the kernels' own settings checks (the wrappers run them at every call); the norms' classes check in __post_init__
CHECKS = {"attention_full": decode_attention._check_settings, "attention_sliding": decode_attention._check_settings,
          "attention_draft": decode_attention._check_settings, "router": router._check_settings,
          "lm_head": lm_head._check_settings, "topk": topk._check_settings}


def test_grids_cover_every_op_and_only_name_fields():
    assert set(tune.GRIDS) == set(tune.OPS) == set(tune.ORDER_FIELDS)
    for op in tune.OPS:
        fields = {f.name for f in dataclasses.fields(tune.default_settings(op))}
        assert tune.ORDER_FIELDS[op] <= fields, op
        names = [tune.candidate_name(ov) for ov in tune.GRIDS[op]]
        assert len(set(names)) == len(names), op  # a name picks one candidate
        for ov in tune.GRIDS[op]:
            assert ov and set(ov) <= fields, (op, ov)
            assert all(getattr(tune.default_settings(op), k) != v for k, v in ov.items()), (op, ov)  # not the default


@pytest.mark.parametrize("op", tune.OPS)
def test_every_candidate_is_a_valid_setting(op):
    """Built with dataclasses.replace on the default (an unknown field raises) and accepted by the kernel's checks;
    the MoE's tiles are dot operands (powers of two >= 16, as moe() checks)."""
    built = tune.candidates(op)
    assert len(built) == len(tune.GRIDS[op]) >= 2
    for name, ov, st in built:
        assert type(st) is type(tune.default_settings(op)) and all(getattr(st, k) == v for k, v in ov.items())
        if op in CHECKS:
            CHECKS[op](st)
        if op == "moe":
            for f in ("block_m", "gate_up_block_n", "gate_up_block_k", "down_block_n", "down_block_k",
                      "combine_block"):
                v = getattr(st, f)
                assert v >= 16 and v & (v - 1) == 0, (name, f, v)
            assert st.warps in (1, 2, 4, 8, 16) and st.stages >= 1


def test_order_fields_flag_numerical_changes():
    assert tune.order_changes("attention_full", {"block_n": 32}) == ["block_n"]
    assert tune.order_changes("linear_qkv", {"split_k": 3}) == ["split_k"]
    assert tune.order_changes("linear_o", {"preload": False}) == tune.order_changes("linear_o", {"num_warps": 2}) == []
    assert tune.order_changes("attention_full", {"num_stages": 2}) == []  # scheduling only
    assert tune.order_changes("router", {"preload": False}) == []
    assert tune.order_changes("lm_head", {"block_v": 64}) == [] and tune.order_changes("lm_head", {"block_k": 64})
    assert tune.order_changes("topk", {"tile": 256, "skip": False}) == []  # exact keys: no setting moves a bit
    assert tune.order_changes("qkv_rope_kv", {"split_k": 12, "preload": False}) == ["split_k"]
    assert tune.order_changes("qkv_rope_kv", {"num_warps": 8}) == []
    row = {"name": "block_n=32", "bit_identical": False, "order_fields": ["block_n"]}
    assert tune.bits_text(row).startswith("numerical change")
    assert tune.bits_text(dict(row, order_fields=[])).startswith("DIFFERENT BITS")
    assert tune.bits_text(dict(row, bit_identical=True)) == "same bits"


def test_same_bits_compares_bit_patterns():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert tune.same_bits((a,), (a.clone(),))
    assert not tune.same_bits((a,), (torch.tensor([-0.0, float("nan"), 1.0]),))  # -0 == 0, but not its bits
    assert not tune.same_bits((a,), (a.double(),))


@pytest.mark.parametrize("rank, offset", [(0, 0), (1, 64), (2, 0), (3, 64)])
def test_rank_shapes_are_the_published_tp8_ones(rank, offset):
    s = tune.rank_shapes(rank)
    assert (s.hidden, s.q_heads, s.kv_heads, s.head_dim, s.rotary) == (3072, 6, 1, 128, 32)
    assert (s.experts, s.top_k, s.inter, s.inter_offset, s.vocab) == (256, 8, 192, offset, 20000)
    assert (s.window, s.draft_window) == (4096, 512)


def test_small_cases_build_on_cpu():
    """The cheap ops' inputs at the rank's shapes: the rings are the window + 64 slots, a full layer's cache the
    context + 96, and a short cache is copied up to MAX_COPIES for the rotation."""
    s = tune.rank_shapes(0)
    full = tune.build("attention_full", s, 6, 256, 13, "cpu", pdl=False)
    assert full.shapes["slots"] == 256 + 96 and full.copies == tune.MAX_COPIES
    assert tune.build("attention_sliding", s, 6, 256, 13, "cpu", pdl=False).shapes["slots"] == 4160
    assert tune.build("attention_draft", s, 6, 256, 13, "cpu", pdl=False).shapes["slots"] == 576
    assert tune.build("rmsnorm", s, 6, 256, 13, "cpu", pdl=False).copies == 1
    qkv = tune.build("linear_qkv", s, 6, 256, 13, "cpu", pdl=False)  # 3 MB a weight copy: 64 copies
    assert (qkv.shapes["n"], qkv.shapes["k"], qkv.copies) == (1024, 3072, 64)
    o = tune.build("linear_o", s, 6, 256, 13, "cpu", pdl=False)
    assert (o.shapes["n"], o.shapes["k"]) == (3072, 768)
    t = tune.build("topk", tune.rank_shapes(3), 6, 256, 13, "cpu", pdl=False)  # the engine's k: top_k 20
    assert t.shapes == {"rows": 6, "vocab": 20000, "k": 20, "vocab_offset": 60000} and t.copies == 1
    f = tune.build("qkv_rope_kv", s, 6, 256, 13, "cpu", pdl=False)  # linear_qkv's weight and copies, a full layer
    assert (f.shapes["n"], f.shapes["k"], f.shapes["head_dim"], f.shapes["slots"], f.copies) == (1024, 3072, 128,
                                                                                                 352, 64)
    tail = tune.build("add_norm_route", s, 6, 256, 13, "cpu", pdl=False)  # the fold's tail: o_proj's 96 tiles
    assert tail.shapes == {"rows": 6, "hidden": 3072, "tiles": 96, "experts": 256, "top_k": 8} and tail.copies == 1


# Each interpreted launch is the full-size projection (~1 s on CI's cores): the candidates that reach a different
# launch path (a split, no preload with a split, other warps); the generic tests check every candidate's fields
LAUNCHED = ("split_k=4", "preload=False", "num_warps=4")


def _launched_candidates() -> list:
    return [c for c in tune.candidates("qkv_rope_kv") if c[0] in LAUNCHED]


def _qkv_rope_kv_launches() -> dict:
    """Worker job: the qkv_rope_kv case at rank 0's shapes, the first call of the default and of each candidate (and
    the default's last call), with what each launch of the kernel was given and whether a split launch left its lock
    counters zeroed (the next call of the rotation reuses them)."""
    launches = []
    kernel = qkv_rope_kv._qkv_rope_kv_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                kernel[grid](*args, **kw)
                a = dict(zip(kernel.arg_names, args))
                zeroed = not kw["SPLIT"] or bool((a["lock_ptr"] == 0).all())  # unsplit, lock_ptr is a dummy
                launches.append({"grid": list(grid), "num_warps": kw["num_warps"], "preload": kw["PRELOAD"],
                                 "w": a["w_ptr"].data_ptr(), "locks_zeroed": zeroed})
            return launch

    case = tune.build("qkv_rope_kv", tune.rank_shapes(0), 6, 256, 13, "cpu", pdl=False)
    entries = [("default", {}, tune.default_settings("qkv_rope_kv"))] + _launched_candidates()
    out, ref = {"calls": 0}, None
    qkv_rope_kv._qkv_rope_kv_kernel = Recorder()
    try:
        for name, _, st in entries:
            calls = case.calls(st)
            got = tuple(t.clone() for t in calls[0]())
            ref = got if ref is None else ref
            out[name] = dict(launches.pop(), same_bits=tune.same_bits(got, ref), shapes=[list(t.shape) for t in got])
            if name == "default":
                out["calls"] = len(calls)
                calls[-1]()
                out["last_w"] = launches.pop()["w"]
    finally:
        qkv_rope_kv._qkv_rope_kv_kernel = kernel
    return out


interpreted = worker_fixture(__file__)


def test_qkv_rope_kv_case_runs_each_candidate(interpreted):
    """Every candidate's call is one launch of the fused kernel with the candidate's split, warps and preload, the
    counters left zeroed; the calls rotate over the case's weight copies; a candidate that changes no order field
    gives the default's bits. (The default splits K 8 ways, as on the GPU.)"""
    r = interpreted["qkv_rope_kv"]
    assert "error" not in r, r.get("error")
    assert r["calls"] == 64 and r["last_w"] != r["default"]["w"]
    assert {c[0] for c in _launched_candidates()} == set(LAUNCHED)  # each still a candidate
    for name, ov, st in [("default", {}, tune.default_settings("qkv_rope_kv"))] + _launched_candidates():
        got = r[name]
        assert got["grid"] == [8, st.split_k or 1, 1] and got["num_warps"] == st.num_warps, (name, got)
        assert got["locks_zeroed"] and got["shapes"] == [[6, 1024], [353, 1, 128], [353, 1, 128], [353]], (name, got)
        assert got["same_bits"] or tune.order_changes("qkv_rope_kv", ov), (name, got)
    assert r["split_k=4"]["preload"] > 0 and r["preload=False"]["preload"] == 0


def test_parse_ops_and_only():
    assert tune.parse_ops("all") == tune.OPS and tune.parse_ops("moe, router,moe") == ("moe", "router")
    assert tune.parse_only(None, ("moe",)) is None
    assert tune.parse_only("warps=8", ("moe",)) == ("warps=8",)
    with pytest.raises(ValueError, match="num_warps=8 is not a candidate of moe"):
        tune.parse_only("num_warps=8", ("moe",))
    with pytest.raises(ValueError, match="unknown linear"):
        tune.parse_ops("moe,linear")


def test_cli_errors_are_one_line(one_line_error, no_cuda):
    one_line_error(["bench", "tune"], "iquest bench tune needs 1 CUDA device, found 0")
    one_line_error(["bench", "tune", "--ops", "moe,attention_full", "--only", "block_n=32,warps=8", "--rank", "1",
                    "--rows", "4", "--distinct", "20", "--repeats", "3", "--budget", "60"], "needs 1 CUDA device")
    one_line_error(["bench", "tune", "--ops", "attention,moe"], "--ops: unknown attention")
    one_line_error(["bench", "tune", "--ops", ","], "--ops: unknown (none given)")
    one_line_error(["bench", "tune", "--ops", "moe", "--only", "block_n=32"], "--only: block_n=32 is not a candidate")
    one_line_error(["bench", "tune", "--rank", "8"], "--rank must be in 0..7")
    one_line_error(["bench", "tune", "--rows", "9"], "--rows must be in 1..8")
    one_line_error(["bench", "tune", "--rows", "1"], "--distinct must be in 8..8")
    one_line_error(["bench", "tune", "--budget", "0"], "--budget must be > 0")
    one_line_error(["bench", "tune", "--repeats", "0"], "--repeats must be >= 1")


def test_help_names_the_ops(capsys):
    assert main(["bench", "tune", "--help"]) == 0
    text = capsys.readouterr().out
    assert all(op in text for op in tune.OPS) and "Retired" not in text


@pytest.mark.gpu
def test_gpu_tune(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(["bench", "tune", "--ops", "rmsnorm,attention_draft", "--only", "num_warps=4,num_stages=3",
                 "--repeats", "3", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "tune" and r["commit"] and [o["op"] for o in r["ops"]] == ["rmsnorm", "attention_draft"]
    for o in r["ops"]:
        names = [c["name"] for c in o["candidates"]]
        assert names[0] == "default" and len(names) == 2, names
        for c in o["candidates"]:
            assert "error" not in c and len(c["times_us"]) == 3 and c["median_us"] > 0, c
        assert o["candidates"][1]["bit_identical"] or o["candidates"][1]["order_fields"]
    assert "rmsnorm" in capsys.readouterr().out


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([("qkv_rope_kv", _qkv_rope_kv_launches)])

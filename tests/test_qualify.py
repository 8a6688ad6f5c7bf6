"""`iquest qualify --quick` on the tiny preset: the healthy engine passes, every negative control is caught by its
intended check and position class (with its broken branch counted), the published architecture's own features each
have a control caught by the check class meant for it, the JSON report has the documented structure; recording
substitutes engine parts and overwrites nothing; `iquest debug diff` writes a PNG and names the first stage over
tolerance."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from iquest.tests.helpers import fixture_dir
from iquest.cli.main import main
from iquest.fast.rank import EngineOptions
from iquest.qualify import tolerances
from iquest.qualify.checks import chi2_sf
from iquest.qualify.controls import REGISTRY
from iquest.qualify.replay import classes_all


@pytest.fixture(scope="module")
def tiny():
    return fixture_dir("tiny")


@pytest.fixture(scope="module")
def report(tiny):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # --json: the report on stdout (the table goes to stderr)
        rc = main(["qualify", "--model", str(tiny), "--quick", "--json", "--jobs", "1"])
    data = json.loads(out.getvalue())
    data["_rc"] = rc
    return data


def test_quick_qualify_passes_on_the_healthy_engine(report):
    failed = [c for c in report["checks"] if c["verdict"] != "pass"]
    assert report["_rc"] == 0 and report["passed"], failed
    # every control but the router fold's, which needs a candidate that folds routing (--router-fold)
    n = len(REGISTRY) - 1
    assert report["controls_caught"] == f"{n}/{n}"
    assert [c["name"] for c in report["controls_not_applicable"]] == ["router_fold_w_out"]


def test_report_structure(report):
    for key in ("schema", "model", "tp", "dtype", "weights", "reference", "source", "quick", "seed", "seconds",
                "passed", "suite_alpha", "checks", "controls", "controls_not_applicable", "lossless", "controls_caught",
                "tolerances"):
        assert key in report, key
    assert report["weights"] == "fp8" and report["reference"] == "as stored" and report["source"] is None
    assert report["suite_alpha"] == tolerances.suite_alpha() <= 0.01
    for c in report["checks"]:
        assert set(c) == {"check", "class", "worst", "tolerance", "verdict", "rows", "where"}
        assert c["verdict"] in ("pass", "FAIL")
    by = {(c["check"], c["class"]): c for c in report["checks"]}
    for cls in classes_all():  # every position class is reported on its own, and was exercised
        for check in ("numerics.logits", "numerics.router", "numerics.router_scores", "cache.window"):
            assert by[(check, cls)]["rows"] > 0, (check, cls)
        assert by[("cache.window", cls)]["worst"] == 0  # the rings held every row's window (qualify/window.py)
    for check in ("decode.tokens", "decode.acceptance", "decode.logprobs", "stability.reference",
                  "stability.candidate", "lossless"):
        assert any(c["check"] == check for c in report["checks"]), check
    assert not any(c["check"].startswith("fp8w.") for c in report["checks"])  # an FP8 checkpoint has no BF16 source


@pytest.mark.parametrize("control", [c.name for c in REGISTRY if c.name != "router_fold_w_out"])  # its own test
def test_each_negative_control_is_caught_where_intended(report, control):
    r = next(c for c in report["controls"] if c["name"] == control)
    assert r["branch_count"] > 0, f"{control}: the broken code never ran on an input where it matters"
    assert r["caught"] and r["caught_by"], r
    assert all(tuple(x) in {tuple(i) for i in r["intended"]} for x in r["caught_by"])
    # the margin: every check that caught it is reported past its tolerance, with the failing verdict
    worst = {(w[0], w[1]): w for w in r["intended_worst"]}
    for check, cls in r["caught_by"]:
        w = worst[(check, cls)]
        assert w[4] == "FAIL"
        if check != "lossless":  # numerics: the worst error exceeds the tolerance (lossless fails below alpha)
            assert float(w[2]) > float(w[3]), w


# The published architecture's features: the check and class that must catch each one's control.
FEATURES = {
    "rope_double_dims": ("numerics.logits", "prefill"),
    "rope_last_dims": ("numerics.logits", "prefill"),
    "scalar_sink": ("numerics.logits", "prefill"),
    "raw_residual": ("numerics.logits", "prefill"),
    "draft_target_embedding": ("numerics.logits", "draft_depth1"),
    "draft_window_4096": ("numerics.logits", "draft_past_window"),
    "router_bf16": ("numerics.router_scores", "prefill"),
}


@pytest.mark.parametrize("control", sorted(FEATURES))
def test_the_published_features_controls_are_caught_by_their_class(report, control):
    r = next(c for c in report["controls"] if c["name"] == control)
    assert list(FEATURES[control]) in r["caught_by"], r


def test_controls_stay_in_their_classes(report):
    """A defect confined to one place is caught there and not everywhere: the classes keep it visible."""
    failing = {c["name"]: {tuple(x) for x in c["failing"]} for c in report["controls"]}
    target = {"prefill", "past_window", "ring_reused"} | {f"verify_row{i}" for i in range(8)}
    assert ("numerics.logits", "prefill") not in failing["keep_rejected_kv"]
    assert not any(cls.startswith("verify") for _, cls in failing["skip_redraft"])
    for name in ("draft_window_4096", "draft_target_embedding", "mtp_router_shift"):  # the draft's own pieces
        assert not any(cls in target for _, cls in failing[name]), (name, failing[name])
    assert {check for check, _ in failing["top_p_drops_crossing"]} <= {"numerics.sampler", "decode.tokens",
                                                                       "decode.acceptance"}
    assert failing["replacement_from_p"] == {("lossless", "speculative_token")}
    assert failing["logprobs_tempered"] == {("decode.logprobs", "emitted")}  # what is reported, not what is drawn


def test_the_logprobs_are_checked_on_every_emitted_token(report):
    """decode.logprobs holds every session's emitted tokens (not vacuously): the healthy engine's reported logprobs
    are within their bound of the reference's."""
    row = next(c for c in report["checks"] if c["check"] == "decode.logprobs")
    assert row["verdict"] == "pass" and row["rows"] >= 40 and row["worst"] <= 1.0, row


def test_every_tolerance_and_class_states_its_reason():
    for check, per in tolerances.table()["checks"].items():
        for cls, entry in per.items():
            assert len(entry.get("why", "")) > 40, (check, cls)
    for c in tolerances.table()["classes"]:
        assert len(c["what"]) > 20, c
    assert len(tolerances.table()["statistics"]["why"]) > 40


def test_position_classes_are_the_data():
    names = classes_all()
    assert names[:2] == ["prefill", "verify_row0"] and "verify_row7" in names and "draft_depth7" in names
    assert {"past_window", "ring_reused", "draft_past_window", "draft_ring_reused"} <= set(names)
    assert len(names) == len(set(names)) == 1 + 8 + 2 + 7 + 2


def test_tolerance_columns():
    """The compute dtype picks the column; the fp8w.* checks state the +fp8w columns and nothing else does."""
    assert tolerances.scheme("fp32") == "fp32" and tolerances.scheme("bf16") == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        tolerances.scheme("fp16")
    for check, per in tolerances.table()["checks"].items():
        for cls, entry in per.items():
            columns = {k for k in entry if k != "why"}
            if check.startswith("fp8w."):
                assert columns == {"fp32+fp8w", "bf16+fp8w"}, (check, cls)
            elif check.startswith(("numerics.", "cache.", "decode.", "diff")):
                assert columns == {"fp32", "bf16"}, (check, cls)


def test_chi2_survival_function():
    # Known quantiles: chi2(1) at 3.841 and chi2(7) at 14.067 have sf 0.05; chi2(2) sf = exp(-x/2).
    assert abs(chi2_sf(3.841459, 1) - 0.05) < 1e-6
    assert abs(chi2_sf(14.067140, 7) - 0.05) < 1e-6
    assert abs(chi2_sf(4.0, 2) - 0.1353352832) < 1e-9


def test_seed_picks_other_cases():
    from iquest.qualify.run import qualify_cases

    a, pa, _ = qualify_cases(512, True, 96, seed=0)
    b, pb, _ = qualify_cases(512, True, 96, seed=1)
    assert [c.prompt for c in a] != [c.prompt for c in b] and pa != pb
    assert {c.seed for c in a}.isdisjoint({c.seed for c in b})
    assert qualify_cases(512, True, 96, seed=1) == (b, pb, list(range(2, 10)))  # deterministic
    assert a[0].params is None and a[1].params == (3.0, 256, 1.0)  # the defaults, and the wide case
    assert len(a[0].prompt) + a[0].max_new_tokens >= 96 + 8  # the long case wraps the ring


def test_recording_substitutes_parts_and_overwrites_nothing(tiny):
    """The recorder is a subclass laid over the candidate's parts: the product classes and the engine's objects keep
    their own methods, and an engine built with the recording parts decodes the same tokens, recorded or not."""
    from iquest.fast.model import FastModel
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine, Request
    from iquest.fast.round import RoundRunner
    from iquest.qualify.checks import Case, record
    from iquest.qualify.controls import NoSinkModel
    from iquest.qualify.replay import RecordingModel, recording_parts
    from iquest.fast.rank import EngineParts

    methods = {cls: dict(vars(cls)) for cls in (FastModel, RoundRunner, RankEngine)}
    options = EngineOptions(max_context=128, dtype="fp32", graphs=False)
    plain = RankEngine(tiny, Parallel.single("cpu"), options)
    rec = RankEngine(tiny, Parallel.single("cpu"), options, recording_parts())
    case = Case(tuple(range(3, 23)), 5, 3, 12)
    want = [t for s in plain.decode(Request(case.prompt, 5, 1.0, 20, 0.95, 12, 3, ())) for t in s.tokens]
    _, steps, blocks = record(rec, case)
    assert [t for s in steps for t in s.tokens] == want
    assert [t for s in rec.decode(Request(case.prompt, 5, 1.0, 20, 0.95, 12, 3, ())) for t in s.tokens] == want
    assert {b.kind for b in blocks} == {"prefill", "verify", "draft"}
    assert {cls: dict(vars(cls)) for cls in methods} == methods
    for obj in (rec.model, rec.runner(3, 20)[0], rec):
        assert not {"forward", "draft", "dist", "sample", "start", "draft_row", "_sampling_args"} & set(vars(obj))
    assert rec.model.recorder is None  # handed back after the decode
    with pytest.raises(TypeError, match="recording_parts"):
        record(plain, case)
    # a control's broken piece stays in place under the recording one
    parts = recording_parts(EngineParts(model=NoSinkModel))
    engine = RankEngine(tiny, Parallel.single("cpu"), options, parts)
    assert isinstance(engine.model, NoSinkModel) and isinstance(engine.model, RecordingModel)
    assert recording_parts(parts) is parts


def test_a_control_that_cannot_apply_is_reported_not_run(tiny, tmp_path):
    from iquest.fixtures.make import make_fixture
    from iquest.qualify.run import select_controls

    bf16 = str(make_fixture("micro", tmp_path / "micro-bf16", weights="bf16"))
    plain, folded = EngineOptions(), EngineOptions(router_fold=True)
    chosen, skipped = select_controls(None, bf16, "bf16", folded)
    assert [s["name"] for s in skipped] == ["fp8_scales_transposed"] and "no FP8 weights" in skipped[0]["why"]
    assert len(chosen) == len(REGISTRY) - 1
    # quantized at load, the micro preset's 8- and 16-wide weights are one 128 x 128 block each: nothing to transpose
    assert "square, asymmetric" in select_controls(["fp8_scales_transposed"], bf16, "fp8", plain)[1][0]["why"]
    chosen, skipped = select_controls(["fp8_scales_transposed", "drop_sink"], str(tiny), "fp8", plain)
    assert [c.name for c in chosen] == ["drop_sink", "fp8_scales_transposed"] and skipped == []
    # the router fold's control needs a candidate that folds
    assert "no --router-fold" in select_controls(["router_fold_w_out"], str(tiny), "fp8", plain)[1][0]["why"]


def test_the_router_fold_qualifies_and_its_control_is_caught(tiny):
    """--router-fold: the folded candidate passes (its router checks score it against the fold's exact input) and
    the fold's own control, the o-partials without the attn_out_norm weight, is caught by numerics.router_scores, its
    branch counted."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["qualify", "--model", str(tiny), "--quick", "--json", "--jobs", "1", "--router-fold", "--dtype",
                   "bf16", "--control", "router_fold_w_out"])
    r = json.loads(out.getvalue())
    assert rc == 0 and r["passed"] and r["router_fold"], [c for c in r["checks"] if c["verdict"] != "pass"]
    (ctl,) = r["controls"]
    assert ctl["name"] == "router_fold_w_out" and ctl["caught"] and ctl["branch_count"] > 0, ctl
    assert {tuple(x)[0] for x in ctl["caught_by"]} == {"numerics.router_scores"}, ctl


def test_debug_diff_writes_png_and_names_a_stage(tiny, tmp_path, capsys):
    png = tmp_path / "diff.png"
    ids = ",".join(str(i) for i in range(3, 23))
    assert main(["debug", "diff", "--model", str(tiny), "--prompt-ids", ids, "--position", "12", "--plot", str(png),
                 "--json", "--control", "rope_shift_rows"]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    out, err = capsys.readouterr()
    data = json.loads(out)  # --json: the JSON on stdout, the table on stderr
    assert data["first_over"] == {"layer": "0", "stage": "attn_out"}
    assert "first over tolerance at layer 0, stage attn_out" in err
    assert main(["debug", "diff", "--model", str(tiny), "--prompt-ids", ids, "--position", "12", "--plot",
                 str(png)]) == 0
    assert "every layer and stage within tolerance" in capsys.readouterr().out


def test_debug_diff_sees_the_draft_embedding_only_in_the_draft(tiny, tmp_path, capsys):
    ids = ",".join(str(i) for i in range(3, 23))
    assert main(["debug", "diff", "--model", str(tiny), "--prompt-ids", ids, "--position", "-1", "--plot",
                 str(tmp_path / "d.png"), "--json", "--control", "draft_target_embedding"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["first_over"] == {"layer": "mtp", "stage": "input"}


def test_debug_diff_refuses_an_unknown_control(tiny, tmp_path, capsys):
    rc = main(["debug", "diff", "--model", str(tiny), "--prompt-ids", "3,4,5", "--plot", str(tmp_path / "d.png"),
               "--control", "bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "bogus" in err[0] and "rope_shift_rows" in err[0]
    assert not (tmp_path / "d.png").exists()


@pytest.mark.parametrize("jobs", ["0", "-2", "many"])
def test_qualify_rejects_bad_jobs(tiny, jobs, capsys):
    rc = main(["qualify", "--model", str(tiny), "--quick", "--jobs", jobs])
    assert rc != 0 and "--jobs" in capsys.readouterr().err


def test_qualify_rejects_kernels_other_than_the_user_choices(tiny, capsys):
    rc = main(["qualify", "--model", str(tiny), "--quick", "--kernels", "triton-settle"])
    err = capsys.readouterr().err
    assert rc != 0 and "--kernels" in err and "auto" in err and "triton" in err


def test_control_margin_reports_how_far_past_the_tolerance():
    """The margin names the intended check the control's run came closest to failing (or failed by most): a
    near miss reads below 1, a catch above 1, and a p-value check counts tolerance / worst (it fails below alpha)."""
    from iquest.qualify.checks import Row
    from iquest.qualify.run import control_margin, intended_worst

    rows = [Row("numerics.logits", "ring_reused", 0.27, 0.3, True, 5), Row("numerics.logits", "prefill", 0.1, 0.3, True, 5),
            Row("lossless", "speculative_token", 1e-6, 1e-3, False, 100)]
    near = {"intended_worst": intended_worst(rows, [("numerics.logits", "ring_reused"), ("numerics.hidden", "x")])}
    assert near["intended_worst"] == [["numerics.logits", "ring_reused", 0.27, 0.3, "pass"]]  # absent checks skipped
    assert control_margin(near) == "0.9x (numerics.logits/ring_reused)"
    both = {"intended_worst": intended_worst(rows, [("numerics.logits", "prefill"), ("lossless", "speculative_token")])}
    assert control_margin(both) == "1e+03x (lossless/speculative_token)"
    assert control_margin({"intended_worst": []}) == "-" and control_margin({}) == "-"


def test_router_scores_rows_need_the_engines_taps():
    """numerics.router_scores needs no reference: it is scored from the engine's own taps, per MoE layer."""
    from iquest.qualify.replay import Block, Geometry, Scores, score_router_scores

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=g).double()
    b = torch.randn(16, generator=g).float()
    s = torch.softmax((w.float() @ b), -1)
    e = torch.sort(s, descending=True, stable=True).indices[:2]
    blk = Block("prefill", -1, 0, [1], [0], [True], torch.zeros(1, 4), torch.zeros(1, 16),
                taps={"layer1.mlp_in": b[None].double(), "layer1.router_scores": s[None].double(),
                      "layer1.experts": e[None]})
    scores = Scores()
    score_router_scores(scores, blk, 0, ["prefill"], "here", {"layer1.": w, "mtp.": w}, 1.0)
    worst = scores.table[("numerics.router_scores", "prefill")]
    assert worst.rows == 1 and worst.failures == 0 and worst.value <= 1
    assert Geometry(32, 96, 16, 80).draft_ring == 80


def test_the_cached_reference_holds_ordinary_tensors_under_inference_mode(tiny):
    """qualify/run.py runs its units under torch.inference_mode, and the reference they load is cached for the
    process: it must hold no inference tensors, which a later caller could neither update nor differentiate."""
    from iquest.qualify.checks import reference

    with torch.inference_mode():
        ref = reference.__wrapped__(str(tiny))
    assert not any(w.is_inference() for w in ref.w.values())


def test_the_fp8w_rows_fail_against_weights_the_candidate_did_not_come_from(tmp_path):
    """The fp8w.* check can fail: the same FP8 candidate measured against another BF16 model's weights (the preset at
    another seed: same shapes, other values) is far past the E4M3 tolerance, while it still passes against the
    reference on its own quantization."""
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine
    from iquest.fixtures.make import make_fixture
    from iquest.qualify.checks import Case, RefSpec, decode_session, session_rows
    from iquest.qualify.replay import recording_parts

    bf16 = str(fixture_dir("tiny", "bf16"))
    other = str(make_fixture("tiny", tmp_path / "other", seed=1, weights="bf16"))
    engine = RankEngine(bf16, Parallel.single("cpu"), EngineOptions(max_context=128, dtype="fp32", graphs=False,
                                                                    weights="fp8"), recording_parts())
    case = Case(tuple(range(3, 23)), 5, 3, 12)
    rows = session_rows([decode_session(engine, RefSpec(bf16, "fp8"), case, "fp32", source=RefSpec(other))],
                        ["prefill", "verify_row0"])
    by = {(r.check, r.cls): r for r in rows}
    assert by[("numerics.logits", "prefill")].passed and by[("numerics.logits", "verify_row0")].passed
    assert not by[("fp8w.logits", "prefill")].passed and by[("fp8w.logits", "prefill")].value > 1.0
    assert not by[("fp8w.hidden", "verify_row0")].passed


def test_routed_controls_hand_the_moe_output_on_as_the_product_does():
    """The routing controls (router_bf16, mtp_router_shift) return what the ops' moe returns, untouched: on the GPU that
    is a pending Down the sandwich tail launches (fast/triton_ops.PendingDown), which has no tensor methods (a `.to()`
    there failed qualification on the H200 at 72c654b; the CPU's torch forms return a tensor, so only this shows it)."""
    from iquest.fast.weights import MoE
    from iquest.qualify.controls import Bf16RouterModel

    pending = object()

    class Ops:
        def moe(self, b, experts, weights, live, mlp):
            return pending

    model = object.__new__(Bf16RouterModel)
    model.ops, model.dtype = Ops(), torch.bfloat16
    mlp = MoE(router=torch.randn(4, 8), gate=None, up=None, down=None)
    c = type("C", (), {"num_experts_per_tok": 2})()
    assert model.mlp(c, mlp, torch.randn(3, 8), torch.ones(3, dtype=torch.bool), None, "layer1.") is pending


def test_the_sampler_check_names_the_heaviest_token_of_one_support():
    """qualify/replay.sampler_error: its value is the largest difference of the two distributions (a token in one
    support only counts with its whole probability) and its text names the heaviest such token; equal supports give
    the largest difference and no text."""
    from iquest.qualify.replay import sampler_error
    from iquest.reference.sampling import SamplingParams

    logits = torch.tensor([0.0, 3.0, 2.0, -1.0, -2.0], dtype=torch.float64)
    params = SamplingParams(1.0, 2, 1.0)  # the reference keeps tokens 1 and 2
    ref = torch.softmax(logits[[1, 2]], -1)
    err, why = sampler_error(torch.tensor([1, 3, 4]), torch.tensor([0.5, 0.35, 0.15], dtype=torch.float64), logits,
                             params)
    assert err == pytest.approx(0.35) and why == "token 3 in fast support only (p=0.35)"
    err, why = sampler_error(torch.tensor([1, 2]), ref + torch.tensor([0.01, -0.01], dtype=torch.float64), logits,
                             params)
    assert err == pytest.approx(0.01) and why == ""

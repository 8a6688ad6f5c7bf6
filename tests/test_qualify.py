"""`iquest qualify --quick` on fixtures/tiny: the healthy engine passes, every negative control is caught by
its intended check and position class (with its broken branch counted), the JSON report has the documented
structure; `iquest debug diff` writes a PNG and names the first stage over tolerance."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from iquest.cli.main import main
from iquest.qualify import tolerances
from iquest.qualify.checks import chi2_sf
from iquest.qualify.controls import REGISTRY
from iquest.qualify.replay import classes_all

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny"


@pytest.fixture(scope="module")
def report():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # --json: the report on stdout (the table goes to stderr)
        rc = main(["qualify", "--model", str(TINY), "--quick", "--json"])
    data = json.loads(out.getvalue())
    data["_rc"] = rc
    return data


def test_quick_qualify_passes_on_the_healthy_engine(report):
    failed = [c for c in report["checks"] if c["verdict"] != "pass"]
    assert report["_rc"] == 0 and report["passed"], failed
    assert report["controls_caught"] == f"{len(REGISTRY)}/{len(REGISTRY)}"


def test_report_structure(report):
    for key in ("schema", "model", "tp", "dtype", "quick", "seconds", "passed", "checks", "controls", "lossless",
                "controls_caught", "tolerances"):
        assert key in report, key
    for c in report["checks"]:
        assert set(c) == {"check", "class", "worst", "tolerance", "verdict", "rows", "where"}
        assert c["verdict"] in ("pass", "FAIL")
    rows = {(c["check"], c["class"]) for c in report["checks"]}
    for cls in classes_all():  # every position class is reported on its own, and was exercised
        assert ("numerics.logits", cls) in rows
        assert next(c for c in report["checks"] if (c["check"], c["class"]) == ("numerics.logits", cls))["rows"] > 0
        window = next(c for c in report["checks"] if (c["check"], c["class"]) == ("cache.window", cls))
        assert window["rows"] > 0 and window["worst"] == 0  # the ring held every row's window (qualify/window.py)
    for check in ("decode.tokens", "decode.acceptance", "stability.reference", "stability.candidate", "lossless"):
        assert any(c["check"] == check for c in report["checks"]), check


@pytest.mark.parametrize("control", [c.name for c in REGISTRY])
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


def test_controls_stay_in_their_classes(report):
    """A defect confined to one place is caught there and not everywhere: the classes keep it visible."""
    failing = {c["name"]: {tuple(x) for x in c["failing"]} for c in report["controls"]}
    assert ("numerics.logits", "prefill") not in failing["keep_rejected_kv"]
    assert not any(cls.startswith("verify") for _, cls in failing["skip_redraft"])
    assert {check for check, _ in failing["top_p_drops_crossing"]} <= {"numerics.sampler", "decode.tokens",
                                                                       "decode.acceptance"}
    assert failing["replacement_from_p"] == {("lossless", "speculative_token")}


def test_every_tolerance_states_its_reason():
    for check, per in tolerances.table()["checks"].items():
        for cls, entry in per.items():
            assert len(entry.get("reason", "")) > 40, (check, cls)


def test_chi2_survival_function():
    # Known quantiles: chi2(1) at 3.841 and chi2(7) at 14.067 have sf 0.05; chi2(2) sf = exp(-x/2).
    assert abs(chi2_sf(3.841459, 1) - 0.05) < 1e-6
    assert abs(chi2_sf(14.067140, 7) - 0.05) < 1e-6
    assert abs(chi2_sf(4.0, 2) - 0.1353352832) < 1e-9


def test_debug_diff_writes_png_and_names_a_stage(tmp_path, capsys):
    png = tmp_path / "diff.png"
    ids = ",".join(str(i) for i in range(3, 23))
    assert main(["debug", "diff", "--model", str(TINY), "--prompt-ids", ids, "--position", "12", "--plot", str(png),
                 "--json", "--control", "rope_shift_rows"]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    out, err = capsys.readouterr()
    data = json.loads(out)  # --json: the JSON on stdout, the table on stderr
    assert data["first_over"] == {"layer": "0", "stage": "attn_out"}
    assert "first over tolerance at layer 0, stage attn_out" in err
    assert main(["debug", "diff", "--model", str(TINY), "--prompt-ids", ids, "--position", "12", "--plot",
                 str(png)]) == 0
    assert "every layer and stage within tolerance" in capsys.readouterr().out


def test_debug_diff_refuses_an_unknown_control(tmp_path, capsys):
    rc = main(["debug", "diff", "--model", str(TINY), "--prompt-ids", "3,4,5", "--plot", str(tmp_path / "d.png"),
               "--control", "bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "bogus" in err[0] and "rope_shift_rows" in err[0]
    assert not (tmp_path / "d.png").exists()


def test_tolerance_column_follows_the_moe_kernel():
    """The E4M3 Down activations exist only with the MoE kernel: only then does the e4m3act column apply."""
    from iquest.fast.plan import KernelPlan
    from iquest.reference.config import Config

    triton, torch_forms = KernelPlan.triton(), KernelPlan.torch()
    assert tolerances.scheme("bf16", triton) == "bf16+e4m3act"
    assert tolerances.scheme("fp32", KernelPlan(moe=True)) == "fp32+e4m3act"
    assert tolerances.scheme("fp32", KernelPlan(linear=True, attention=True, norm=True, sampling=True)) == "fp32"
    assert tolerances.scheme("bf16", torch_forms) == "bf16"
    # With the model: only when the MoE kernel takes its shapes (tiny-tp8's 8-wide blocks fall back, exactly).
    assert tolerances.scheme("fp32", triton, Config.from_dir(TINY.parent / "tiny-tp8")) == "fp32"
    mini = Config.from_dir(TINY.parent / "iquest-q1-mini")
    assert tolerances.scheme("bf16", triton, mini) == "bf16+e4m3act"
    assert tolerances.scheme("bf16", triton, mini, tp=8) == "bf16+e4m3act"  # I_r = 128 / 8 = 16
    for check, per in tolerances.table()["checks"].items():
        for cls, entry in per.items():
            for dtype in ("fp32", "bf16"):
                if dtype in entry:  # every dtype column has its e4m3act twin, never looser than needed by chance
                    assert f"{dtype}+e4m3act" in entry, (check, cls, dtype)
                    a, b = entry[dtype], entry[f"{dtype}+e4m3act"]
                    assert a == b or (isinstance(a, float) and b >= a), (check, cls, dtype)


@pytest.mark.parametrize("jobs", ["0", "-2", "many"])
def test_qualify_rejects_bad_jobs(jobs, capsys):
    rc = main(["qualify", "--model", str(TINY), "--quick", "--jobs", jobs])
    assert rc != 0 and "--jobs" in capsys.readouterr().err


def test_qualify_rejects_kernels_other_than_the_user_choices(capsys):
    rc = main(["qualify", "--model", str(TINY), "--quick", "--kernels", "triton-settle"])
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

"""What `iquest qualify` prints for a reader: the lossless row as a p-value against its significance level, the
negative-control table with every name whole, and progress lines on a stderr that is not a terminal."""

from __future__ import annotations

import io
import json
import re

import pytest

from iquest.qualify.run import print_table, progress_bar

NAMES = [("numerics.logits", f"verify_row{i}") for i in range(8)]


def _report() -> dict:
    checks = [{"check": "numerics.logits", "class": "prefill", "worst": 1.5e-6, "tolerance": 1e-4, "verdict": "pass",
               "rows": 56, "where": ""},
              {"check": "lossless", "class": "speculative_token", "worst": 0.243, "tolerance": 0.001, "verdict": "pass",
               "rows": 600, "where": ""}]
    controls = [
        {"name": "rope_shift_rows", "caught": True, "caught_by": [list(n) for n in NAMES], "intended": NAMES,
         "intended_worst": [["numerics.logits", "verify_row6", 0.661, 1e-4, "FAIL"]], "branch_count": 46},
        {"name": "a_control_with_a_long_name", "caught": False, "caught_by": [], "intended": NAMES[:5],
         "intended_worst": [["numerics.logits", "verify_row0", 5e-5, 1e-4, "pass"]], "branch_count": 3},
    ]
    return {"checks": checks, "controls": controls, "controls_caught": "1/2", "passed": False, "seconds": 12.0}


def test_the_lossless_row_reads_as_a_p_value():
    out = io.StringIO()
    print_table(_report(), out)
    text = out.getvalue()
    row = next(line for line in text.splitlines() if line.startswith("lossless"))
    assert re.search(r"p = 0\.243\s+alpha = 0\.001\s+pass", row), row
    assert "significance level alpha" in text


def test_the_control_table_cuts_no_name():
    out = io.StringIO()
    print_table(_report(), out)
    lines = out.getvalue().splitlines()
    shift = next(line for line in lines if line.startswith("rope_shift_rows"))
    assert shift.endswith("numerics.logits/verify_row0, numerics.logits/verify_row1, numerics.logits/verify_row2 "
                          "(+5 more)"), shift
    assert "6.61e+03x (numerics.logits/verify_row6)" in shift
    missed = next(line for line in lines if line.startswith("a_control_with_a_long_name"))
    assert "NO" in missed and missed.endswith("(+2 more))") and "0.5x (numerics.logits/verify_row0)" in missed
    header = next(line for line in lines if line.startswith("negative control"))
    assert header.index("caught by") == shift.index("numerics.logits/verify_row0")  # the columns line up


def test_progress_lines_where_stderr_is_no_terminal(capsys):
    with progress_bar(3) as bar:  # capsys: stderr is not a TTY
        bar.set_postfix_str("healthy engine")
        bar.update(2)
        bar.set_postfix_str("control drop_sink")
        bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "qualify: 3 steps to run"
    assert re.fullmatch(r"qualify: 2/3 steps done, \d+ s elapsed \(healthy engine\)", lines[1]), lines
    assert re.fullmatch(r"qualify: 3/3 steps done, \d+ s elapsed \(control drop_sink\)", lines[2]), lines
    with progress_bar(3, progress=False) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


def test_worker_units_report_as_each_finishes_and_while_none_does(capsys):
    """qualify's worker pool (qualify/run.gather): a line as each unit finishes, in the order they finish and naming
    each, and a line a heartbeat while none finishes, so that a run cut off by its time limit says how far it got (a
    TP 2 run on one GPU showed nothing in 560 s when the first unit submitted was the last to finish)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from iquest.qualify.run import gather

    release = threading.Event()

    def slow():
        release.wait(5)
        return "slow"

    def fast(x):
        return x

    with progress_bar(4) as bar, ThreadPoolExecutor(2) as pool:
        timer = threading.Timer(0.35, release.set)
        timer.start()
        t0 = time.time()
        got = gather(pool, {"healthy": (slow,), "lossless": (fast, "l")}, bar, {"healthy": 3, "lossless": 1}, 2,
                     heartbeat=0.1)
    assert got == {"healthy": "slow", "lossless": "l"} and time.time() - t0 < 5
    lines = capsys.readouterr().err.splitlines()[1:]
    assert re.fullmatch(r"qualify: 1/4 steps done, \d+ s elapsed \(lossless done; 1 units left on 2 workers\)",
                        lines[0]), lines
    beats = [line for line in lines if line.endswith("(1 units running or queued on 2 workers)")]
    assert len(beats) >= 2 and all(line.startswith("qualify: 1/4 steps done") for line in beats), lines
    assert re.fullmatch(r"qualify: 4/4 steps done, \d+ s elapsed \(healthy done; 0 units left on 2 workers\)",
                        lines[-1]), lines

    def broken():
        raise RuntimeError("a unit failed")

    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="a unit failed"):
        gather(pool, {"x": (broken,)}, progress_bar(1, progress=False), {"x": 1}, 1)


# ---- the options: --seed, --false-alarm, --weights fp8 on a BF16 checkpoint ----------------------------------------
def test_seed_and_out_are_checked(capsys):
    from iquest.cli.main import main
    from iquest.tests.helpers import TINY

    assert main(["qualify", "--model", str(TINY), "--quick", "--seed", "-1"]) != 0
    assert "--seed" in capsys.readouterr().err
    assert main(["qualify", "--model", str(TINY), "--quick", "--out", "x.json"]) != 0
    assert "--false-alarm" in capsys.readouterr().err
    assert main(["qualify", "--model", str(TINY), "--false-alarm", "0"]) != 0
    assert "--false-alarm" in capsys.readouterr().err


def test_false_alarm_runs_write_their_raw_results(tmp_path, capsys):
    from iquest.cli.main import main
    from iquest.tests.helpers import TINY

    out = tmp_path / "fa.json"
    assert main(["qualify", "--model", str(TINY), "--false-alarm", "1", "--seed", "3", "--jobs", "1",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["false_alarms"] == 0 and data["false_alarm_rate"] == 0 and data["seeds"] == [3, 3]
    run = data["runs"][0]
    assert run["seed"] == 3 and run["passed"] and run["failing"] == [] and 0 < run["lossless_p"] <= 1
    assert data["suite_alpha"] <= 0.01 and "chi-square" in data["suite_alpha_why"]
    check, cls, worst, tol, ratio = run["closest"]  # the bound the healthy run came nearest to, never past it
    assert data["closest_bound"] == run["closest"] and 0 <= ratio == worst / tol <= 1 and check != "lossless"
    assert "false alarms: 0/1" in capsys.readouterr().out


def test_fp8_at_load_is_judged_on_its_own_quantization_and_measured_against_bf16(capsys):
    """A BF16 checkpoint run with --weights fp8: every check against the reference on the same quantized weights (the
    controls caught there), and the fp8w.* rows against the BF16 weights, within their E4M3 tolerance."""
    from iquest.cli.main import main
    from iquest.tests.helpers import fixture_dir

    bf16 = fixture_dir("tiny", "bf16")
    rc = main(["qualify", "--model", str(bf16), "--weights", "fp8", "--quick", "--json", "--jobs", "1",
               "--control", "router_bf16", "--control", "draft_target_embedding", "--control",
               "fp8_scales_transposed"])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert rc == 0 and report["passed"], [c for c in report["checks"] if c["verdict"] != "pass"]
    assert (report["weights"], report["reference"], report["source"]) == ("fp8", "fp8 at load", "bf16")
    fp8w = [c for c in report["checks"] if c["check"].startswith("fp8w.")]
    assert {c["check"] for c in fp8w} == {"fp8w.logits", "fp8w.hidden", "fp8w.kl"}
    assert all(c["rows"] > 0 and c["verdict"] == "pass" for c in fp8w)
    assert max(c["worst"] for c in fp8w if c["check"] == "fp8w.logits") > 1e-3  # E4M3 moved them: measured, not 0
    assert [c["name"] for c in report["controls"] if c["caught"]] == ["draft_target_embedding", "router_bf16"]
    assert [c["name"] for c in report["controls_not_applicable"]] == ["fp8_scales_transposed"]
    assert "fp8w.* rows measure them against the bf16 weights" in err


def test_kernel_settings_are_checked_before_any_worker_and_reach_the_candidate(capsys, monkeypatch):
    """--kernel-setting qualifies a numerical form before it becomes a default: refused without the op's kernels, for
    an unknown field and for a malformed triple; otherwise the candidate's options (and every control's, built on
    them) carry it."""
    from iquest.cli.main import main
    from iquest.fast.plan import KernelPlan
    from iquest.qualify.run import make_plan
    from iquest.tests.helpers import TINY

    assert main(["qualify", "--model", str(TINY), "--quick", "--kernel-setting", "moe.gate_up_split=4"]) != 0
    assert "need kernels: the plan runs the torch forms" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for bad, why in (("moe.gate_up_splitz=4", "unexpected keyword argument 'gate_up_splitz'"),
                     ("gate_up_split=4", "OP.FIELD=VALUE"), ("moe.gate_up_split", "OP.FIELD=VALUE")):
        assert main(["qualify", "--model", str(TINY), "--quick", "--kernels", "triton", "--kernel-setting", bad]) != 0
        assert why in capsys.readouterr().err
    settings = (("moe", "gate_up_split", 1), ("moe", "gate_up_scale", "product"))
    plan, _ = make_plan(str(TINY), quick=True, kernels=KernelPlan(moe=True), kernel_settings=settings)
    assert plan.base.kernel_settings == settings and plan.base.kernels.moe

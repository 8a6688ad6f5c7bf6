"""What `iquest qualify` prints for a reader: the lossless row as a p-value against its significance level, the
negative-control table with every name whole, and progress lines on a stderr that is not a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

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

    def slow(bar):
        release.wait(5)
        return "slow"

    def fast(x, bar):
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
    beats = [line for line in lines if re.search(r"\(running: healthy 0/3 for \d+ s; queued: none\)$", line)]
    assert len(beats) >= 2 and all(line.startswith("qualify: 1/4 steps done") for line in beats), lines
    assert re.fullmatch(r"qualify: 4/4 steps done, \d+ s elapsed \(healthy done; 0 units left on 2 workers\)",
                        lines[-1]), lines

    def broken(bar):
        raise RuntimeError("a unit failed")

    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="a unit failed"):
        gather(pool, {"x": (broken,)}, progress_bar(1, progress=False), {"x": 1}, 1)


# ---- units on worker processes: each step as it finishes, the stacks of a stall, a stall limit ---------------------
# The units run in spawned pool workers, which find them through the installed package (`units()`): pytest imports
# this file as tests.test_cli_qualify, a name a worker cannot import.
RANK = """
import time
from iquest.fast.stacks import dump_stacks_on_signal

def rank_waits():
    dump_stacks_on_signal()
    print("ready", flush=True)
    time.sleep(60)

rank_waits()
"""


def units():
    import importlib

    return importlib.import_module("iquest.tests.test_cli_qualify")


def value(x, steps, *, bar):
    bar.update(steps)
    return x


def steps_then_wait(steps: int, gate: str, *, bar):
    """`steps` steps, then wait for the file `gate`, which the parent's bar makes once it saw them: the unit cannot
    end before its steps reached the parent."""
    for _ in range(steps):
        bar.update(1)
    deadline = time.monotonic() + 8
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            return "the parent never saw the steps"
        time.sleep(0.02)
    return "released"


def one_step_then_sleep(seconds: float, pidfile: str, *, bar):
    """One step, then asleep, with a process of its own that prints its stacks on SIGUSR1, as a TP rank does (its pid
    in `pidfile`)."""
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    rank.stdout.readline()  # registered
    Path(pidfile).write_text(str(rank.pid))
    bar.update(1)
    time.sleep(seconds)
    rank.kill()
    rank.wait()
    return "woke"


def ticks_until(donefile: str, *, bar):
    """A step every 0.2 s until the file `donefile` exists (at most 60 s): a unit that goes on while another is
    quiet."""
    deadline = time.monotonic() + 60
    while not Path(donefile).exists() and time.monotonic() < deadline:
        bar.update(1)
        time.sleep(0.2)
    return "ticked"


def quiet_then_done(seconds: float, pidfile: str, donefile: str, *, bar):
    """one_step_then_sleep, then the file `donefile`."""
    out = one_step_then_sleep(seconds, pidfile, bar=bar)
    Path(donefile).touch()
    return out


def _warm_pool():
    """unit_pool(1) with its worker started (spawned, importing torch: seconds), so that a test's stall clock runs
    from the unit's start."""
    from iquest.qualify.run import unit_pool

    pool, progress = unit_pool(1)
    pool.submit(time.sleep, 0).result()
    return pool, progress


def test_units_on_worker_processes_move_the_bar_step_by_step(tmp_path):
    """The bar moves as a unit in a worker process finishes each step (the unit waits until the parent's bar saw its
    second step), and a unit's end adds only the steps it did not report: the total is the plan's, exactly."""
    from iquest.qualify.run import gather, unit_pool

    gate, seen = tmp_path / "gate", []

    class Bar:
        done, what = 0, ""

        def set_postfix_str(self, what):
            self.what = what

        def update(self, n=1):
            self.done += n
            seen.append((self.done, self.what))
            if self.what == "stepper 2/3":
                gate.touch()

    pool, progress = unit_pool(2)
    with pool:
        got = gather(pool, {"stepper": (units().steps_then_wait, 2, str(gate)), "over": (units().value, "v", 5)}, Bar(),
                     {"stepper": 3, "over": 2}, 2, progress=progress)
    assert got == {"stepper": "released", "over": "v"}
    mine = [what for _, what in seen if what.startswith("stepper")]
    assert mine[:2] == ["stepper 1/3", "stepper 2/3"] and mine[2].startswith("stepper done;") and len(mine) == 3, seen
    # "over" reported 5 steps of its 2, before or after its end came (another pipe): 2 counted either way
    assert seen[-1][0] == max(done for done, _ in seen) == 5, seen


def test_a_stall_prints_the_stacks_of_every_process_under_the_run(tmp_path, capfd):
    """No step for stall_s: one line naming the stalled unit with its steps and time, then the Python stacks of the
    worker (in the unit's function) and of the process it started (a TP rank's stand-in), once per stall."""
    from iquest.qualify.run import gather

    pool, progress = _warm_pool()
    with pool:
        t0 = time.monotonic()
        got = gather(pool, {"sleepy": (units().one_step_then_sleep, 3, str(tmp_path / "pid"))}, progress_bar(2),
                     {"sleepy": 2}, 1, progress=progress, stall_s=1)
    assert got == {"sleepy": "woke"} and time.monotonic() - t0 < 10
    err = capfd.readouterr().err
    stalls = [line for line in err.splitlines() if "sleepy 1/2" in line and "no step finished" in line]
    assert len(stalls) == 1 and re.fullmatch(r"qualify: no step finished for 1 s \(running: sleepy 1/2 for \d+ s; "
                                             r"queued: none\); the Python stacks of the processes running them follow "
                                             r"on stderr", stalls[0]), err
    worker = re.search(r"--- Python stacks of process (\d+) \(the worker running sleepy\):\n(.*\n)*?.*"
                       r"line \d+ in one_step_then_sleep\n", err)
    assert worker and re.search(rf"--- Python stacks of process \d+ \(started by {worker[1]}, the worker running "
                                r"sleepy\):\n(.*\n)*?.*line \d+ in rank_waits\n", err), err


def test_a_unit_quiet_while_others_step_prints_the_stacks(tmp_path, capfd):
    """One unit quiet for unit_stall_s while another steps (what a unit whose TP ranks wait on each other looks like,
    the run's other units going on): one line naming it, then its worker's stacks and its rank stand-in's, before the
    run's own stall watch (off here) would have said anything."""
    from iquest.qualify.run import gather, unit_pool

    done = str(tmp_path / "done")
    pool, progress = unit_pool(2)
    with pool:
        got = gather(pool, {"quiet": (units().quiet_then_done, 4, str(tmp_path / "pid"), done),
                            "ticker": (units().ticks_until, done)}, progress_bar(1000, progress=False),
                     {"quiet": 2, "ticker": 998}, 2, progress=progress, stall_s=0, unit_stall_s=1.5)
    assert got == {"quiet": "woke", "ticker": "ticked"}
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "made no step" in line]
    assert len(lines) == 1 and re.match(r"qualify: quiet made no step for \d+ s while other units did \(running: "
                                        r".*quiet 1/2 for \d+ s", lines[0]), err
    worker = re.search(r"--- Python stacks of process (\d+) \(the worker running quiet\):\n(.*\n)*?.*"
                       r"line \d+ in one_step_then_sleep\n", err)
    assert worker and re.search(rf"--- Python stacks of process \d+ \(started by {worker[1]}, the worker running "
                                r"quiet\):\n(.*\n)*?.*line \d+ in rank_waits\n", err), err


def test_a_stall_limit_ends_the_run_and_every_process_under_it(tmp_path, capfd):
    """No step for stall_limit: the stacks (stall_s 0 prints none before), then StallError naming the unit that did
    not finish with its steps, within the limit and a few seconds; no process the run started is left, the worker's
    own child (a TP rank's stand-in) included."""
    import psutil

    from iquest.qualify.run import StallError, gather

    pidfile = tmp_path / "pid"
    # processes this test process already had (a forkserver an earlier test's TP ranks started lives until the end)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pool, progress = _warm_pool()
    t0 = time.monotonic()
    try:
        with pytest.raises(StallError, match=r"no step finished for 2 s \(the stall limit\): these units did not "
                                             r"finish: hung 1/3 steps; their worker processes were ended"):
            gather(pool, {"hung": (units().one_step_then_sleep, 1000, str(pidfile))}, progress_bar(3, progress=False),
                   {"hung": 3}, 1, progress=progress, stall_s=0, stall_limit=2)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert time.monotonic() - t0 < 2 + 6
    err = capfd.readouterr().err
    assert "no step finished for 2 s (running: hung 1/3" in err and re.search(r"in one_step_then_sleep", err), err

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert gone(int(pidfile.read_text()))  # the worker's own child, out of the test process's tree once it is ended
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and not gone(p.pid)
            and "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own
    assert left == [], [p.cmdline() for p in left]


def test_the_stall_options_reach_the_run_and_a_stall_is_one_line(capsys, monkeypatch):
    """--stall-dump and --stall-limit are checked and passed on; a run that hit its stall limit exits 2 with one line
    (the stacks went to stderr before it), no traceback."""
    from iquest.cli.main import main
    from iquest.qualify import run
    from iquest.tests.helpers import TINY

    for flag in ("--stall-dump", "--stall-limit"):
        assert main(["qualify", "--model", str(TINY), "--quick", flag, "-1"]) == 2
        assert f"{flag} must be >= 0" in capsys.readouterr().err
    seen = {}

    def stalled(*args, **kwargs):
        seen.update(kwargs)
        raise run.StallError("no step finished for 5 s (the stall limit): these units did not finish: healthy 1/3 "
                             "steps")

    monkeypatch.setattr(run, "qualify", stalled)
    assert main(["qualify", "--model", str(TINY), "--quick", "--stall-dump", "2", "--stall-limit", "5"]) == 2
    err = capsys.readouterr().err
    assert err == ("iquest qualify: error: no step finished for 5 s (the stall limit): these units did not finish: "
                   "healthy 1/3 steps\n")
    assert (seen["stall_dump"], seen["stall_limit"]) == (2, 5)


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


def test_the_lossless_run_reports_its_requests_as_steps():
    """The lossless test's one run of requests (a minute and more on a GPU) reaches the bar as LOSSLESS_STEPS steps as
    its requests finish, so the quiet-unit watch sees it step: at cc0ae4b on an H200 the watch took it, a single step
    until its end, for a stalled unit at 45 s and printed every process's stacks."""
    from iquest.qualify.checks import lossless
    from iquest.qualify.run import LOSSLESS_STEPS, steps_of

    class Bar:
        def __init__(self):
            self.updates = []

        def update(self, n=1):
            self.updates.append(n)

    bar, seen = Bar(), []
    step = steps_of(bar, LOSSLESS_STEPS)
    for done in range(1, 1001):
        before = len(bar.updates)
        step(done, 1000)
        if len(bar.updates) > before:
            seen.append(done)
    assert bar.updates == [1] * LOSSLESS_STEPS and seen == [125 * k for k in range(1, LOSSLESS_STEPS + 1)]
    few = Bar()  # fewer requests than steps: every step still told, by the last request
    step = steps_of(few, LOSSLESS_STEPS)
    for done in range(1, 4):
        step(done, 3)
    assert sum(few.updates) == LOSSLESS_STEPS and len(few.updates) == 3
    calls = []
    lossless(3, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_the_lossless_run_draws_from_the_candidates_engine():
    """The lossless unit builds its engine from the candidate's options (run_lossless passes plan.base): its kernels
    and kernel settings, so a numerical form is judged there too (docs/PERF.md tells what the kernels alone missed).
    Here the MoE's kernels, under the interpreter (a process of its own), with both product forms (the defaults) on
    the micro fixture's 8 x 8 scale blocks, narrower than the 16-column K step, and a candidate differing in two other
    fields: every Gate/Up and Down launch takes the candidate's settings."""
    script = """
import dataclasses, json
from iquest.fast.plan import KernelPlan
from iquest.kernels import moe
from iquest.kernels.testing import patch_interpreter
from iquest.qualify.run import make_plan, run_lossless
from iquest.tests.helpers import TINY

patch_interpreter()
settings = (("moe", "down_registers", 120), ("moe", "gate_up_split", 2))
plan, _ = make_plan(str(TINY), quick=True, kernels=KernelPlan(moe=True), kernel_settings=settings)
seen = []
def spy(name, real):
    def call(*args, **kw):
        s = kw["settings"]
        seen.append((name, s.down_scale, s.down_registers, s.gate_up_split))
        return real(*args, **kw)
    return call
moe.gate_up, moe.down = spy("gate_up", moe.gate_up), spy("down", moe.down)
class Bar:
    def update(self, n=1):
        pass
row, _ = run_lossless(dataclasses.replace(plan, samples=2), Bar())
print(json.dumps({"check": row.check, "rows": row.rows, "seen": sorted(set(seen)), "calls": len(seen)}))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["check"] == "lossless" and got["rows"] == 2 and got["calls"] > 4
    assert got["seen"] == [["down", "product", 120, 2], ["gate_up", "product", 120, 2]]

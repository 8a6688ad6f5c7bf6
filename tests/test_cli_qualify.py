"""What `iquest qualify` prints for a reader: the lossless row as a p-value against its significance level, the
negative-control table with every name whole, and progress lines on a stderr that is not a terminal."""

from __future__ import annotations

import io
import re

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

"""lab/ncu_stalls.py: the stall reasons' shares and the costliest SASS lines of an Nsight Compute source page, on a
page made here (two lines, known samples) and on a recorded one (bench/results, 966 samples of Gate/Up)."""

from __future__ import annotations

import csv
from pathlib import Path

from iquest.lab import ncu_stalls

RECORDED = Path(__file__).resolve().parents[1] / "bench/results/ncu-moe_gate_up_kernel-source-9a35cf1.csv"


def test_shares_and_order_of_a_made_page(tmp_path):
    page = tmp_path / "page.csv"
    with open(page, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_long_sb",
                    "stall_wait (Not Issued)"])
        w.writerow(["0x10", "LDG R1, [R2]", "30", "0", "30", "0"])
        w.writerow(["0x20", "FFMA R3, R1, R1, R3", "1,0", "10", "0", "99"])  # a thousands separator: ten
    text = ncu_stalls.report(str(page))
    lines = text.splitlines()
    assert "samples 40" in lines[0]
    assert lines[1] == "  reasons: long_sb 75.0%, wait 25.0%"  # the Not Issued column is not a reason of its own
    assert "LDG" in lines[2] and "75.0%" in lines[2] and "FFMA" in lines[3] and "25.0%" in lines[3]


def test_a_recorded_page():
    text = ncu_stalls.report(str(RECORDED), top=3)
    assert "samples 966" in text and "reasons: wait 23.5%" in text and len(text.splitlines()) == 5

"""bench/moe_timeline.py: the timeline arithmetic on made-up stamps (the GPU run is the benchmark itself)."""

import torch

from iquest.bench.moe_timeline import one_call


def test_one_call_reads_owners_windows_and_sms():
    us = 1000  # ns
    stamps = torch.tensor([
        # start, owner known, done (0: owns nothing), SM
        [0 * us, 1 * us, 11 * us, 0],
        [0 * us, 2 * us, 13 * us, 0],
        [1 * us, 2 * us, 0, 1],  # a non-owner: exits at its owner check
        [3 * us, 4 * us, 15 * us, 2],
    ], dtype=torch.int64)
    r = one_call(stamps, expert_bytes=3_000_000, distinct=2)
    assert r["programs"] == 4 and r["owners"] == 3
    assert r["span_us"] == 15.0 and r["owners_window_us"] == 15.0
    assert r["owner_stream_us"]["min"] == 10.0 and r["owner_stream_us"]["max"] == 11.0
    assert r["owner_start_us"]["max"] == 3.0 and r["other_exit_us"]["median"] == 2.0
    # 2 experts x 2 MB of Gate/Up weight over 15 us
    assert abs(r["window_tb_s"] - 4e6 / 15e-6 / 1e12) < 1e-12
    assert r["owners_per_sm"] == {"1": 1, "2": 1}  # one SM ran two owners, one SM ran one

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


def test_stream_bound_sums_streams_and_steps():
    from iquest.bench import stream_probe as sp

    flat = {mb: 1.0 for mb in sp.LAYER_STREAMS_MB.values()} | {sp.LM_HEAD_MB: 10.0}
    r = sp.stream_bound(flat, step_us=0.5)
    streams = sp.LAYER_CALLS * 5 + sp.LM_HEADS
    assert r["streams"] == streams and r["layer_streams_us"] == 5.0
    assert r["us"] == sp.LAYER_CALLS * 5.0 + sp.LM_HEADS * 10.0 + (sp.ROUND_KERNELS - streams) * 0.5
    assert sp.stream_bound(flat, 0.5, pdl_overlap=True)["us"] == r["us"] - streams * 0.5

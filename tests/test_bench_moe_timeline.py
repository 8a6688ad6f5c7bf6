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


def test_round_streams_are_the_rank_slices():
    from iquest.bench import stream_probe as sp, tune
    from iquest.bench.kernels_micro import FULL_CONFIG
    from iquest.reference.config import Config

    config = Config.from_file(FULL_CONFIG)
    s = sp.round_streams(config, tune.tune_shape(config))
    # one TP8 rank: 256 experts x 6144 bf16 router, o_proj 6144 x 768, q/k/v 1024 x 6144, 13 experts' 256 x 6144 Down
    # and twice that in Gate/Up (E4M3), the LM head's 20,000 x 6144 bf16 vocabulary slice
    assert s == {"router": 3_145_728, "o_proj": 4_718_592, "qkv": 6_291_456, "down": 20_447_232,
                 "gate_up": 40_894_464, "lm_head": 245_760_000}


def test_stream_bound_sums_streams_and_steps():
    from iquest.bench import stream_probe as sp

    flat = {"router": 1.0, "o_proj": 1.0, "qkv": 1.0, "down": 1.0, "gate_up": 1.0, "lm_head": 10.0}
    r = sp.stream_bound(flat, step_us=0.5, layer_calls=93, lm_heads=6, round_kernels=1197)
    streams = 93 * 5 + 6
    assert r["streams"] == streams and r["layer_streams_us"] == 5.0
    assert r["us"] == 93 * 5.0 + 6 * 10.0 + (1197 - streams) * 0.5
    assert sp.stream_bound(flat, 0.5, 93, 6, 1197, pdl_overlap=True)["us"] == r["us"] - streams * 0.5

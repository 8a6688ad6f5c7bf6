"""`moe(gate_up_direct=True)` (kernels/moe_gate_up_direct.py, Gluon): which calls it takes, its SASS for the H200
compiled on any machine, and on the GPU the same bits as the Triton Gate/Up at one TP8 rank's full size (every
output of the MoE, the fp32 hidden before act_quant included), with a negative control (each split's tiles summed in
reverse) that the same comparison catches, and a decode through the engine with and without the stage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from iquest.kernels import moe as mk
from iquest.kernels import moe_gate_up_direct as gud
from iquest.kernels.fp8_linear_direct import groups_for


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 12), tiles=st.integers(1, 12), h_tiles=st.integers(1, 64), i16=st.integers(1, 20),
       ragged=st.booleans())
def test_which_shapes_fit(rows, tiles, h_tiles, i16, ragged):
    """A split's tiles go to one or two warps in whole steps (tile j * G + g), each warp holding at most MAX_STEPS of
    Gate's and Up's tiles; a block of at most 8 rows; whole 128-wide K tiles and 16-channel groups."""
    g = groups_for(tiles)
    assert (tiles // g) * g == tiles
    H, I = 128 * h_tiles + (64 if ragged else 0), 16 * i16 + (8 if ragged else 0)
    want = rows <= 8 and tiles in (1, 2, 3, 4, 6, 8) and not ragged
    assert gud.fits(rows, H, I, (128, 128), 128 * tiles) == want
    assert not gud.fits(rows, H, I, (128, 64), 128 * tiles)


def test_not_taken_off_the_gpu():
    """On the CPU (the interpreter) the engine's question says no, and moe() runs the Triton Gate/Up."""
    x16 = torch.zeros(6, 6144, dtype=torch.float16)
    xd = torch.ones(6, 48)
    assert not gud.applies(x16, 6, 6144, 256, (128, 128), 768)
    assert not mk.gate_up_direct_takes((x16, xd), 6, 8, 256, 6144, 256, (128, 128))
    assert not mk.gate_up_direct_takes(None, 6, 8, 256, 6144, 256, (128, 128))


def test_sass_loads_every_weight_at_once_and_stages_nothing_across_warps():
    """The design's point, on the compiled kernel (sm_90a, any machine) at the engine's full-size form (8 splits of
    6 K tiles, 2 warps): in an item's pass every load (Gate's and Up's 24 KB, their scales, x's tiles) is issued
    before its first MMA; 3 tiles a warp of Gate and of Up are 48 MMAs; shared memory is 1 KB (the two warps'
    products; a warp's own transposes of its bytes), where a program's weights are 24 KB; nothing spills."""
    from iquest.bench import sass

    kernel = sass.compile_spec(sass.specs()["moe_gate_up_direct"])
    r, seq = sass.report(kernel), sass.sequence(kernel)
    assert r["stack_bytes"] == 0 and r["shared_bytes"] <= 1024 and r["mix"]["HMMA"] == 48, r
    wait, first_mma = seq.index("ACQBULK"), seq.index("HMMA")
    routing = seq.index("STS", wait)  # the routing's loads, then the owners' exchange between the warps
    assert sum(op == "LDG" for op in seq[wait:routing]) >= 3  # the pairs' experts (twice), the routing matrix
    assert sum(op == "LDG" for op in seq[routing:first_mma]) >= 2 * 3 * 4 + 3 * 4  # weights (16 B each), x's tiles
    assert "LDG" not in seq[first_mma:]


# ---- GPU ------------------------------------------------------------------------------------------------
def _case(R: int, **kw) -> dict:
    from iquest.tests.test_kernel_moe import FULL, case

    return case(f"direct_{R}", R=R, **dict(FULL, x="fp32", out="bf16", compute="bf16", **kw))


def _run(c: dict, t: dict, direct: bool, **debug_kw) -> tuple[torch.Tensor, dict]:
    """mk.moe as the engine calls it (fp32 routing input, bf16 compute, the norm's fp16 operand tiles), with the
    debug outputs."""
    from iquest.kernels.f16_operands import f16_rows_tiles
    from iquest.tests.test_kernel_moe import ARGS

    f16_input = f16_rows_tiles(t["x"].to(torch.bfloat16).float().contiguous(), 128)
    debug = dict(debug_kw)
    out = mk.moe(*(t[a] for a in ARGS), block=c["block"], group=c["block"][1], out_dtype=torch.bfloat16,
                 compute_dtype=torch.bfloat16, f16_input=f16_input, pdl=True, fp8_down=True, early_down=True,
                 split_k=c["split_k"], gate_up_direct=direct, debug=debug)
    return out, debug


GPU_CASES = [_case(6), _case(8), _case(2), _case(1), _case(8, pattern="same"),
             _case(8, pattern="poison", live="count"), _case(8, live="mask"),
             _case(6, split_k=16, split=16),  # 3 tiles a split: one warp
             _case(6, split_k=6, split=6)]  # 8 tiles a split: 4 a warp


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=[f"{c['R']}rows_{c['pattern']}_{c['live']}_{c['split_k']}"
                                               for c in GPU_CASES])
def test_gpu_same_bits_as_the_triton_gate_up(c):
    from iquest.tests.test_kernel_moe import build

    t, _ = build(c, "cuda")
    want, dw = _run(c, t, direct=False)
    got, dg = _run(c, t, direct=True)
    assert dg["gate_up_direct"] and not dw["gate_up_direct"]
    live_pairs = dw["split_counts"] > 0
    for name in ("hidden", "act_scale"):
        a, b = dg[name][live_pairs], dw[name][live_pairs]
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    assert torch.equal(dg["act"][live_pairs].view(torch.uint8), dw["act"][live_pairs].view(torch.uint8))
    assert torch.equal(dg["programs"][0], dw["programs"][0])  # the same owners did the work
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_gpu_negative_control_reversed_tiles_is_caught():
    """The direct kernel with each split's tiles summed last to first (the same products, another fp32 rounding):
    the hidden comparison above catches it, and the branch ran (debug says the direct kernel took the call)."""
    from iquest.tests.test_kernel_moe import build

    c = _case(6)
    t, _ = build(c, "cuda")
    _, dw = _run(c, t, direct=False)
    _, bad = _run(c, t, direct=True, reversed_gate_up=True)
    assert bad["gate_up_direct"]
    live_pairs = dw["split_counts"] > 0
    differ = (bad["hidden"][live_pairs].view(torch.int32) != dw["hidden"][live_pairs].view(torch.int32)).sum()
    assert int(differ) > 0
    torch.testing.assert_close(bad["hidden"][live_pairs], dw["hidden"][live_pairs], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_decode_with_the_direct_gate_up_is_bit_identical(tmp_path):
    """Stage moe_direct through the engine's captured decode loop, on a small random model whose experts have
    128 x 128 blocks (the fixtures' smaller blocks never take the kernel): the same tokens, logprobs and acceptance
    sequence as without it, with the direct calls counted (and none without the stage)."""
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine
    from iquest.fixtures.make import PRESETS, random_weights
    from iquest.reference.checkpoint import save_checkpoint
    from iquest.reference.config import Config, GenerationConfig
    from iquest.tests.test_fast_engine import PROMPTS, fast_steps

    config = Config.from_dict(dict(PRESETS["tiny"], hidden_size=512, head_dim=64, moe_intermediate_size=128,
                                   quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                        "weight_block_size": [128, 128]}))
    save_checkpoint(tmp_path, config, random_weights(config, 3), GenerationConfig(eos_token_id=config.eos_token_id))
    runs = {}
    for kernels in ("triton", "triton+moe_direct"):
        engine = RankEngine(tmp_path, Parallel.single("cuda"), EngineOptions(max_context=256, dtype="bf16",
                                                                           kernels=kernels))
        steps = [fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=24) for i, drafts in ((0, 3), (1, 7))]
        runs[kernels] = ([[(s.tokens, s.logprobs, s.drafts, s.accepted) for s in st] for st in steps],
                         engine.model.ops.moe_direct_calls)
    (base, base_calls), (direct, direct_calls) = runs["triton"], runs["triton+moe_direct"]
    assert base_calls == 0 and direct_calls > 0
    assert direct == base

"""`moe(down_direct=True)` (kernels/moe_down_direct.py, Gluon): which calls it takes, its SASS for the H200 compiled on
any machine, and on the GPU the same bits as the fp16-operand Triton Down at one TP8 rank's full size (with and
without the early routing, past the grid's expert slots too), with a negative control (the K tiles summed in
reverse) that the same comparison catches, and a decode through the engine with and without the stage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from iquest.kernels import moe as mk
from iquest.kernels import moe_down_direct as mdd


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 12), h_groups=st.integers(1, 48), i_tiles=st.integers(1, 6), ragged=st.booleans(),
       block=st.sampled_from([(128, 128), (128, 64), (64, 128)]), group=st.sampled_from([128, 64]),
       block_k=st.sampled_from([64, 128]))
def test_which_shapes_fit(rows, h_groups, i_tiles, ragged, block, group, block_k):
    """At most 8 rows, 128 x 128 blocks and groups, Down's 64-wide K tiles, whole 128-channel groups, 1-4 K tiles."""
    H, I = 128 * h_groups + (64 if ragged else 0), 64 * i_tiles + (32 if ragged else 0)
    want = (rows <= 8 and block == (128, 128) and group == 128 and block_k == 64 and not ragged and i_tiles <= 4)
    assert mdd.fits(rows, H, I, block, group, block_k) == want


def test_not_taken_off_the_gpu_or_beside_fp8_down():
    """The direct Down replaces the fp16-operand Down only: never on the CPU (the interpreter), never where the E4M3
    wgmma Down or the folded combine (locks) is taken."""
    shape = (6, 6144, 256, (128, 128), 128, 64)
    assert not mk.down_direct_applies(True, False, True, torch.device("cpu"), *shape)
    assert not mk.down_direct_applies(False, False, True, torch.device("cuda"), *shape)
    assert not mk.down_direct_applies(True, True, True, torch.device("cuda"), *shape)
    assert not mk.down_direct_applies(True, False, False, torch.device("cuda"), *shape)
    assert not mk.down_direct_applies(True, False, True, torch.device("cuda"), *shape, locks=torch.zeros(1))
    if not mk.INTERPRETED:
        assert mk.down_direct_applies(True, False, True, torch.device("cuda"), *shape)


def test_sass_holds_the_weights_before_the_wait():
    """The design's point, on the compiled kernel (sm_90a, any machine) at the engine's full-size form (I_r 256: 4 K
    tiles of 64; early routing): the routing and every weight load (a thread's 4 x 64 bytes, 16 at a time) are issued
    before the PDL wait (ACQBULK); after it, the activations' loads come before the first MMA; 4 tiles x 4 K steps x
    2 channel blocks a warp are 32 MMAs an item (twice: the first item and the loop past the grid's slots); nothing
    spills."""
    from iquest.bench import sass

    kernel = sass.compile_spec(sass.specs()["moe_down_direct"])
    r, seq = sass.report(kernel), sass.sequence(kernel)
    assert r["stack_bytes"] == 0 and r["mix"]["HMMA"] == 64, r
    wait = seq.index("ACQBULK")
    first_mma = seq.index("HMMA")
    assert sum(op == "LDG" for op in seq[:wait]) >= 3 + 4 * 4  # the routing, then the weight tiles
    assert sum(op == "LDG" for op in seq[wait:first_mma]) >= 4  # the activations' tiles (and their scales)
    assert wait < first_mma


# ---- GPU ------------------------------------------------------------------------------------------------
def _case(R: int, **kw) -> dict:
    from iquest.tests.test_kernel_moe import FULL, case

    return case(f"down_direct_{R}", R=R, **dict(FULL, x="fp32", out="bf16", compute="bf16", **kw))


def _run(c: dict, t: dict, direct: bool, out_dtype=torch.float32, early: bool = True, **debug_kw):
    """mk.moe as the engine calls it with the fp16-operand Down (fp32 routing input, bf16 compute, the norm's fp16
    operand tiles, PDL), the output in `out_dtype` (fp32: every bit of y's sum shows), with the debug outputs."""
    from iquest.kernels.f16_operands import f16_rows_tiles
    from iquest.tests.test_kernel_moe import ARGS

    f16_input = f16_rows_tiles(t["x"].to(torch.bfloat16).float().contiguous(), 128)
    debug = dict(debug_kw)
    out = mk.moe(*(t[a] for a in ARGS), block=c["block"], group=c["block"][1], out_dtype=out_dtype,
                 compute_dtype=torch.bfloat16, f16_input=f16_input, pdl=True, fp8_down=False, early_down=early,
                 down_direct=direct, debug=debug)
    return out, debug


def _distinct(t: dict, live: torch.Tensor) -> int:
    return len(set(t["experts"][live.to(t["experts"].device)].flatten().tolist()))


GPU_CASES = [(6, {}, True), (8, {}, True), (8, {}, False), (2, {}, True), (1, {}, True),
             (8, {"pattern": "same"}, True), (8, {"pattern": "poison", "live": "count"}, True),
             (8, {"live": "mask"}, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("R, kw, early", GPU_CASES,
                         ids=[f"{R}rows_{'_'.join(map(str, kw.values())) or 'random'}_{'early' if e else 'late'}"
                              for R, kw, e in GPU_CASES])
def test_gpu_same_bits_as_the_triton_down(R, kw, early):
    from iquest.tests.test_kernel_moe import build

    c = _case(R, **kw)
    t, live = build(c, "cuda")
    for out_dtype in (torch.float32, torch.bfloat16):
        want, dw = _run(c, t, False, out_dtype, early)
        got, dg = _run(c, t, True, out_dtype, early)
        assert dg["down_direct"] and not dw["down_direct"]
        assert torch.equal(dg["programs"][1], dw["programs"][1])  # the same experts' owners
        same = got.view(-1).view(torch.uint8) == want.view(-1).view(torch.uint8)
        assert bool(same.all()), f"{int((~same).sum())} bytes differ; max |diff| {(got - want).abs().max()}"
    if R == 8 and not kw:  # random routing of 8 rows: more distinct experts than the grid's slots (the loop ran)
        assert _distinct(t, live) > mk.expected_segments(R * c["k"], c["E"], c["k"])


@pytest.mark.gpu
def test_gpu_negative_control_reversed_tiles_is_caught():
    """The direct Down with its K tiles summed last to first (the same products, another fp32 rounding): the fp32
    output comparison above catches it, and the branch ran."""
    from iquest.tests.test_kernel_moe import build

    c = _case(6)
    t, _ = build(c, "cuda")
    want, _ = _run(c, t, False)
    bad, db = _run(c, t, True, reversed_down=True)
    assert db["down_direct"]
    assert not torch.equal(bad, want)
    torch.testing.assert_close(bad, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.gpu
def test_gpu_decode_with_the_direct_down_is_bit_identical(tmp_path):
    """Stage down_direct through the engine's captured decode loop, on a small random model whose experts have
    128 x 128 blocks (the fixtures' smaller blocks never take the kernel): the same tokens, logprobs and acceptance
    sequence as the fp16-operand Triton Down, with the direct calls counted (and none without the stage)."""
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
    for kernels in ("triton-fp8_down", "triton-fp8_down+down_direct"):
        engine = RankEngine(tmp_path, Parallel.single("cuda"), EngineOptions(max_context=256, dtype="bf16",
                                                                           kernels=kernels))
        steps = [fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=24) for i, drafts in ((0, 3), (1, 7))]
        runs[kernels] = ([[(s.tokens, s.logprobs, s.drafts, s.accepted) for s in st] for st in steps],
                         engine.model.ops.down_direct_calls)
    (base, base_calls), (direct, direct_calls) = runs["triton-fp8_down"], runs["triton-fp8_down+down_direct"]
    assert base_calls == 0 and direct_calls > 0
    assert direct == base

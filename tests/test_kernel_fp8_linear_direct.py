"""`fp8_linear_direct` (kernels/fp8_linear_direct.py, Gluon): the weight's fragment order on the CPU, its SASS for the
H200 compiled on any machine, and on the GPU the same bits as the Triton kernel's preloading path at one TP8 rank's
projection shapes, with a negative control (the tiles summed in reverse) that those checks catch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from iquest.kernels import fp8_linear as fl, fp8_linear_direct as fd
from iquest.kernels.fp8_linear_direct import direct_weight
from iquest.kernels.testing import substituted
from iquest.reference.fp8 import quantize
from iquest.tests.kernel_controls import DIRECT_REVERSED

E4M3 = torch.float8_e4m3fn


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), tiles=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_direct_weight_is_the_fragment_order(n, tiles, seed):
    """Column 32q + 4s + 2h + e of each 128-wide tile holds W's column 16s + 8h + 2q + e (the m16n8k16 A fragment of
    lane quarter q at K step s), every byte once; W is unchanged."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (n, 128 * tiles), generator=g, dtype=torch.uint8).view(E4M3)
    before = w.view(torch.uint8).clone()
    d = direct_weight(w).view(torch.uint8)
    src = torch.tensor([16 * s + 8 * h + 2 * q + e for q in range(4) for s in range(8) for h in range(2)
                        for e in range(2)])
    cols = torch.cat([128 * t + src for t in range(tiles)])
    assert d.shape == w.shape and d.is_contiguous()
    assert torch.equal(d, w.view(torch.uint8)[:, cols])
    assert torch.equal(w.view(torch.uint8), before)


def test_direct_weight_rejects_a_partial_tile():
    with pytest.raises(ValueError, match="multiple of 128"):
        direct_weight(torch.zeros(16, 96).to(E4M3))


def test_direct_refused_off_the_gpu():
    """On the CPU (the interpreter) the wrapper refuses with the reason, rather than running another form; the
    operands are checked as fp8_linear checks them."""
    w, s = quantize(torch.randn(64, 256), (128, 128))
    x = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs a preloading call"):
        fd.fp8_linear_direct(x, direct_weight(w), s)
    with pytest.raises(ValueError, match="scale must be"):
        fd.fp8_linear_direct(x, direct_weight(w), s[:, :1])


def test_only_weights_whose_calls_it_takes_are_copied():
    """A copy in the fragments' order is made for a weight whose calls preload whole 128-wide K tiles, <= 8 a split:
    a TP8 rank's o_proj [3072, 768] in one split (6 tiles), not TP 1's [3072, 6144] (48), nor 32-wide blocks."""
    one = fl.LinearSettings(split_k=1)
    cpu = torch.device("cpu")
    assert fd.takes_weight(3072, 768, (128, 128), one, cpu)
    assert not fd.takes_weight(3072, 6144, (128, 128), one, cpu)
    assert not fd.takes_weight(256, 256, (32, 32), one, cpu)


def test_lock_count_is_one_a_16_by_8_tile():
    assert fd.lock_count(6, 1024) == 64 and fd.lock_count(12, 1000) == 63 * 2


def test_sass_keeps_the_weights_out_of_shared_memory():
    """The design's point, checked on the compiled kernel (sm_90a, any machine), o_proj's form: the weights go from
    their 16-byte loads, all issued before the PDL wait, straight into the MMAs; shared memory holds only x's tiles
    and the two warps' products (1 KB at a time, where one program's weight tiles are 12 KB); every x load is issued
    before the first MMA (one L2 round trip); 3 K tiles a warp are 24 MMAs; nothing spills."""
    from iquest.bench import sass

    kernel = sass.compile_spec(sass.specs()["fp8_linear_direct"])
    r, seq = sass.report(kernel), sass.sequence(kernel)
    assert r["stack_bytes"] == 0 and r["shared_bytes"] <= 1024 and r["mix"]["HMMA"] == 24, r
    wait, first_mma = seq.index("ACQBULK"), seq.index("HMMA")
    assert sum(op == "LDG" for op in seq[:wait]) >= 12  # 3 tiles x 2 rows x 2 16-byte loads, and the scales
    assert "LDG" not in seq[first_mma:]


# ---- GPU ------------------------------------------------------------------------------------------------
def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** (torch.rand(-(-n // 128), k // 128, generator=g) * 4 - 2)  # each block's scale matters
    real = torch.randn(n, k, generator=g) * mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    w, s = quantize(real, (128, 128))
    x = torch.randn(m, k, generator=g).to(dtype)
    return x.cuda(), w.cuda(), s.cuda()


# (rows, N, K, form): q/k/v as the engine calls it (its K splits summed in the launch, or by a second pass), o_proj
# (one split, stored), a partial output tile, and more rows than one block. `fp32`: the output in fp32, so the sum's
# last bits are not rounded away (the negative control must show there).
GPU_CASES = [(6, 1024, 3072, "serial_fp32"), (6, 1024, 3072, "serial"), (1, 1024, 3072, "two_pass_fp32"),
             (8, 1024, 3072, "serial"), (6, 3072, 768, "out"), (1, 3072, 768, "out"), (6, 1000, 768, "out"),
             (6, 3072, 768, "out_fp32"), (12, 1024, 3072, "serial"),
             # one warp a program (odd tile counts): 2 splits of 1 tile
             (6, 512, 256, "serial")]


def _call(linear, form, x, w, s, locks_for):
    kw = dict(block=(128, 128), pdl=True, out_dtype=torch.float32 if form.endswith("_fp32") else None)
    if form.startswith("serial"):
        locks = torch.zeros(locks_for, dtype=torch.int32, device=x.device)
        got = linear(x, w, s, locks=locks, **kw)
        assert int(locks.abs().sum()) == 0  # left zeroed for the next call
        return got
    return linear(x, w, s, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,form", GPU_CASES)
def test_gpu_same_bits_as_the_triton_kernel(m, n, k, form, dtype):
    x, w, s = _operands(m, n, k, dtype, seed=m * 7 + n)
    assert fl.preload_plan(m, n, k, (128, 128), device=x.device) > 0  # the Triton kernel's preloading path
    want = _call(fl.fp8_linear, form, x, w, s, fl.lock_count(m, n))
    d = direct_weight(w)
    got = _call(fd.fp8_linear_direct, form, x, d, s, fd.lock_count(m, n))
    assert got.shape == want.shape and got.dtype == want.dtype
    same = got.view(-1).view(torch.uint8) == want.view(-1).view(torch.uint8)
    assert bool(same.all()), f"{int((~same).sum())} bytes differ; max |diff| {(got.float() - want.float()).abs().max()}"
    # The negative control runs: the same kernel with its tiles summed last to first, the same product in another
    # fp32 rounding. An fp32 output shows it, so this comparison catches it there; a stored bf16 or fp16 output mostly
    # rounds it away (at o_proj's shape every element matched on the H200), so there it is only checked to stay close.
    with substituted(fd, DIRECT_REVERSED):
        bad = _call(fd.fp8_linear_direct, form, x, d, s, fd.lock_count(m, n))
    if form.endswith("_fp32"):
        assert not torch.equal(bad, want)
    torch.testing.assert_close(bad.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.float().abs().max()))

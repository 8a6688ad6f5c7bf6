"""kernels/fp8_linear.py against x @ dequantize(W).T (reference/fp8.py).

Small shapes (blocks of 16/32, partial N and K tiles and partial scale blocks, 1/3/8/17 rows, split-K
on and off, a strided x like the eh_proj column slice) run under Triton's CPU interpreter in one
worker subprocess, the preloaded form only where a case says whether it is taken (INTERPRETED_CASES: each run is
another interpretation); `@pytest.mark.gpu` cases use one TP8 rank's projection shapes with 128x128 blocks.
Weights come from reference/fp8.quantize with per-block magnitudes that differ by orders of
magnitude, so a scale applied to the wrong block shows; outputs are pre-filled with NaN. Each case's
launch is `LinearSettings` with its split_k and block_n, run as the K loop (preload off) and, where
it is taken, preloaded: the same bits.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from iquest.kernels import fp8_linear as fl
from iquest.reference.fp8 import quantize
from iquest.kernels.testing import interpreted_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}  # relative to max |ref|, by output dtype

BASE = dict(M=8, N=40, K=96, block=(16, 16), x="fp32", out=None, split_k=None, block_n=16, x_stride=None,
            serial=False, seed=0, preloads=None, order_control=False)
# order_control: the negative control of the bit checks: the same call with another split (the same products summed in
# another order) must NOT be bit-equal, or the preload's bit-equality check could not see a reordered sum
# preloads: whether `LinearSettings.preload` must be taken (whole splits of at most MAX_PRELOAD K tiles); None: either


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_fp32", M=1),
    case("8rows_fp32", preloads=True, order_control=True),
    case("3rows_partial_k_block", M=3, K=72, preloads=False),
    case("17rows_two_m_tiles", M=17, N=33),
    case("split_k_3", split_k=3, order_control=True),
    case("split_k_max_with_partial_k", K=88, split_k=6, preloads=False),
    case("no_split", split_k=1, N=200, block_n=32, preloads=True),
    case("rect_blocks_32x16", block=(32, 16), N=70, K=80),
    case("rect_blocks_16x32", block=(16, 32), N=50, K=100, split_k=2),
    case("bf16_in_bf16_out", x="bf16"),
    case("bf16_in_fp32_out", x="bf16", out="fp32", split_k=2),
    case("fp32_in_bf16_out_1row", M=1, out="bf16"),
    case("fp16_in", x="fp16", split_k=2),
    case("strided_x_like_eh_proj", x_stride=2, split_k=2),
    case("auto_split_block_64", N=64, K=512, block=(32, 64), block_n=64),
    # The split sum done by each tile's last split (counters): bit-equal to the two-pass sum, counters re-armed.
    case("serial_split_3", split_k=3, serial=True, preloads=True),
    case("serial_17rows_partial_k", M=17, N=33, K=88, split_k=6, serial=True),
    # more splits than serial_sum reads at once (UNROLL = 8): a full group, then a partial one
    case("serial_split_11_two_groups", K=176, split_k=11, serial=True),
    case("serial_bf16_out", x="bf16", split_k=2, serial=True),
    case("serial_no_split", split_k=1, N=200, block_n=32, serial=True),
    # Launch choices that schedule the same sums: other warps and pipeline depth, the same bits as the default's
    case("warps_2_stages_2", split_k=3, warps=2, stages=2, preloads=True),
]
# The interpreter runs every case, the preloaded form only where a case says whether it is taken; the GPU runs all.
INTERPRETED_CASES = CASES

GPU_CASES = [  # one TP8 rank of docs/model.md's model: H = 3072, 6 query heads + 1 KV head of 128, F/tp = 1536
    case("gpu_q_proj_8rows", N=768, K=3072, block=(128, 128), x="bf16", block_n=64, preloads=True),
    case("gpu_k_proj_1row", M=1, N=128, K=3072, block=(128, 128), x="bf16", block_n=64),
    case("gpu_k_proj_8rows", N=128, K=3072, block=(128, 128), x="bf16", block_n=64),
    case("gpu_o_proj_8rows", N=3072, K=768, block=(128, 128), x="bf16", block_n=64),
    case("gpu_eh_proj_strided", N=3072, K=768, block=(128, 128), x="bf16", block_n=64, x_stride=2),
    case("gpu_dense_gate_8rows", N=1536, K=3072, block=(128, 128), x="bf16", block_n=64),
    case("gpu_dense_down_6rows", M=6, N=3072, K=1536, block=(128, 128), x="bf16", block_n=64),
    case("gpu_fp32_in_fp32_out", M=4, N=768, K=3072, block=(128, 128), x="fp32", block_n=64),
    case("gpu_bf16_fp32_out_partial", M=5, N=1000, K=2000, block=(128, 128), x="bf16", out="fp32", block_n=64,
         preloads=False),
    case("gpu_qkv_proj_8rows_serial", N=1024, K=3072, block=(128, 128), x="bf16", block_n=64, serial=True,
         preloads=True),
    case("gpu_o_proj_6rows_serial", M=6, N=3072, K=768, block=(128, 128), x="bf16", block_n=64, serial=True),
    case("gpu_k_proj_1row_serial", M=1, N=128, K=3072, block=(128, 128), x="bf16", block_n=64, serial=True),
    # the engine's launch: the default settings (split from N, preloaded)
    case("gpu_qkv_proj_8rows_default", N=1024, K=3072, block=(128, 128), x="bf16",
         block_n=fl.LinearSettings().block_n, serial=True, preloads=True),
]


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    M, N, K, (B0, B1) = c["M"], c["N"], c["K"], c["block"]
    # Per-block magnitudes spanning ~4 decades, so each block's scale matters.
    mag = 10 ** (torch.rand(-(-N // B0), -(-K // B1), generator=gen) * 4 - 2)
    real = torch.randn(N, K, generator=gen) * mag.repeat_interleave(B0, 0)[:N].repeat_interleave(B1, 1)[:, :K]
    w, scale = quantize(real, (B0, B1))
    wide = torch.randn(M, K * (c["x_stride"] or 1), generator=gen).to(DTYPES[c["x"]])
    x = wide[:, :K]  # unit stride along K, row stride K * x_stride
    return dict(x=x.to(device), w=w.to(device), scale=scale.to(device))


def settings(c: dict, preload: bool = False, **over) -> fl.LinearSettings:
    """The case's launch: its split and tile width, warps and stages, preloading or not."""
    kw = dict(split_k=c["split_k"], block_n=c["block_n"], preload=preload)
    kw.update({k: c[f] for k, f in (("num_warps", "warps"), ("num_stages", "stages")) if f in c})
    return fl.LinearSettings(**dict(kw, **over))


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    out_dtype = DTYPES[c["out"]] if c["out"] else None
    out = torch.full((c["M"], c["N"]), float("nan"), dtype=out_dtype or t["x"].dtype, device=device)
    got = fl.fp8_linear(t["x"], t["w"], t["scale"], c["block"], out_dtype=out_dtype, out=out, settings=settings(c))
    assert got is out
    ref = fl.fp8_linear_ref(t["x"], t["w"], t["scale"], c["block"], torch.float32)
    scale = ref.abs().max().item()
    r = {"rel_err": (got.float() - ref).abs().max().item() / scale, "finite": bool(torch.isfinite(got).all()),
         "dtype": str(got.dtype).removeprefix("torch.")}
    if "warps" in c or "stages" in c:  # against the default warps and stages: the same sums, the same bits
        plain = fl.fp8_linear(t["x"], t["w"], t["scale"], c["block"], out_dtype=out_dtype,
                              settings=settings(c, num_warps=4, num_stages=fl.LinearSettings().num_stages))
        r["launch_bits"] = bool(torch.equal(plain, got))
    # The same call with the weight tiles loaded before the (PDL) wait: the same bits, where it is taken (under the
    # interpreter in the cases that say whether it must be; on the GPU in every case).
    if c["preloads"] is not None or device != "cpu":
        pre = fl.fp8_linear(t["x"], t["w"], t["scale"], c["block"], out_dtype=out_dtype,
                            out=torch.full_like(out, float("nan")), pdl=t["x"].is_cuda,
                            settings=settings(c, preload=True))  # on the GPU with its wait: the opaque move too
        r.update(preload_bits=bool(torch.equal(pre, got)), preloaded=fl.preload_plan(
            c["M"], c["N"], c["K"], c["block"], settings(c, preload=True), t["x"].device) > 0)
    if c["order_control"]:
        splits = fl.split_plan(c["N"], c["K"], c["block"], settings(c), t["x"].device)[1]
        other = fl.fp8_linear(t["x"], t["w"], t["scale"], c["block"], out_dtype=out_dtype,
                              settings=settings(c, split_k=1 if splits > 1 else 3))
        r["reordered_bits"] = bool(torch.equal(other, got))
    if c["serial"]:
        locks = torch.zeros(fl.lock_count(c["M"], c["N"], settings(c)) + 3, dtype=torch.int32, device=device)
        runs = [fl.fp8_linear(t["x"], t["w"], t["scale"], c["block"], out_dtype=out_dtype, locks=locks,
                              out=torch.full_like(out, float("nan")), pdl=pre and t["x"].is_cuda,
                              settings=settings(c, preload=pre))
                for pre in (False, False, True)]  # later calls reuse the counters the first one left
        r.update(serial_bits=all(bool(torch.equal(g, got)) for g in runs), locks_rearmed=int(locks.abs().sum()) == 0)
    return r


def _check(c: dict, r: dict) -> None:
    out = c["out"] or c["x"]
    assert r["dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[out]
    assert r["finite"], "kernel left NaN in the output"
    assert r["rel_err"] <= TOL[out], (f"{c['name']}: max |kernel - ref| / max |ref| = {r['rel_err']:.2e} "
                                      f"> {TOL[out]:.0e}")
    assert r.get("preload_bits", True), "the weight tiles preloaded before the wait change the output"
    assert r.get("launch_bits", True), "other warps or pipeline depth change the output"
    if c["order_control"]:
        assert not r["reordered_bits"], "another summation order gave the same bits: the bit checks prove nothing here"
    if c["preloads"] is not None:
        assert r["preloaded"] == c["preloads"], f"{c['name']}: preload taken: {r['preloaded']}, not {c['preloads']}"
    if c["serial"]:
        assert r["serial_bits"], "the in-kernel split sum differs from the two-pass sum"
        assert r["locks_rearmed"], "a counter was left non-zero: the next call would sum too early"


# ---- interpreter tests ---------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, INTERPRETED_CASES, _check,
                                                  lambda c, r: f"{c['name']}: rel err {r['rel_err']:.2e}")


def test_settings_defaults_and_checks():
    """The defaults are the engine's launch (split from N, preloaded); each field is checked on construction."""
    s = fl.LinearSettings()
    assert (s.block_n, s.num_warps, s.num_stages, s.preload, s.split_k) == (32, 4, 4, True, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_n = 64


@pytest.mark.parametrize("over, message", [
    (dict(block_n=24), "block_n"), (dict(block_n=8), "block_n"), (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages"), (dict(preload=1), "preload"), (dict(split_k=0), "split_k"),
    (dict(split_k=True), "split_k"), (dict(split_k=2.0), "split_k"),
])
def test_settings_rejects(over, message):
    with pytest.raises(ValueError, match=f"LinearSettings: {message}"):
        fl.LinearSettings(**over)


def test_split_k_heuristic():
    cpu = torch.device("cpu")  # 8 "SMs" off the GPU: 16 programs wanted
    assert fl.choose_split_k(n=1024, k=4096, block_n=64, block_k=128, device=cpu) == 1
    assert fl.choose_split_k(n=128, k=4096, block_n=64, block_k=128, device=cpu) == 8
    assert fl.choose_split_k(n=128, k=256, block_n=64, block_k=128, device=cpu) == 2  # at most one tile each


def _args(**over):
    w, s = quantize(torch.randn(40, 96), (16, 16))
    a = dict(x=torch.randn(3, 96), w=w, scale=s, block=(16, 16))
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.randn(3, 95)), "K="),
    (dict(x=torch.randn(3, 96).to(torch.int32)), "x dtype"),
    (dict(w=torch.randn(40, 96)), "float8_e4m3fn"),
    (dict(scale=torch.ones(3, 5)), "scale must be"),
    (dict(scale=torch.ones(3, 6, dtype=torch.float64)), "scale must be"),
    (dict(x=torch.randn(96, 3).T), "unit stride"),
    (dict(block=(16, 8), scale=torch.ones(3, 12)), "power-of-two divisor"),
    (dict(out_dtype=torch.int8), "out_dtype"),
    (dict(out=torch.empty(3, 41)), "out must be"),
    (dict(out=torch.empty(3, 40, dtype=torch.bfloat16)), "out must be"),
    (dict(locks=torch.zeros(1, dtype=torch.int32), settings=fl.LinearSettings(split_k=2)), "locks must be"),
    (dict(settings=dict(block_n=32)), "settings must be a LinearSettings"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=message):
        fl.fp8_linear(**_args(**over))


# ---- GPU tests (real shapes) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    _check(c, r)
    print(f"{c['name']}: rel err {r['rel_err']:.2e}")


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in INTERPRETED_CASES])

"""kernels/f16_operands.py: bf16 rows scaled by powers of two into exact fp16 tensor-core operands, and the MoE
with `f16=True` against its bf16-operand form.

CPU (the interpreter worker, and plain torch):
- the kernel's conversion is bit-identical to `f16_rows_tiles_ref` on rows of every magnitude class: ordinary
  rows, zero rows, tiny rows (below the 2^-112 cap), huge rows near bf16's largest, inf/NaN, subnormal bf16;
- property (hypothesis): a bf16 row tile whose elements are zero or within 2^31 of its largest converts exactly,
  and the scaled fp32 product (x16 @ W^T) * 2^-s equals x @ W^T bit for bit: the identity the kernels rely on;
- the boundary: an element 2^-40 below its row's largest does not survive (the documented exception), and the
  check sees it.
GPU (a TP8 rank's shapes): `moe(f16=True)` bit-identical to f16=False on fresh random inputs (1, 6 and 8 rows; the
fp32 input rounded to bf16 in the kernel, and bf16 input); on the boundary rows, where the small elements are all
Gate/Up has, the two differ (the comparison is not blind). The interpreter runs every case (~2 s): the operand
roundings are exact bits, which is what it checks.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from iquest.kernels import f16_operands as fo
from iquest.kernels.testing import interpreted_tests


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits, NaN payloads aside (NaN where the other has NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(0.0, float("inf"), float("-inf")), b.nan_to_num(0.0, float("inf"), float("-inf"))
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.view(view), b.view(view)))


def rows(kind: str, gen: torch.Generator, M: int = 5, K: int = 256) -> torch.Tensor:
    x = torch.randn(M, K, generator=gen)
    if kind == "zero":
        x[1] = 0
    elif kind == "tiny":
        x = x * 2.0 ** -118
    elif kind == "huge":
        x = x * 2.0 ** 125
    elif kind == "special":
        x[0, 3], x[1, 7], x[2, 9] = float("inf"), float("nan"), float("-inf")
    elif kind == "subnormal_bf16":
        x[3] = x[3] * 2.0 ** -130
    return x.to(torch.bfloat16)


CASES = [{"name": k, "kind": k, "dtype": d} for k in ("ordinary", "zero", "tiny", "huge", "special", "subnormal_bf16")
         for d in ("bf16", "fp32")]
# The post-attention norm writing the MoE's operand tiles (f16_out), and the MoE reading them (f16_input).
NORM_CASES = [{"name": f"norm_{k}_t{t}", "op": "norm", "kind": k, "tile": t}
              for k in ("ordinary", "zero", "huge", "special") for t in (32, 128)]
MOE_CASES = [{"name": f"moe_prescaled_R{R}", "op": "moe", "rows": R} for R in (1, 3)]
MOE_CASES.append({"name": "moe_prescaled_wrong_scale", "op": "moe", "rows": 3, "defect": True})


def run_norm_case(c: dict, device: str) -> dict:
    """y, h with and without f16_out, and the tiles against f16_rows_tiles_ref of y rounded to bf16."""
    from iquest.kernels import rmsnorm_residual as rn

    gen = torch.Generator().manual_seed(len(c["name"]))
    x = rows(c["kind"], gen).to(device)
    residual = (torch.randn(x.shape, generator=gen) / 8).to(torch.bfloat16).to(device)
    weight = (torch.rand(x.shape[1], generator=gen) + 0.5).to(device)
    R, H = x.shape
    tiles = (torch.full((R, H), float("nan"), dtype=torch.float16, device=device),
             torch.full((R, H // c["tile"]), float("nan"), device=device))
    y, h = rn.rmsnorm_residual(x, residual, weight, 1e-6, out_dtype=torch.float32, f16_out=tiles)
    y0, h0 = rn.rmsnorm_residual(x, residual, weight, 1e-6, out_dtype=torch.float32)
    ry, rd = fo.f16_rows_tiles_ref(y.cpu().to(torch.bfloat16), c["tile"])
    return {"y_same": _equal_bits(y, y0) and _equal_bits(h, h0), "tiles_bits": _equal_bits(tiles[0].cpu(), ry),
            "down_bits": _equal_bits(tiles[1].cpu(), rd), "nan_free_tiles": int((~rd.isnan()).all(-1).sum())}


def moe_case_inputs(R: int, gen: torch.Generator, E: int = 6, I: int = 64, H: int = 128, k: int = 2,
                    block: int = 32) -> dict:
    """Small MoE inputs for the interpreter (block-scaled E4M3 weights, a norm's bf16-valued fp32 output)."""
    fp8 = lambda *shape: torch.randn(*shape, generator=gen).to(torch.float8_e4m3fn)
    sc = lambda *shape: (torch.rand(*shape, generator=gen) + 0.5) / 16
    nb = lambda n: n // block
    return dict(gate=fp8(E, I, H), gate_scale=sc(E, nb(I), nb(H)), up=fp8(E, I, H), up_scale=sc(E, nb(I), nb(H)),
                down=fp8(E, H, I), down_scale=sc(E, nb(H), nb(I)),
                experts=torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(R)]),
                weights=torch.softmax(torch.randn(R, k, generator=gen), -1), live=torch.ones(R, dtype=torch.bool),
                x=torch.randn(R, H, generator=gen).to(torch.bfloat16), residual=torch.randn(R, H, generator=gen) / 4,
                norm=torch.rand(H, generator=gen) + 0.5, block=(block, block))


def prescaled_moe(t: dict, defect: bool = False) -> dict:
    """The MoE on a norm's fp32 output, rounded to bf16 in Gate/Up (as the engine passes it), and on the tiles the
    norm wrote. `defect`: the tiles' 2^-s doubled (the negative control: it must change the output, which shows
    Gate/Up read the tiles). Works on any device; the GPU cases below run it at a TP8 rank's shape."""
    from iquest.kernels import moe as mk
    from iquest.kernels import rmsnorm_residual as rn

    R, H = t["x"].shape
    tile = mk.gate_up_k_tile(t["block"])
    tiles = fo.empty_tiles(R, H, tile, t["x"].device)
    b32, _ = rn.rmsnorm_residual(t["x"], t["residual"].to(torch.bfloat16), t["norm"], 1e-6, out_dtype=torch.float32,
                                 f16_out=tiles)
    if defect:
        tiles = (tiles[0], tiles[1] * 2)
    args = [t[a] for a in ("experts", "weights", "live", "gate", "gate_scale", "up", "up_scale", "down", "down_scale")]
    kw = dict(block=t["block"], group=t["block"][1], out_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    a, da = mk._moe_probed(b32, *args, **kw)  # the probe: Gate/Up's fp32 hidden
    b, db = mk._moe_probed(b32, *args, **kw, f16_input=tiles)
    return {"hidden_bits": _equal_bits(da["hidden"], db["hidden"]), "out_bits": _equal_bits(a, b),
            "max_diff": float((a.float() - b.float()).abs().max())}


def run_moe_case(c: dict) -> dict:
    return prescaled_moe(moe_case_inputs(c["rows"], torch.Generator().manual_seed(c["rows"])), c.get("defect", False))


def run_case(c: dict, device: str) -> dict:
    if c.get("op") == "norm":
        return run_norm_case(c, device)
    if c.get("op") == "moe":
        return run_moe_case(c)
    x = rows(c["kind"], torch.Generator().manual_seed(len(c["name"])))
    x = (x if c["dtype"] == "bf16" else x.float()).to(device)
    y, d = fo.f16_rows_tiles(x)
    ry, rd = fo.f16_rows_tiles_ref(x.cpu())
    return {"y_bits": _equal_bits(y.cpu(), ry), "down_bits": _equal_bits(d.cpu(), rd),
            "exact_tiles": int(fo.exact_in_f16(x.cpu()).sum()), "tiles": d.numel()}


def _check(c: dict, r: dict) -> None:
    if c.get("op") == "norm":
        assert r["y_same"], "f16_out changed the norm's own outputs"
        assert r["tiles_bits"] and r["down_bits"], f"{c['name']}: the norm's tiles differ from f16_rows_tiles_ref"
        if c["kind"] != "special":  # a row with inf/NaN has NaN everywhere after the norm
            assert r["nan_free_tiles"] == 5
        return
    if c.get("op") == "moe":
        if c.get("defect"):  # wrong tile scales must show: the prescaled operand is what Gate/Up used
            assert not r["hidden_bits"] and r["max_diff"] > 0, r
        else:
            assert r["hidden_bits"] and r["out_bits"], r
        return
    assert r["y_bits"] and r["down_bits"], f"{c['name']}: kernel conversion differs from f16_rows_tiles_ref"
    if c["kind"] in ("ordinary", "zero", "huge"):
        assert r["exact_tiles"] == r["tiles"]


interpreted, test_interpreted = interpreted_tests(__file__, CASES + NORM_CASES + MOE_CASES, _check)


def bf16_row(draw_exps, signs, mants) -> torch.Tensor:
    vals = [s * (1 + m / 128) * 2.0 ** e for e, s, m in zip(draw_exps, signs, mants)]
    return torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(top=st.integers(-110, 120), data=st.data())
def test_rows_within_2_31_are_exact_and_scale_out_of_the_product(top, data):
    """Elements 0 or within 2^31 of the row's largest: exact in fp16, and (x16 @ W^T) * 2^-s == x @ W^T bitwise
    (fp32 products of exact values, scaled by a power of two: the kernels' argument, on torch's matmul)."""
    K = 128
    exps = data.draw(st.lists(st.integers(top - 30, top), min_size=K, max_size=K))
    signs = data.draw(st.lists(st.sampled_from([-1, 1]), min_size=K, max_size=K))
    mants = data.draw(st.lists(st.integers(0, 127), min_size=K, max_size=K))
    zeros = data.draw(st.lists(st.integers(0, K - 1), max_size=8))
    x = bf16_row(exps, signs, mants)[None]
    x[0, zeros] = 0
    assert bool(fo.exact_in_f16(x).all())
    y, d = fo.f16_rows_tiles_ref(x)
    w = torch.randn(16, K, generator=torch.Generator().manual_seed(top + 200)).to(torch.float8_e4m3fn).float()
    want = x.float() @ w.T
    got = (y.float() @ w.T) * d[:, :1]
    assert torch.equal(got, want) or not bool(torch.isfinite(want).all())


def test_the_boundary_element_is_lost():
    """An element 2^-40 below its row tile's largest is not an fp16 value after the scaling: the one documented
    exception, and exact_in_f16 reports it."""
    x = torch.ones(2, 128, dtype=torch.bfloat16)
    x[1, 5] = 2.0 ** -40
    assert fo.exact_in_f16(x).tolist() == [[True], [False]]
    y, d = fo.f16_rows_tiles_ref(x)
    assert float(y[1, 5]) * float(d[1, 0]) != 2.0 ** -40


def test_operand_tiles_are_checked_where_they_are_written_and_read():
    """The norm's f16_out and the MoE's f16_input go through one check (f16_operands.tile_width): wrong dtypes, a tile
    count that does not divide H, and (the MoE) tiles of another width than its K tile are refused before a launch."""
    from iquest.kernels import moe as mk
    from iquest.kernels import rmsnorm_residual as rn

    x, w = torch.ones(3, 128, dtype=torch.bfloat16), torch.ones(128)
    assert fo.tile_width(fo.empty_tiles(3, 128, 32, "cpu"), 3, 128, torch.device("cpu"), "t") == 32
    for bad, message in ((fo.empty_tiles(3, 128, 32, "cpu")[::-1], r"\[0\] must be fp16"),
                         ((torch.empty(3, 128, dtype=torch.float16), torch.empty(3, 3)), r"\[1\] must be fp32"),
                         ((torch.empty(3, 128, dtype=torch.float16),), " must be a pair")):
        with pytest.raises(ValueError, match="rmsnorm_residual: f16_out" + message):
            rn.rmsnorm_residual(x, x, w, 1e-6, torch.float32, f16_out=bad)
    t = moe_case_inputs(3, torch.Generator().manual_seed(0))
    args = [t[a] for a in ("experts", "weights", "live", "gate", "gate_scale", "up", "up_scale", "down", "down_scale")]
    with pytest.raises(ValueError, match="f16_input's tiles are 64 wide; Gate/Up's K tile here is 32"):
        mk.moe(t["x"].float(), *args, block=t["block"], group=32, compute_dtype=torch.bfloat16,
               f16_input=fo.empty_tiles(3, 128, 64, "cpu"))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="contiguous float"):
        fo.f16_rows_tiles(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="dividing N"):
        fo.f16_rows_tiles(torch.ones(4, 100))


# ---- GPU: the MoE with f16 operands against its bf16 form ------------------------------------------------------
def moe_inputs(R: int, gen: torch.Generator, E: int = 256, I: int = 256, H: int = 6144, k: int = 8) -> dict:
    fp8 = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    sc = lambda *shape: (torch.rand(*shape, device="cuda", generator=gen) + 0.5) / 64
    return dict(gate=fp8(E, I, H), gate_scale=sc(E, I // 128, H // 128), up=fp8(E, I, H),
                up_scale=sc(E, I // 128, H // 128), down=fp8(E, H, I), down_scale=sc(E, H // 128, I // 128),
                experts=torch.stack([torch.randperm(24, device="cuda", generator=gen)[:k] for _ in range(R)]),
                weights=torch.softmax(torch.randn(R, k, device="cuda", generator=gen), -1),
                live=torch.ones(R, dtype=torch.bool, device="cuda"))


def run_moe(x: torch.Tensor, t: dict, f16: bool, **kw) -> tuple[torch.Tensor, dict]:
    from iquest.kernels import moe as mk

    return mk._moe_probed(x, t["experts"], t["weights"], t["live"], t["gate"], t["gate_scale"], t["up"], t["up_scale"],
                          t["down"], t["down_scale"], out_dtype=torch.bfloat16, f16=f16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("R, x_dtype", [(1, "fp32"), (6, "fp32"), (8, "bf16")])
def test_gpu_moe_f16_is_bit_identical(R, x_dtype):
    """Fresh random inputs at one TP8 rank's shape: Gate/Up's fp32 hidden and the output are the bf16 form's bits."""
    gen = torch.Generator(device="cuda").manual_seed(R)
    t = moe_inputs(R, gen)
    x = torch.randn(R, 6144, device="cuda", generator=gen)
    kw = dict(compute_dtype=torch.bfloat16) if x_dtype == "fp32" else {}
    x = x if x_dtype == "fp32" else x.to(torch.bfloat16)
    a, da = run_moe(x, t, False, **kw)
    b, db = run_moe(x, t, True, **kw)
    assert _equal_bits(da["hidden"], db["hidden"]), "Gate/Up differ"
    assert _equal_bits(a, b), f"max diff {(a.float() - b.float()).abs().max().item():.3e}"


@pytest.mark.gpu
def test_gpu_moe_f16_boundary_row_differs():
    """The comparison above is not blind: rows whose only Gate/Up terms are elements 2^-40 below the row tile's
    largest (against whose weight column is zero) lose them through fp16 operands, and the hidden differs."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    t = moe_inputs(2, gen)
    for name in ("gate", "up"):
        w = torch.ones_like(t[name], dtype=torch.float32)
        w[..., ::128] = 0  # each K tile's first column
        t[name] = w.to(torch.float8_e4m3fn)
    x = torch.full((2, 6144), 2.0 ** -40, device="cuda")
    x[:, ::128] = 1.0
    x = x.to(torch.bfloat16)
    _, da = run_moe(x, t, False)
    _, db = run_moe(x, t, True)
    live = da["hidden"][:16]  # both rows' pairs
    assert float(live.abs().min()) > 0 and not _equal_bits(da["hidden"], db["hidden"])


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 6, 8])
def test_gpu_moe_prescaled_is_bit_identical(R):
    """At one TP8 rank's shape: Gate/Up reading the norm's fp16 tiles gives the bits of Gate/Up rescaling the norm's
    fp32 output itself (hidden and output), and doubled tile scales (the negative control) do not."""
    gen = torch.Generator(device="cuda").manual_seed(R + 10)
    t = moe_inputs(R, gen)
    t.update(x=torch.randn(R, 6144, device="cuda", generator=gen).to(torch.bfloat16),
             residual=torch.randn(R, 6144, device="cuda", generator=gen) / 4,
             norm=torch.rand(6144, device="cuda", generator=gen) + 0.5, block=(128, 128))
    good = prescaled_moe(t)
    assert good["hidden_bits"] and good["out_bits"], good
    bad = prescaled_moe(t, defect=True)
    assert not bad["hidden_bits"] and bad["max_diff"] > 0, bad


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES + NORM_CASES + MOE_CASES])

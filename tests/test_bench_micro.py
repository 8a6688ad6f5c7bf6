"""`iquest bench kernels` and `iquest bench allreduce`: shape and byte tables, CLI errors without CUDA, and
the correctness-check helpers on CPU (the kernels' *_ref functions, the ops' torch forms and an emulated _scaled_mm
stand in for the GPU code). Timings only run under `@pytest.mark.gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from iquest.bench import allreduce as ar
from iquest.bench import kernels_micro as km
from iquest.cli.main import main
from iquest.kernels.decode_attention import decode_attention_ref, visible_ref
from iquest.kernels.fp8_linear import fp8_linear_ref
from iquest.reference.config import Config

FULL = Config.from_file(km.FULL_CONFIG)


# ---- shapes and bytes, against hand-computed numbers -------------------------------------------------------
def test_linear_shapes_of_one_tp8_rank():
    got = [(s.name, s.n, s.k) for s in km.linear_shapes(FULL, 8)]
    assert got == [("q_proj", 768, 6144), ("k_proj/v_proj", 128, 6144), ("o_proj", 6144, 768),
                   ("expert gate/up", 256, 6144), ("expert down", 6144, 256), ("eh_proj", 6144, 1536)]


def test_linear_bytes():
    # q_proj, 1 row: E4M3 weight 768*6144 + fp32 scales 6*48*4 + bf16 x 6144*2 + bf16 y 768*2
    assert km.linear_bytes("triton", 1, 768, 6144) == 4_718_592 + 1_152 + 12_288 + 1_536
    # _scaled_mm pads to 4 rows: E4M3 x 4*6144, scale_a 4*48*4, y 4*768*2
    assert km.linear_bytes("_scaled_mm", 1, 768, 6144) == 4_718_592 + 1_152 + 24_576 + 768 + 6_144
    # o_proj: scale_b's K/128 = 6 padded to 8 (48 x 8 x 4 bytes)
    assert km.linear_bytes("_scaled_mm", 8, 6144, 768) == 4_718_592 + 1_536 + 6_144 + 192 + 98_304
    # expert down, 8 rows: bf16 weight 6144*256*2, x 8*256*2, y 8*6144*2
    assert km.linear_bytes("bf16 mm", 8, 6144, 256) == 3_145_728 + 4_096 + 98_304
    assert km.linear_bytes("triton", 8, 6144, 256) == 1_572_864 + 384 + 4_096 + 98_304
    assert [km.scaled_mm_rows(m) for m in (1, 3, 4, 5, 8)] == [4, 4, 4, 8, 8]


def test_attention_cases_and_kv_floor():
    assert [(c.context, c.kind) for c in km.attention_cases(FULL)] == [(4096, "sliding"), (32768, "full"),
                                                                        (196608, "full")]
    assert km.kv_bytes(4096, 1, 128) == 2 * 4096 * 128 * 2 == 2_097_152
    assert km.kv_bytes(196608, 1, 128) == 100_663_296
    # GPU_FACTS.md's floors at 4.26 TB/s: 0.5, 3.9 and 23.6 us
    assert [round(km.kv_bytes(c, 1, 128) / 4.26e12 * 1e6, 1) for c in (4096, 32768, 196608)] == [0.5, 3.9, 23.6]


def test_round_allreduces_and_exact_fill():
    assert ar.round_allreduces(FULL) == 2 * 88 + 1 + 5 * 4 == 197
    for world in range(2, 9):
        acc = ar.fill(0, 2, 64)
        for rank in range(1, world):  # bf16 accumulation in rank order, as a ring might add
            acc = acc + ar.fill(rank, 2, 64)
        assert acc.dtype == torch.bfloat16 and torch.equal(acc, ar.expected_sum(world, 2, 64))


def test_attention_inputs_follow_the_cache():
    ring = km.make_attention(km.AttentionCase(20, "sliding"), 4, 6, 1, 16, 100, "cpu", slack=16)
    held = ring.slot_pos[:-1]
    assert ring.k.shape[0] == 37 and ring.slot_pos[-1] == -1 and ring.kv_len is None
    assert torch.equal(held % 36, torch.arange(36))  # slot = position mod slots
    assert visible_ref(ring.slot_pos, ring.q_pos, ring.window, 0).sum(1).tolist() == [20] * 4
    full = km.make_attention(km.AttentionCase(50, "full"), 4, 6, 1, 16, 100, "cpu")
    assert full.k.shape[0] == 101 and int(full.kv_len) == 50 and full.live == 50
    assert visible_ref(full.slot_pos, full.q_pos, None, 0).sum(1).tolist() == [47, 48, 49, 50]


# ---- CLI without CUDA --------------------------------------------------------------------------------------
def _fails(capsys, argv: list[str], *needles: str) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0] and "error" in lines[0], lines
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_cli_errors_without_cuda(capsys, no_cuda):
    _fails(capsys, ["bench", "kernels"], "needs 1 CUDA device, found 0")
    _fails(capsys, ["bench", "allreduce", "--ranks", "2"], "needs 2 CUDA devices, found 0")
    _fails(capsys, ["bench", "allreduce", "--ranks", "1"], "--ranks must be >= 2")
    _fails(capsys, ["bench", "kernels", "--rows", "1,x"], "--rows")
    _fails(capsys, ["bench", "graph-trace"], "iquest bench graph-trace needs 1 CUDA device, found 0")
    _fails(capsys, ["bench", "stream-probe", "--out", "x.json"], "iquest bench stream-probe needs 1 CUDA device")


# ---- the correctness checks, on CPU ------------------------------------------------------------------------
def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """The block-wise scaled GEMM's contract (1x128 activations, 128x128 weight) with the layouts cuBLAS reads."""
    (m, k), n = a.shape, b.shape[1]
    kb, nb = -(-k // 128), -(-n // 128)
    l4 = -(-kb // 4) * 4
    assert m % 4 == 0 and b.t().is_contiguous(), "a row-major with M a multiple of 4, b column-major"
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), "scale_a column-major"
    assert scale_b.shape == (l4, nb) and scale_b.stride() == (1, l4), "scale_b = scale^T, K/128 padded to 4"
    sa = scale_a.repeat_interleave(128, 1)[:, :k]
    sb = scale_b[:kb].repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


@pytest.mark.parametrize("m, n, k", [(1, 200, 384), (3, 128, 512), (8, 300, 256)])
def test_linear_agreement_on_cpu(m, n, k):
    t = km.make_linear(m, n, k, "cpu")  # partial 128-row blocks of W; K/128 = 3, 4, 2 (scale_b padding)
    variants = km.linear_variants(ours=fp8_linear_ref, scaled_mm=emulated_scaled_mm)
    got = km.agreement("linear", t, variants)
    assert set(got) == {"triton", "_scaled_mm", "bf16 mm"}
    for name, r in got.items():
        assert "error" not in r and r["rel_diff_vs_ref"] <= km.TOL["linear"], (name, r)
    # the inputs are exact in both forms: the reference and the emulation do the same sums
    assert got["triton"]["rel_diff_vs_torch"] == 0.0


def test_linear_agreement_records_an_error_instead_of_raising():
    def refuses(*args, **kw):
        raise RuntimeError("block-wise scaling unsupported\nsecond line")

    got = km.agreement("linear", km.make_linear(2, 128, 256, "cpu"), km.linear_variants(fp8_linear_ref, refuses))
    assert got["_scaled_mm"] == {"error": "RuntimeError: block-wise scaling unsupported\nsecond line"}
    assert "rel_diff_vs_torch" not in got["triton"] and got["triton"]["rel_diff_vs_ref"] <= km.TOL["linear"]


@pytest.mark.parametrize("kind, context", [("sliding", 20), ("full", 50)])
@pytest.mark.parametrize("rows", [1, 4])
def test_attention_agreement_on_cpu(kind, context, rows):
    t = km.make_attention(km.AttentionCase(context, kind), rows, 6, 1, 32, 100, "cpu", slack=16)
    got = km.agreement("attention", t, km.attention_variants(ours=decode_attention_ref))  # real SDPA, on CPU
    assert got["triton"]["rel_diff_vs_ref"] == 0.0
    assert got["triton"]["rel_diff_vs_torch"] <= km.TOL["attention"]
    assert got["sdpa (mask)"]["rel_diff_vs_ref"] <= km.TOL["attention"]
    assert got["sdpa (no mask)"] == {"rel_diff_vs_ref": None}


# ---- the other ops' benches, on CPU with their torch forms standing in for the kernels ----------------------
TINY = Config.from_file(Path(__file__).resolve().parent.parent / "fixtures" / "tiny" / "config.json")


def _torch_forms() -> dict:
    """Stand-ins for the kernels with the kernels' call signatures: each op's torch form."""
    from iquest.fast import philox, sampler
    from iquest.fast.torch_ops import TorchOps
    from iquest.reference.layers import route

    def sample(keys, k, temperature, top_p, seed, offsets):
        ids, probs = sampler._dist_from_keys(keys, k, temperature, top_p)
        return sampler.draw(ids, probs, philox.uniforms(seed, offsets)), ids, probs

    return {"router": lambda x, w, k, norm, scaling: route(x @ w.float().T, k, norm, scaling),
            "lm_head": lambda x, w: x.float() @ w.float().T, "topk": sampler._local_keys, "sample": sample,
            "accept": lambda *a: TorchOps().accept(*a)}


def _benches(rows: int, forms: dict) -> list:
    out = [km.router_bench(TINY, rows, "cpu", ours=forms["router"], rotate=1 << 14),  # a few weight copies
           km.lm_head_bench(TINY, rows, "cpu", ours=forms["lm_head"], rotate=1 << 14),
           km.topk_bench(TINY, rows, "cpu", ours=forms["topk"]),
           km.sample_bench(TINY, rows, "cpu", ours=forms["sample"])]
    return out + ([km.accept_bench(TINY, rows - 1, "cpu", ours=forms["accept"])] if rows > 1 else [])


@pytest.mark.parametrize("rows", [1, 6])
def test_op_benches_check_ours_against_the_torch_forms(rows):
    """Every op bench builds its inputs and both variants, and its agreement check passes when ours is the torch
    form itself; each variant's floor counts at least the bytes of its weights."""
    for b in _benches(rows, _torch_forms()):
        ours = next(r for r in km.op_agreement(b) if r["variant"] == "triton")
        assert set(b.variants) == {"triton", "torch"} and "error" not in ours, (b.op, ours)
        assert ours["mismatch"] is None and ours["agreement"] is not None, (b.op, ours)
        assert b.bytes["torch"] >= b.bytes["triton"] > 0


def test_op_benches_catch_a_wrong_kernel():
    """The same checks on stand-ins with one defect each report a mismatch."""
    forms = _torch_forms()
    wrong = {"router": lambda *a: tuple(t.flip(-1) for t in forms["router"](*a)),
             "lm_head": lambda x, w: forms["lm_head"](x, w) * (1 + 1e-3),
             "topk": lambda logits, k, offset: forms["topk"](logits, k, offset + 1),
             "sample": lambda *a: (lambda t, i, p: (t, i.flip(-1), p))(*forms["sample"](*a)),
             "accept": lambda *a: (lambda a_, x, e, lp: (a_, x + 1, e, lp))(*forms["accept"](*a))}
    for b in _benches(6, wrong):
        ours = next(r for r in km.op_agreement(b) if r["variant"] == "triton")
        assert ours["mismatch"] is not None, (b.op, ours)


# ---- GPU: the benchmarks themselves, briefly --------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_kernels_bench(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--rows", "1,8", "--repeats", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "agreement linear" in text and "agreement attention" in text and "MISMATCH" not in text
    r = json.loads(out.read_text())
    for op in ("linear", "attention"):
        ours = [x for x in r[op] if x["variant"] == "triton"]
        assert ours and all("error" not in x and x["rel_diff_vs_ref"] <= km.TOL[op] for x in ours), ours
        assert all(x["rel_diff_vs_torch"] <= km.TOL[op] for x in ours if "rel_diff_vs_torch" in x)
        assert all(len(x["times_us"]) == 3 for x in ours)
    ours = [x for x in r["ops"] if x["variant"] == "triton"]
    assert {(x["op"], x["rows"]) for x in ours} == {(op, m) for op in ("moe", "router", "lm_head", "topk", "sample")
                                                    for m in (1, 8)} | {("accept", 8)}
    assert all("error" not in x and x["mismatch"] is None and len(x["times_us"]) == 3 for x in ours), ours


@pytest.mark.gpu
def test_gpu_allreduce_bench(tmp_path, capfd):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "allreduce.json"
    assert main(["bench", "allreduce", "--ranks", "2", "--repeats", "3", "--out", str(out)]) == 0
    r = json.loads(Path(out).read_text())
    nccl = [x for x in r["results"] if x["variant"] == "nccl"]
    assert nccl and all(x["verified_all_ranks"] and len(x["times_us"]) == 3 for x in nccl)
    assert all(x["verified_all_ranks"] for x in r["results"] if "error" not in x)
    assert "per-round collective estimate" in capfd.readouterr().out  # printed by rank 0, a child process

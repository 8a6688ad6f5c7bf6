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
from iquest.bench.full_step import load_config
from iquest.kernels.fp8_linear import fp8_linear_ref
from iquest.reference.config import Config

FULL = load_config(km.FULL_CONFIG)  # configs/iquest-q1.json with configs/iquest-q1-mtp.json beside it


# ---- shapes and bytes, against hand-computed numbers -------------------------------------------------------
def test_linear_shapes_of_one_tp8_rank():
    """docs/model.md's TP8 rank 0: 6 query heads and one KV head (k and v) of 128 as one q/k/v weight over H 3072;
    o_proj over the 768 columns of its heads; the dense MLP's 12288 / 8 rows; eh_proj over 2H / 8 columns."""
    got = [(s.name, s.n, s.k) for s in km.linear_shapes(FULL, 8)]
    assert got == [("q/k/v", 1024, 3072), ("o_proj", 3072, 768), ("dense gate/up", 1536, 3072),
                   ("dense down", 3072, 1536), ("eh_proj", 3072, 768)]


def test_linear_bytes():
    # q/k/v, 1 row: E4M3 weight 1024*3072 + fp32 scales 8*24*4 + bf16 x 3072*2 + bf16 y 1024*2
    assert km.linear_bytes("triton", 1, 1024, 3072) == 3_145_728 + 768 + 6_144 + 2_048
    # _scaled_mm pads to 4 rows: E4M3 x 4*3072, scale_a 4*24*4, y 4*1024*2
    assert km.linear_bytes("_scaled_mm", 1, 1024, 3072) == 3_145_728 + 768 + 12_288 + 384 + 8_192
    # o_proj: scale_b's K/128 = 6 padded to 8 (24 x 8 x 4 bytes)
    assert km.linear_bytes("_scaled_mm", 8, 3072, 768) == 2_359_296 + 768 + 6_144 + 192 + 49_152
    # dense down, 8 rows: bf16 weight 3072*1536*2, x 8*1536*2, y 8*3072*2
    assert km.linear_bytes("bf16 mm", 8, 3072, 1536) == 9_437_184 + 24_576 + 49_152
    assert km.linear_bytes("triton", 8, 3072, 1536) == 4_718_592 + 24 * 12 * 4 + 24_576 + 49_152
    assert [km.scaled_mm_rows(m) for m in (1, 3, 4, 5, 8)] == [4, 4, 4, 8, 8]


def test_round_allreduces_and_exact_fill():
    # two a layer (o_proj, the MLP's Down), the embedding; each draft pass: its embedding, eh_proj, the block's two
    assert ar.round_allreduces(FULL) == 2 * 88 + 1 + 5 * 4 == 197
    for world in range(2, 9):
        acc = ar.fill(0, 2, 64)
        for rank in range(1, world):  # bf16 accumulation in rank order, as a ring might add
            acc = acc + ar.fill(rank, 2, 64)
        assert acc.dtype == torch.bfloat16 and torch.equal(acc, ar.expected_sum(world, 2, 64))


# ---- CLI without CUDA --------------------------------------------------------------------------------------
def test_cli_errors_without_cuda(one_line_error, no_cuda):
    one_line_error(["bench", "kernels"], "needs 1 CUDA device, found 0")
    one_line_error(["bench", "allreduce", "--ranks", "2"], "needs 2 CUDA devices, found 0")
    one_line_error(["bench", "allreduce", "--ranks", "1"], "--ranks must be >= 2")
    one_line_error(["bench", "kernels", "--rows", "1,x"], "--rows")
    one_line_error(["bench", "graph-trace"], "iquest bench graph-trace needs 1 CUDA device, found 0")



def test_retired_benchmarks_answer_in_one_line(capsys, one_line_error):
    """`bench stream-probe` measured the retired architecture's kernels: with its old arguments too, one line that
    says so, no traceback; its --help still works. (`bench tune` is re-based: tests/test_bench_tune.py.)"""
    one_line_error(["bench", "stream-probe", "--out", "x.json"], "bench stream-probe", "re-based in the GPU issue")
    assert main(["bench", "stream-probe", "--help"]) == 0 and "Retired" in capsys.readouterr().out


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


# ---- the sampling ops' benches, on CPU with their torch forms standing in for the kernels --------------------
TINY = Config.from_dir(Path(__file__).resolve().parent.parent / "fixtures" / "tiny")


def _torch_forms() -> dict:
    """Stand-ins for the kernels with the kernels' call signatures: each op's torch form."""
    from iquest.fast import philox, sampler
    from iquest.fast.torch_ops import TorchOps

    def sample(keys, k, temperature, top_p, seed, offsets):
        ids, probs = sampler._dist_from_keys(keys, k, temperature, top_p)
        return sampler.draw(ids, probs, philox.uniforms(seed, offsets)), ids, probs

    return {"topk": sampler._local_keys, "sample": sample, "accept": lambda *a: TorchOps().accept(*a)}


def _benches(rows: int, forms: dict) -> list:
    out = [km.topk_bench(TINY, rows, "cpu", ours=forms["topk"]), km.sample_bench(TINY, rows, "cpu", ours=forms["sample"])]
    return out + ([km.accept_bench(TINY, rows - 1, "cpu", ours=forms["accept"])] if rows > 1 else [])


@pytest.mark.parametrize("rows", [1, 6])
def test_op_benches_check_ours_against_the_torch_forms(rows):
    """Every op bench builds its inputs and both variants, and its agreement check passes when ours is the torch
    form itself; each variant's floor counts its inputs' bytes."""
    for b in _benches(rows, _torch_forms()):
        ours = next(r for r in km.op_agreement(b) if r["variant"] == "triton")
        assert set(b.variants) == {"triton", "torch"} and "error" not in ours, (b.op, ours)
        assert ours["mismatch"] is None and ours["agreement"] is not None, (b.op, ours)
        assert b.bytes["torch"] >= b.bytes["triton"] > 0


def test_op_benches_catch_a_wrong_kernel():
    """The same checks on stand-ins with one defect each report a mismatch."""
    forms = _torch_forms()
    wrong = {"topk": lambda logits, k, offset: forms["topk"](logits, k, offset + 1),
             "sample": lambda *a: (lambda t, i, p: (t, i.flip(-1), p))(*forms["sample"](*a)),
             "accept": lambda *a: (lambda a_, x, e: (a_, x + 1, e))(*forms["accept"](*a))}
    for b in _benches(6, wrong):
        ours = next(r for r in km.op_agreement(b) if r["variant"] == "triton")
        assert ours["mismatch"] is not None, (b.op, ours)


# ---- GPU: the benchmarks themselves, briefly --------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_kernels_bench(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--rows", "1,8", "--repeats", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "agreement linear" in text and "MISMATCH" not in text
    r = json.loads(out.read_text())
    ours = [x for x in r["linear"] if x["variant"] == "triton"]
    assert ours and all("error" not in x and x["rel_diff_vs_ref"] <= km.TOL["linear"] for x in ours), ours
    assert all(x["rel_diff_vs_torch"] <= km.TOL["linear"] for x in ours if "rel_diff_vs_torch" in x)
    assert all(len(x["times_us"]) == 3 for x in ours)
    ours = [x for x in r["ops"] if x["variant"] == "triton"]
    assert {(x["op"], x["rows"]) for x in ours} == {(op, m) for op in ("topk", "sample") for m in (1, 8)} | {("accept", 8)}
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

"""bench/sass.py: the decode kernels compiled for sm_90a on the CPU. The fp16-operand Down has no bf16 conversion
instruction (F2F) left and the bf16 form has them (the change of docs/PERF.md, seen in the SASS); the FP8 linear's
preloaded weight tiles are all requested before the PDL wait, with nothing that waits for them before it; the report
reads real registers and instruction counts; the CLI rejects unknown kernels and malformed overrides."""

from __future__ import annotations

import dataclasses
import json

import pytest

from iquest.bench import sass
from iquest.kernels.testing import substitute
from iquest.tests.kernel_controls import LINEAR_TRANSPARENT


@pytest.fixture(scope="module")
def down_reports():
    spec = sass.specs()["moe_down"]
    return {f16: sass.report(sass.compile_spec(spec, F16=f16)) for f16 in (True, False)}


def test_fp16_operands_drop_the_bf16_conversion(down_reports):
    f16, bf16 = down_reports[True], down_reports[False]
    assert bf16["mix"].get("F2F", 0) >= 32 and f16["mix"].get("F2F", 0) == 0
    assert f16["instructions"] < bf16["instructions"]
    for r in (f16, bf16):
        assert r["mix"].get("HMMA", 0) > 0 and 32 <= r["registers"] <= 255 and r["shared_bytes"] > 0


def _before_wait(spec, **constexprs) -> list[str]:
    seq = sass.sequence(sass.compile_spec(spec, **constexprs))
    assert seq.count("ACQBULK") == 1, "one griddepcontrol.wait"
    return seq[:seq.index("ACQBULK")]


def test_engine_forms_compile_with_tensor_descriptors():
    """The TMA forms the engine launches compile here: Gate/Up at the registers ncu measured on the H200 (188 at
    c199d16; at most 2 programs a SM), no stack; fp8_down's Down issues E4M3 wgmma and converts nothing."""
    specs = sass.specs()
    gate_up = sass.report(sass.compile_spec(specs["moe_gate_up_tma"]))
    assert gate_up["stack_bytes"] == 0 and 128 < gate_up["registers"] <= 255 and gate_up["mix"].get("HMMA", 0) > 0
    fp8 = sass.compile_spec(specs["moe_down_fp8"])
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in fp8.asm["ptx"]
    assert sass.report(fp8)["mix"].get("F2FP", 0) == 0
    assert sass.report(sass.compile_spec(specs["moe_down_tma"]))["mix"].get("F2FP", 0) > 0  # fp16 operands convert


def test_early_down_prefetches_its_tile_before_the_wait():
    """Down with early_down: the routing loads and the weight tile's L2 prefetches come before griddepcontrol.wait in the
    PTX; the default form issues neither before it."""
    specs = sass.specs()
    early = sass.compile_spec(specs["moe_down_early"]).asm["ptx"]
    head = early[:early.index("griddepcontrol.wait")]
    assert head.count("prefetch.global.L2") >= 2 and "ld.global" in head
    plain = sass.compile_spec(specs["moe_down_tma"]).asm["ptx"]
    assert "prefetch.global.L2" not in plain and "ld.global" not in plain[:plain.index("griddepcontrol.wait")]


def test_preloaded_tiles_are_all_requested_before_the_wait():
    """q/k/v's 6 tiles (2 x 128-bit loads a thread each) and their scales: every load issued before the wait, and no
    barrier there (a barrier before the wait is a layout conversion waiting for a tile's bytes, which would make the
    tiles' HBM round trips follow one another). Negative control: without the opaque move after the wait, Triton
    converts each tile right after its load, and the barriers appear. The loop form reads nothing before the wait."""
    spec = sass.specs()["fp8_linear"]
    tiles = spec.constexprs["PRELOAD"]
    assert tiles == 6
    early = _before_wait(spec)
    assert early.count("LDG") >= 2 * tiles + 2 * tiles and early.count("BAR") == 0, early
    control = _before_wait(dataclasses.replace(spec, fn=substitute(spec.fn, **LINEAR_TRANSPARENT)))
    assert control.count("BAR") >= tiles - 1 and control.count("LDG") >= 2 * tiles, control
    assert _before_wait(sass.specs()["fp8_linear_loop"]).count("LDG") == 0


def test_pdl_signals_after_the_wait():
    """The preloaded q/k/v projection signals the next launch once, after its wait (so at most two kernels are in
    flight: kernels/launch.py), with its weight tiles requested before that wait."""
    ptx = sass.compile_spec(sass.specs()["fp8_linear"]).asm["ptx"]
    wait, signal = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.wait") == ptx.count("griddepcontrol.launch_dependents") == 1 and wait < signal
    assert "ld.global" in ptx[:wait]  # the preloads are issued first


def test_unknown_constexpr_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        sass.compile_spec(sass.specs()["moe_down"], NOT_A_PARAMETER=1)


def test_cli(tmp_path, capsys):
    from iquest.cli.main import main

    out = tmp_path / "sass.json"
    assert main(["bench", "sass", "--kernels", "moe_down", "--set", "moe_down.F16=False", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overrides"] == {"moe_down": {"F16": False}} and report["kernels"]["moe_down"]["mix"]["F2F"] > 0
    assert "moe_down (MoE Down)" in capsys.readouterr().out
    assert main(["bench", "sass", "--kernels", "nope"]) != 0
    assert main(["bench", "sass", "--set", "moe_down"]) != 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rope_kv_builds_for_the_gpu_with_and_without_partials(dtype):
    """The rotary kernel compiles for sm_90a in both forms (its partial-sum form once failed only on the GPU build:
    Triton types every return of a helper, the pruned branch's too), and the parts form really sums: it issues more
    global loads than the plain one."""
    from iquest.kernels import rope_kv as rk

    loads = {}
    for parts in (0, 1, 8):
        src = "fp32" if parts else dtype
        types = {**{n: f"*{src}" for n in ("q_ptr", "k_ptr", "v_ptr")},
                 **{n: f"*{dtype}" for n in ("cos_ptr", "sin_ptr", "qo_ptr", "ck_ptr", "cv_ptr")},
                 "rr_ptr": "*i64", "pos_ptr": "*i64", "live_ptr": "*u8", "sp_ptr": "*i64"}
        spec = sass.KernelSpec(rk._rope_kv_kernel, types, dict(D=128, HALF=64, PARTS=parts, PDL=True, EARLY=True), (),
                               4, 1, f"rope_kv parts={parts}")
        kernel = sass.compile_spec(spec)
        r = sass.report(kernel)
        assert r["stack_bytes"] == 0 and r["registers"] <= 64, r
        loads[parts] = sum(1 for op in sass.sequence(kernel) if op == "LDG")
    assert loads[8] > loads[1] >= loads[0] > 0, loads

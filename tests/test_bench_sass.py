"""bench/sass.py: the decode kernels compiled for sm_90a on the CPU. The fp16-operand Down has no bf16 conversion
instruction (F2F) left and the bf16 form has them (the change of docs/PERF.md, seen in the SASS); the report reads
real registers and instruction counts; the CLI rejects unknown kernels and malformed overrides."""

from __future__ import annotations

import json

import pytest

from iquest.bench import sass


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


def test_unknown_constexpr_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        sass.compile_spec(sass.specs()["moe_down"], NOT_A_PARAMETER=1)


def test_cli(tmp_path, capsys):
    from iquest.cli.main import main

    out = tmp_path / "sass.json"
    assert main(["bench", "sass", "--kernels", "moe_down", "--set", "moe_down.F16=False", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overrides"] == {"moe_down": {"F16": False}} and report["kernels"]["moe_down"]["mix"]["F2F"] > 0
    assert "moe_down (MoE Down)" in capsys.readouterr().out
    assert main(["bench", "sass", "--kernels", "nope"]) != 0
    assert main(["bench", "sass", "--set", "moe_down"]) != 0

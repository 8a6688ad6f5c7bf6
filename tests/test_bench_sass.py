"""bench/sass.py: the decode kernels on the product path (the FP8 linears) compiled for sm_90a on the CPU at one TP8
rank's shapes of docs/model.md's model. The FP8 linear's preloaded weight tiles are all requested before the PDL
wait, with nothing that waits for them before it; the report reads real registers and instruction counts; the CLI
rejects unknown kernels and malformed overrides. The kept kernels written for the retired architecture (off the
product path) are only checked to build."""

from __future__ import annotations

import dataclasses
import json

import pytest

from iquest.bench import sass
from iquest.kernels.testing import substitute
from iquest.tests.kernel_controls import LINEAR_TRANSPARENT


def _before_wait(spec, **constexprs) -> list[str]:
    seq = sass.sequence(sass.compile_spec(spec, **constexprs))
    assert seq.count("ACQBULK") == 1, "one griddepcontrol.wait"
    return seq[:seq.index("ACQBULK")]


def test_specs_are_the_published_rank_shapes():
    """q/k/v of one TP8 rank: 6 query heads and one KV head's k and v, 1024 rows of 3072; 24 K tiles in 8 splits on
    132 SMs, so 3 preloaded a program; o_proj's K is its 6 heads' 768 columns."""
    specs = sass.specs()
    assert set(specs) == {"fp8_linear", "fp8_linear_loop", "fp8_linear_direct"}
    assert specs["fp8_linear"].constexprs["PRELOAD"] == 3 and "[1024 x 3072]" in specs["fp8_linear"].note
    assert specs["fp8_linear_direct"].constexprs["PRELOAD"] == 6


def test_preloaded_tiles_are_all_requested_before_the_wait():
    """q/k/v's preloaded tiles (2 x 128-bit loads a thread each) and their scales: every load issued before the wait,
    and no barrier there (a barrier before the wait is a layout conversion waiting for a tile's bytes, which would
    make the tiles' HBM round trips follow one another). Negative control: without the opaque move after the wait,
    Triton converts each tile right after its load, and the barriers appear. The loop form reads nothing before the
    wait."""
    spec = sass.specs()["fp8_linear"]
    tiles = spec.constexprs["PRELOAD"]
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


def test_report_reads_registers_and_the_mix():
    r = sass.report(sass.compile_spec(sass.specs()["fp8_linear_loop"]))
    assert 32 <= r["registers"] <= 255 and r["stack_bytes"] == 0 and r["mix"].get("HMMA", 0) > 0
    assert r["instructions"] == sum(r["mix"].values())


def test_unknown_constexpr_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        sass.compile_spec(sass.specs()["fp8_linear"], NOT_A_PARAMETER=1)


def test_cli(tmp_path, capsys):
    from iquest.cli.main import main

    out = tmp_path / "sass.json"
    assert main(["bench", "sass", "--kernels", "fp8_linear", "--set", "fp8_linear.PRELOAD=0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overrides"] == {"fp8_linear": {"PRELOAD": 0}} and report["kernels"]["fp8_linear"]["mix"]["HMMA"] > 0
    assert "fp8_linear (FP8 linear" in capsys.readouterr().out
    assert main(["bench", "sass", "--kernels", "moe_down"]) != 0  # retired with the guessed architecture
    assert main(["bench", "sass", "--set", "fp8_linear"]) != 0

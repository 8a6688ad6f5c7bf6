"""bench/parking.py: the CLI refuses bad arguments and a machine without a GPU; on the GPU the probe's copies run at
HBM speed (else it measures nothing) and every variant is timed."""

from __future__ import annotations

import pytest


def test_cli_refuses(capsys):
    from iquest.cli.main import main

    assert main(["bench", "parking", "--repeats", "0"]) != 0
    assert "--repeats" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["bench", "parking"]) != 0
        assert "CUDA" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_probe_runs(tmp_path):
    from iquest.bench.parking import run

    report = run(str(tmp_path / "parking.json"), repeats=2, iters=4)
    assert report["copy_tb_s"] > 1.0, report["copy_tb_s"]  # from HBM, at a good share of its bandwidth
    assert len(report["beside_us_per_copy"]) == 5 and all(v["median"] > 0 for v in report["beside_us_per_copy"].values())
    assert set(report["chain"]["us_per_iter"]) == {"CHAINED", "CASCADE", "copies"}
    steps = report["chain"]["us_per_dependent_step"]
    assert set(steps) == {"OFF", "CHAINED", "CASCADE", "in-kernel", "in-kernel-asm", "in-kernel-flags"} and all(0 < v["median"] < 50 for v in steps.values()), steps

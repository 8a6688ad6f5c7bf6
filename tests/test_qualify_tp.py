"""Qualification under tensor parallelism (CPU, gloo): the sampler is checked on the candidates the ranks gather,
and the controls that depend on the layout break every rank's slice as they break the whole model (the two that an
H200 run at TP 2 missed: its sampler rows were not scored, and a rank's own slice of a square scale grid is seldom
square), and the draft's own window holds under the ranks' split KV heads."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from iquest.fast import sampler
from iquest.fast.parallel import Parallel
from iquest.fast.weights import WeightLoader
from iquest.qualify.controls import TransposedScales
from iquest.qualify.replay import candidate_logits
from iquest.reference import sampling
from iquest.reference.checkpoint import CheckpointReader
from iquest.reference.config import Config
from iquest.tests.helpers import TINY



@pytest.fixture(scope="module")
def report():
    # A process of its own, as a user runs it: rank 0 then owns the process's one default process group, whatever
    # the other tests in this pytest worker left behind
    run = subprocess.run([sys.executable, "-m", "iquest.cli.main", "qualify", "--model", str(TINY), "--tp", "2",
                          "--quick", "--jobs", "1", "--json", "--control", "fp8_scales_transposed",
                          "--control", "top_p_drops_crossing", "--control", "draft_window_4096"], capture_output=True, text=True, timeout=600)
    assert run.stdout, run.stderr[-3000:]
    data = json.loads(run.stdout)
    data["_rc"] = run.returncode
    return data


def test_tp2_scores_the_sampler_and_passes(report):
    assert report["tp"] == 2 and report["_rc"] == 0 and report["passed"]
    sampler_rows = [c for c in report["checks"] if c["check"] == "numerics.sampler"]
    assert sampler_rows and sum(c["rows"] for c in sampler_rows) > 0


@pytest.mark.parametrize("control", ["fp8_scales_transposed", "top_p_drops_crossing", "draft_window_4096"])
def test_tp2_controls_caught_where_intended(report, control):
    r = next(c for c in report["controls"] if c["name"] == control)
    assert r["branch_count"] > 0 and r["caught"], r
    assert all(tuple(x) in {tuple(i) for i in r["intended"]} for x in r["caught_by"])


def test_candidate_logits_give_the_full_rows_dist():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 64, generator=gen)
    params = sampling.SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    keys = torch.cat([sampler._local_keys(part, 5, 32 * r) for r, part in enumerate(logits.split(32, dim=-1))], -1)
    rows = candidate_logits(keys, 64)
    assert int(torch.isfinite(rows).sum()) == 3 * 10
    for full, cand in zip(logits, rows):
        want, got = sampling.dist(full.double(), params), sampling.dist(cand, params)
        assert torch.equal(want.ids, got.ids) and torch.equal(want.probs, got.probs)


def test_transposed_scales_slice_the_whole_transposed_grid():
    config = Config.from_dir(TINY)
    reader = CheckpointReader(TINY, config)
    bar = SimpleNamespace(update=lambda n: None)
    square = [n for n, spec in reader.specs.items() if reader.is_quantized(n)
              and (s := reader.read(spec.scale_name)).shape[-1] == s.shape[-2] and not torch.equal(s, s.transpose(-1, -2))]
    assert square, "the fixture has no weight for the control to break"

    def scales(loader, name):
        return [loader(reader, Parallel(rank=r, world=2, device=torch.device("cpu")), torch.float32, bar,
                       "fp8").linear(name).scale for r in range(2)]
    for name in square:
        whole = reader.read(reader.specs[name].scale_name).transpose(-1, -2)
        parts, healthy = scales(TransposedScales, name), scales(WeightLoader, name)
        dim = next((d for d in (0, 1) if parts[0].shape[d] != whole.shape[d]), None)
        got = parts[0] if dim is None else torch.cat(parts, dim)
        assert torch.equal(got, whole), name
        assert not all(torch.equal(p, h) for p, h in zip(parts, healthy)), name

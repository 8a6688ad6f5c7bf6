"""lab/moe_scale_forms.py: its exact MoE is the torch form's arithmetic without roundings, and a short run on the mini
model reports both of Gate/Up's scale forms near the exact output and apart from each other."""

from __future__ import annotations

import torch

from iquest.kernels import moe as mk
from iquest.lab import moe_scale_forms as msf
from iquest.tests.helpers import fixture_dir
from iquest.tests.test_kernel_moe import build, case


def test_the_exact_moe_is_the_torch_forms_arithmetic_without_its_roundings():
    t = build(case("exact", R=3, k=2, E=4, H=64, I=24, block=(32, 32), offset=16), "cpu")
    args = (t["b"], t["experts"], t["weights"], t["gate"], t["up"], t["down"])
    ref = msf.exact_moe(*args)
    assert msf.rel(mk.moe_torch(*args, mk.MoESettings(gate_up_split=1)), ref) < 1e-5  # fp32 b: fp32 sums only
    # control: the routing weights left out of the exact output is caught far above that
    assert msf.rel(mk.moe_torch(*args), msf.exact_moe(*args[:2], torch.ones_like(t["weights"]), *args[3:])) > 0.1


def test_a_short_run_reports_both_forms_near_the_exact_output():
    r = msf.run(fixture_dir("iquest-q1-mini"), 1)
    for f in msf.FORMS:
        assert 0 < r["rms_rel_all"][f] < 0.02 and 0 < r["worst_rel_all"][f] < 0.05, r
    assert r["rms_rel"]["weight"] != r["rms_rel"]["product"]  # the two forms' arithmetic ran

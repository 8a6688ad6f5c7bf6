"""kernels/logprobs.py against its contract, fast/sampler.logprob_parts (the torch form): a rank's log-normalizer
and the logits of the tokens it holds, as fp32 bits in int64.

The tokens' logits are copies, so they must be bit for bit the torch form's (and -inf for tokens another rank holds).
The log-normalizer is summed online (a running maximum, the sum rescaled as it grows), so it may differ in its last
bits: the bound is fp32's unit roundoff times (Vr + the largest |x - max| + |max| + 4), the worst case of a Vr-term
sum of exponentials whose arguments each round once, carried through the log. Cases cover one row and eight, a
rank's slice narrower than one step (2048 logits) and wider (the TP8 rank's 20,000), logits that grow along the row
(so the running maximum moves and the sum is rescaled), tokens inside, outside and at both edges of the slice. A
negative control drops the slice's offset, and the tokens' logits must then differ.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.fast import sampler
from iquest.kernels import logprobs as lk
from iquest.kernels.testing import interpreted_tests

U32 = 2.0 ** -24
CASES = [dict(name="1row_narrow", R=1, V=100, m=3, rank=1, ramp=False),
         dict(name="8rows_two_steps", R=8, V=3000, m=1, rank=1, ramp=False),
         dict(name="6rows_ramp_tp8", R=6, V=20000, m=3, rank=3, ramp=True),
         dict(name="2rows_tp1_wide", R=2, V=5000, m=2, rank=0, ramp=True, tp=1)]


def build(c: dict, device: str):
    g = torch.Generator().manual_seed(len(c["name"]) * 7 + c["R"])
    x = torch.randn(c["R"], c["V"], generator=g) * 4
    if c["ramp"]:  # the maximum moves at every step
        x += torch.linspace(0, 30, c["V"])
    offset = c["rank"] * c["V"]
    vocab = c["V"] * c.get("tp", 8)
    edges = torch.tensor([offset, offset + c["V"] - 1, offset - 1, offset + c["V"], 0, vocab - 1]).clamp(0, vocab - 1)
    tokens = torch.randint(0, vocab, (c["R"], c["m"]), generator=g)
    tokens.view(-1)[:min(tokens.numel(), edges.numel())] = edges[:tokens.numel()]
    return x.to(device), tokens.to(device), offset


def run_case(c: dict, device: str, offset_delta: int = 0) -> dict:
    x, tokens, offset = build(c, device)
    got = lk.logprob_parts(x, tokens, offset + offset_delta)
    want = sampler.logprob_parts(x, tokens, offset)
    f_got, f_want = (t.to(torch.int32).view(torch.float32).double() for t in (got, want))
    peak = x.double().amax(-1)
    spread = (x.double() - peak[:, None]).abs().amax(-1)
    bound = U32 * (c["V"] + spread + peak.abs() + 4)
    held = ((tokens >= offset) & (tokens < offset + c["V"])).cpu()
    return {"lse_over_bound": float(((f_got[:, 0] - f_want[:, 0]).abs().cpu() / bound.cpu()).max()),
            "values_bits": bool(torch.equal(got[:, 1:], want[:, 1:])), "held": int(held.sum()),
            "others": int((~held).sum()), "shape": list(got.shape)}


def _check(c: dict, r: dict) -> None:
    assert r["shape"] == [c["R"], 1 + c["m"]]
    assert r["lse_over_bound"] <= 1.0, r
    assert r["values_bits"], r
    assert r["held"] >= 1 and (r["others"] >= 1 or c.get("tp") == 1), r


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check)


def test_interpreted_negative_control(interpreted):
    """The slice's offset dropped: the held tokens' logits are read from the wrong columns."""
    r = interpreted["negative_control"]
    assert "error" not in r, r.get("error")
    assert r["held"] >= 1 and not r["values_bits"], r


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.zeros(2, 8, dtype=torch.float64)), "x"),
    (dict(x=torch.zeros(8, 2).t()), "x"),
    (dict(tokens=torch.zeros(2, 1, dtype=torch.int32)), "tokens"),
    (dict(tokens=torch.zeros(3, 1, dtype=torch.int64)), "tokens"),
    (dict(tokens=torch.zeros(2, lk.MAX_TOKENS + 1, dtype=torch.int64)), "tokens"),
    (dict(vocab_offset=-1), "vocab_offset"),
])
def test_rejects_bad_inputs(over, message):
    a = dict(x=torch.zeros(2, 8), tokens=torch.zeros(2, 1, dtype=torch.int64), vocab_offset=0)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        lk.logprob_parts(**a)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [("negative_control", lambda: run_case(CASES[2], "cpu", offset_delta=-CASES[2]["V"]))])

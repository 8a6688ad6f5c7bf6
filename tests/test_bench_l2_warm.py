"""bench/l2_warm.py's reads: every program reads exactly its expert's chunk (GPU: the probe's kernels)."""

import functools

import pytest
import torch

from iquest.bench.l2_warm import bulk_experts, read_experts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("evict_last", [False, True])
def test_read_experts_reads_each_chosen_chunk(evict_last):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    t = torch.randint(-2**31, 2**31 - 1, (7, 3, 4096), dtype=torch.int32, device=dev, generator=g)
    experts = torch.tensor([5, 0, 3], dtype=torch.int32, device=dev)
    out = torch.full((4096,), 7, dtype=torch.int32, device=dev)
    read_experts([t], experts, out, sms=8, evict_last=evict_last)
    torch.cuda.synchronize()
    words = 3 * 4096
    chunks = max(1, 32 // 3)
    while words % (chunks * 1024):
        chunks -= 1
    per = words // chunks
    want = [functools.reduce(lambda a, v: a ^ v, t[e].flatten()[c * per:(c + 1) * per].tolist(), 0)
            for e in experts.tolist() for c in range(chunks)]
    assert out[:len(want)].tolist() == want
    assert out[len(want):].eq(7).all()  # nothing beyond the grid written


def test_bulk_requests_change_nothing():
    dev = torch.device("cuda")
    t = torch.arange(5 * 256 * 1024, dtype=torch.int32, device=dev).view(5, 256, 1024)
    before = t.clone()
    bulk_experts([t], torch.tensor([4, 1], dtype=torch.int32, device=dev), piece=768)
    bulk_experts([t], torch.tensor([2], dtype=torch.int32, device=dev), piece=12_288)
    torch.cuda.synchronize()
    assert torch.equal(t, before)

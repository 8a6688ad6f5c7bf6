"""The GPU probes' readers read what they say: bench/l2_warm.py's per-expert reads and bulk requests, and
bench/stream_probe.py's flat reads in both load forms (GPU: Triton's interpreter does not run them)."""

import functools

import pytest
import torch

from iquest.bench.l2_warm import bulk_experts, read_experts
from iquest.bench.stream_probe import flat_read

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


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("programs,block", [(3, 1024), (7, 1024), (5, 4096)])
def test_flat_read_reads_every_word_once(scalar, programs, block):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    src = torch.randint(0, 255, (4096 * 13 + 48,), dtype=torch.uint8, device=dev, generator=g)  # a partial last step
    out = torch.zeros(64, dtype=torch.int32, device=dev)
    flat_read(src, out, programs, scalar, block)
    torch.cuda.synchronize()
    words = src.view(torch.int32).tolist()
    assert functools.reduce(lambda a, b: a ^ b, out.tolist(), 0) == functools.reduce(lambda a, b: a ^ b, words, 0)

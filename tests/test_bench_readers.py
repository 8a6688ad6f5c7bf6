"""The GPU probe's reader reads what it says: bench/stream_probe.py's flat reads in both load forms (GPU: Triton's
interpreter does not run them)."""

import functools

import pytest
import torch

from iquest.bench.stream_probe import flat_read

pytestmark = pytest.mark.gpu


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

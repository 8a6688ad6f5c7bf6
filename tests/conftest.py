"""Test session setup: one torch thread per process (CI has 2 cores and pytest-xdist uses both),
and `@pytest.mark.gpu` tests skipped where no CUDA device is present."""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

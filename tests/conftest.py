"""Test session setup: one torch thread per process (CI has 2 cores and pytest-xdist uses both),
and `@pytest.mark.gpu` tests skipped where no CUDA device is present."""

import importlib.util
import os
import sys

import pytest
import torch

# `python -m pytest` (and each pytest-xdist worker) puts the working directory first on sys.path. From the checkout
# that makes its folders top-level packages (kernels/, reference/, ...) that shadow installed ones of the same name:
# transformers imports Hugging Face's `kernels` package and got ours. The project is imported as `iquest` (its
# install), never by folder, so the checkout's root leaves the path before any test module is imported.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

torch.set_num_threads(1)

# The GPU machines run their own torch and triton without the server's packages: there the server's tests (CPU tests,
# run by CI) are not collected, rather than failing the GPU run at import.
collect_ignore_glob = ([] if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx", "openai"))
                       else ["test_serve*.py"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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
# and one in every process a test starts (the interpreted kernel workers, qualification's job processes, the CLI and
# server under test), which would otherwise each take a thread a core beside the two workers': 18% of the wall time
# of the engine and kernel modules on CI's two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The GPU machines run their own torch and triton without the server's packages: there the server's tests (CPU tests,
# run by CI) are not collected, rather than failing the GPU run at import.
collect_ignore_glob = ([] if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx", "openai",
                                                                     "anthropic", "pydantic"))
                       else ["test_serve*.py", "test_agents_live.py", "test_chat_template.py", "test_bench_agent.py"])


# Modules that take a minute or more on CI's two cores (an interpreted kernel worker, a qualification run), longest
# first. With --dist loadfile a module is one unit of work, and xdist's default order (most tests first) put these
# few-test modules last, one running alone while the other core idled; pyproject's --no-loadscope-reorder keeps this
# order, and the other modules keep theirs after them.
LONG_FIRST = ("test_qualify.py", "test_fast_engine.py", "test_fast_kernels.py", "test_kernel_moe.py",
              "test_qualify_tp.py", "test_cli_qualify.py", "test_bench_sass.py", "test_agents_live.py",
              "test_debug_chain.py", "test_round_kernels.py")  # by their CPU seconds in CI (--durations=0)


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_FIRST)))  # stable: a module's own order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without a GPU, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_line_error(capsys):
    """check(argv, *needles): `iquest argv` exits 2 with one line of error on stderr (no traceback) holding each
    needle."""
    from iquest.cli.main import main

    def check(argv: list[str], *needles: str) -> None:
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in lines[0] and "error" in lines[0], lines
        for n in needles:
            assert n in lines[0], lines[0]
    return check

"""Which source revision produced a result (benchmarks and qualification reports record it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def commit() -> str:
    """The source revision: $IQUEST_COMMIT where the tree travels without .git (the lent GPU machines)."""
    if os.environ.get("IQUEST_COMMIT"):
        return os.environ["IQUEST_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"

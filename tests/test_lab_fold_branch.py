"""lab/fold_branch.py's interpreter check: the router fold's two terms through the router's logits kernel and the tail
at T = 1 on them, against torch; and its control (A's last H tile dropped), which the check must catch."""

import os
import subprocess
import sys


def _check(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_CORETYPE="Prescott")
    return subprocess.run([sys.executable, "-m", "iquest.lab.fold_branch", *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_terms_and_the_tail_agree_with_torch(tmp_path):
    run = _check(tmp_path, "--check")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("PASS")


def test_a_dropped_tile_is_caught(tmp_path):
    run = _check(tmp_path, "--control")
    assert "its last H tile dropped" in run.stdout  # the broken launch ran
    assert run.returncode == 1 and run.stdout.rstrip().endswith("FAIL"), run.stdout + run.stderr

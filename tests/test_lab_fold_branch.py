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


def test_the_longest_kernel_path_counts_the_chain_and_a_side_only_where_it_lengthens_it():
    from iquest.lab.fold_branch import longest_kernel_path

    # two layers of the branch arm. Layer 1: 0 A (side); 1 q/k/v -> 2 attention -> 3 B (side) and 4 o-projection ->
    # 5 tail, with 6 a node that is not a kernel between the side's launches. Layer 2, after the tail: 7 A (side);
    # 8 q/k/v, 9 attention, 10 o-projection, 11 tail
    kernel = {v: True for v in range(12)} | {6: False}
    edges = [(1, 2), (2, 6), (6, 3), (2, 4), (4, 5), (3, 5), (0, 5)]
    edges += [(5, 7), (5, 8), (8, 9), (9, 10), (10, 11), (7, 11)]
    assert longest_kernel_path(kernel, edges) == 8  # 1 2 4 5 | 8 9 10 11: the side's launches lengthen nothing
    longer = edges + [(0, 12), (12, 13), (13, 14), (14, 15), (15, 5)]  # a side four kernels longer than the chain
    assert longest_kernel_path(kernel | {v: True for v in range(12, 16)}, longer) == 10  # 0 12-15 5, then 4
    assert longest_kernel_path({}, []) == 0

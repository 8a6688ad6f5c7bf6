#!/usr/bin/env bash
# GPU tests and benchmarks on a lent H200 (the device tool copies the working tree, without .git and
# without an editable install): make `import iquest` work from the copy, then run what is asked.
#   bash ci/gpu.sh tests [PATHS...]      the @pytest.mark.gpu tests (all of tests/ by default)
#   bash ci/gpu.sh bench ARGS...         iquest bench ARGS...
#   bash ci/gpu.sh iquest ARGS...        any iquest command (e.g. qualify --device cuda)
#   bash ci/gpu.sh mps COMMAND...       COMMAND (any of these) with an MPS daemon running, so that several ranks on one
#                                        GPU run side by side (e.g. mps iquest qualify --tp 2 --device cuda --share-gpu)
# (The `ncu` mode, Nsight Compute over the retired architecture's kernel ops, left with bench/ncu_ops.py: docs/PERF.md,
# "Retired with the guessed architecture".)
# Results go to $OUT when it is set (the device tool brings that folder back).
set -euo pipefail
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/iquest
export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off
out=${OUT:-/tmp}
case "${1:-tests}" in
  tests) shift || true; python3 -m pytest -q -m gpu -p no:cacheprovider -s "${@:-tests}" 2>&1 | tee "$out/gpu-tests.log" ;;
  # results name their commit (provenance.py): the copy's own git, where one travels, is the session's first commit,
  # not the snapshot's (seen at fd92958), so the commit is asked for
  bench) shift; : "${IQUEST_COMMIT:?set IQUEST_COMMIT to the commit under test}"
    python3 -m iquest.cli.main bench "$@" ;;
  iquest) shift; : "${IQUEST_COMMIT:?set IQUEST_COMMIT to the commit under test}"
    python3 -m iquest.cli.main "$@" ;;
  mps) shift
    control=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
    mps=$(mktemp -d /tmp/iquest-mps-XXXX)
    export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$control" -d
    trap 'echo quit | "$control"; rm -rf "$mps"' EXIT
    bash "$0" "$@" ;;
  *) echo "usage: bash ci/gpu.sh tests|bench|iquest|mps ..." >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 8 on nvidia-h200-x8 (never lent so far), one part per device call (each fits the 10-minute limit):
#   IQUEST_COMMIT=<sha> bash ci/tp8.sh tests|1k|192k|slice
# Raw outputs go under $OUT (the device tool brings them back) for docs/PERF.md.
set -uo pipefail
: "${IQUEST_COMMIT:?set IQUEST_COMMIT to the commit being measured}"
out=${OUT:-/tmp}
full=configs/iquest-q1.json
tp8() {  # $1 context
  timeout 560 bash ci/gpu.sh bench step --config $full --tp 8 --kernels triton --context "$1" --drafts 5 \
    --repeats 3 --out "$out/step-tp8-ctx$1-d5.json" 2>&1 | tee "$out/step-tp8-ctx$1-d5.log"
}
case "${1:-}" in
  tests) timeout 560 bash ci/gpu.sh tests tests/test_fast_gpu.py -k "test_tp_on_gpus" ;;  # TP8 vs TP1 tokens
  1k) tp8 1024 ;;
  192k) tp8 196608 ;;  # synthetic KV history (bench/history.py): a real 192K prefill does not fit one call
  slice) CUDA_VISIBLE_DEVICES=0 timeout 560 bash ci/gpu.sh bench step --config $full --tp-slice 8 \
           --kernels triton,torch --context 1024 --drafts 5 --repeats 5 --out "$out/step-slice-ctx1024-d5.json" \
           2>&1 | tee "$out/step-slice-ctx1024-d5.log" ;;  # the rank-slice figure for the same commit
  *) echo "usage: IQUEST_COMMIT=<sha> bash ci/tp8.sh tests|1k|192k|slice" >&2; exit 2 ;;
esac

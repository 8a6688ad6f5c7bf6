#!/usr/bin/env bash
# The next single-H200 session's runs (issues 50-52; docs/PERF.md, "Open directions", first item), one part per
# device call, each within the tool's 10-minute limit. Raw files go to $OUT named by the commit (pass it: the tree
# travels without .git):
#   IQUEST_COMMIT=<sha> bash ci/gpu_plan.sh STAGE
# STAGE (in the order to run them: docs/PERF.md, "Open directions", first item):
#   first     qualification at TP 1 of the Gate/Up split in 4 (--moe-setting gate_up_split=4: 0.8315x the round, paired,
#             on an H100 at fd92958; a numerical change, the default once this passes), a call of its own: the default
#             engine's passed in 282 s on a fresh H100 at fd92958 (17/17 controls); 440 s, then the LM head's
#             same-bits tiles timed (70 s), leaving the rest of the call's 600 s to pack the compiled kernels
#   split     Gate/Up's K steps: bench tune of its splits and scale form at 9 experts, then the round paired three ways
#             (triton, triton+routed_prefetch, triton@gate_up_split=4: EngineOptions.moe_settings), one call; ran in
#             parts at fd92958 on an H100 (docs/PERF.md, current state): run again only after a change to Gate/Up
#   tune      bench tune: the q/k/v fold's splits, the linears, the attention, the router fold's o-projection first,
#             then the MoE at 38 experts with the split, then the prefetch branch, the router, the tails, the top-k
#   tests     the @pytest.mark.gpu suite but the MPS module (over 4 min with 6 workers)
#   mps       the MPS module (fused tails at 2 and 8 ranks, the TP engines at 2, 4 and 8, the captured loop)
#   qualify2  qualification, bf16, TP 2 on one GPU under MPS (further arguments: qualify's, e.g. --moe-setting ...)
#   step      the benchmark of record (triton, +routed_prefetch and ~route:38 in one process, ~5 min);
#             step2 the folds' controls (+down_tail, ^qkv_rope) against triton
#   trace     bench graph-trace: kernels a decoder layer, with and without each fold
#   prefetch  the expert prefetch, paired, at 4 and 5 live rows (drafts 3 and 4), where it launches
#   rest      bench context (1K-512K), bench depth (the controller's gain, paired), mini decode tok/s
#   qualify   qualification, bf16, TP 1: the default engine, then with --router-fold (~4 min each)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sha=${IQUEST_COMMIT:?set IQUEST_COMMIT to the commit under test}
out=${OUT:?set OUT to the folder the device tool brings back}
gpu() { bash "$here/gpu.sh" "$@"; }
# Compiled kernels travel between calls (ci/triton_cache.py): carried in from .triton-cache/ beside ci/, brought back
# from every stage (copy the returned triton-cache-part-* files into that folder before the next snapshot).
export TRITON_CACHE_DIR=/tmp/iquest-triton-cache
python3 "$here/triton_cache.py" unpack "$here/../.triton-cache" "$TRITON_CACHE_DIR" \
  || echo "triton cache: not unpacked" >&2
trap 'python3 "$here/triton_cache.py" pack "$TRITON_CACHE_DIR" "$out" || echo "triton cache: not packed" >&2' EXIT
case "${1:-}" in
  tests)  # 135 s at 8d0c782 on an H100 (448 passed); gpu.sh passes -q: a second -q would drop the summary line
    timeout 540 bash "$here/gpu.sh" tests -n 8 --dist load --ignore tests/test_tp_collectives.py tests \
      > "$out/gpu-tests-$sha.log" 2>&1 || echo "gpu tests: exit $?" >&2
    tail -3 "$out/gpu-tests-$sha.log" ;;
  mps)  # 295 s at 8d0c782 on an H100, every test passing (the TP 2, 4 and 8 engines, the captured loop)
    timeout 540 bash "$here/gpu.sh" mps tests tests/test_tp_collectives.py > "$out/gpu-tests-mps-$sha.log" 2>&1 \
      || echo "mps tests: exit $?" >&2
    tail -3 "$out/gpu-tests-mps-$sha.log" ;;
  qualify)
    for fold in "" --router-fold; do
      name=qualify-mini-cuda-bf16${fold:+-router-fold}-$sha
      gpu iquest qualify --model fixtures/iquest-q1-mini --device cuda --dtype bf16 --jobs 14 $fold --json \
        > "$out/$name.json" 2> "$out/$name.log" || echo "$name: exit $?" >&2
      tail -2 "$out/$name.log"
    done ;;
  qualify2)  # any further arguments go to qualify (--moe-setting gate_up_split=4), and name the files
    shift; extra="$*"; name=qualify-mini-cuda-bf16-tp2${extra:+-${extra//[^a-z0-9]/}}-$sha
    timeout 560 bash "$here/gpu.sh" mps iquest qualify --tp 2 --device cuda --share-gpu --dtype bf16 --jobs 12 --json \
      "$@" > "$out/$name.json" 2> "$out/$name.log" || echo "$name: exit $?" >&2
    tail -2 "$out/$name.log" ;;
  step|step2)  # at most three engines a process: seven did not finish their prefills and captures in 290 s (72c654b)
    kernels=triton,triton+routed_prefetch,triton~route:38
    [ "$1" = step2 ] && kernels=triton,triton+down_tail,triton^qkv_rope
    gpu bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 --kernels "$kernels" \
      --out "$out/$1-full-tp8slice-ctx1k-d5-$sha.json" 2>&1 | tee "$out/$1-full-tp8slice-ctx1k-d5-$sha.log" ;;
  prefetch)
    for d in 3 4; do
      gpu bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 --drafts $d \
        --kernels triton,triton+expert_prefetch \
        --out "$out/step-full-tp8slice-ctx1k-d$d-prefetch-$sha.json" 2>&1 | tail -25 \
        | tee "$out/step-full-tp8slice-ctx1k-d$d-prefetch-$sha.log"
    done ;;
  first)
    name=qualify-mini-cuda-bf16-split4-$sha
    timeout 440 bash "$here/gpu.sh" iquest qualify --model fixtures/iquest-q1-mini --device cuda --dtype bf16 \
      --moe-setting gate_up_split=4 --jobs 14 --json > "$out/$name.json" 2> "$out/$name.log" \
      || echo "$name: exit $?" >&2
    tail -2 "$out/$name.log"
    # the LM head's same-bits tiles together (each alone ~0.83x at fd92958), in what the call has left
    timeout 70 bash "$here/gpu.sh" bench tune --ops lm_head --budget 45 \
      --only "block_v=8,rows_warps=4,block_v=8+rows_warps=4,block_v=4,block_v=4+rows_warps=4" \
      --out "$out/tune-lm-head-same-bits-$sha.json" > "$out/tune-lm-head-same-bits-$sha.log" 2>&1 \
      || echo "tune: exit $?" >&2
    tail -7 "$out/tune-lm-head-same-bits-$sha.log" ;;
  split)
    only=gate_up_split=2,gate_up_split=4,gate_up_split=8,gate_up_split=4+gate_up_scale=product
    timeout 200 bash "$here/gpu.sh" bench tune --ops moe --distinct 9 --only "$only,gate_up_scale=product,gate_up_stages=6" \
      --budget 150 --out "$out/tune-h200-moe9-split-$sha.json" 2>&1 | tee "$out/tune-h200-moe9-split-$sha.log" | tail -14 \
      || echo "tune: exit $?" >&2
    timeout 350 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
      --kernels triton,triton+routed_prefetch,triton@gate_up_split=4 --out "$out/step-split-ctx1k-d5-$sha.json" 2>&1 \
      | tee "$out/step-split-ctx1k-d5-$sha.log" | tail -40 || echo "step: exit $?" >&2 ;;
  tune)  # the q/k/v fold's splits (10.5 us a call at fd92958 for ~1 us of bytes), the linears (6.2 us), the attention's
    # split and combine, the router fold's o-projection chunk; then the MoE at 38 experts with the split; then the
    # rest; one budget a part, spent in that order, so that one call returns what it reached. The MoE at 9 experts and
    # the head's tiles ran at fd92958 (split, first)
    gpu bench tune --ops qkv_rope_kv,linear_o,linear_qkv,attention_sliding,attention_full,o_proj_router --budget 260 \
      --out "$out/tune-qkv-linears-attention-$sha.json" 2>&1 | tee "$out/tune-qkv-linears-attention-$sha.log" | tail -50
    only=gate_up_split=4,gate_up_split=8,gate_up_split=4+gate_up_scale=product,gate_up_stages=6,down_prefetch=False
    gpu bench tune --ops moe --distinct 38 --only "$only" \
      --budget 110 --out "$out/tune-moe38-$sha.json" 2>&1 | tee "$out/tune-moe38-$sha.log" | tail -8
    gpu bench tune --ops expert_prefetch,router,add_norm,topk --budget 150 \
      --out "$out/tune-rest-$sha.json" 2>&1 | tee "$out/tune-rest-$sha.log" | tail -40 ;;
  trace)
    gpu bench graph-trace --kernels triton,triton+router_fold,triton+down_tail,triton^moe_combine,triton^qkv_rope \
      --out "$out/graph-trace-$sha.json" 2>&1 | tee "$out/graph-trace-$sha.log" ;;
  rest)
    gpu bench context --out "$out/context-tp8slice-$sha.json" 2>&1 | tail -20 | tee "$out/context-tp8slice-$sha.log"
    gpu bench depth --device cuda --prompts 16 --tokens 64 --repeats 5 --out "$out/depth-mini-cuda-$sha.json" 2>&1 \
      | tail -20 | tee "$out/depth-mini-cuda-$sha.log" ;;
  *) echo "usage: IQUEST_COMMIT=<sha> bash ci/gpu_plan.sh first|split|tune|tests|mps|qualify|qualify2|step|step2|trace|prefetch|rest" >&2
     exit 2 ;;
esac

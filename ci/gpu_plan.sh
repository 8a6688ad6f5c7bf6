#!/usr/bin/env bash
# The next single-H200 session's runs (issues 50-52; docs/PERF.md, "Open directions", first item), one part per
# device call, each within the tool's 10-minute limit. Raw files go to $OUT named by the commit (pass it: the tree
# travels without .git):
#   IQUEST_COMMIT=<sha> bash ci/gpu_plan.sh STAGE
# STAGE (in the order to run them):
#   tests     the @pytest.mark.gpu suite but the MPS module (111 s at 17fb4ea on an H100: 467 passed, 0 failed; at
#             53974e4 on an H200 the same, 63 s warm)
#   mps       the MPS module (the TP 2, 4 and 8 engines, the captured loop: 295 s at 170deed, every test passing)
#   qualify   qualification, bf16, TP 1: the default engine (322 s at 8d0c782 with the split; 286 s at 1af897b), then
#             --router-fold (cut by the call's limit at 1af897b: FOLD_ONLY=1 runs it alone);
#             with CANDIDATE="OP.FIELD=VALUE ..." set, the engine with those kernel settings alone
#   qualify2a qualification, bf16, TP 2 on one GPU under MPS: the healthy engine, lossless and the first eight
#             controls; qualify2b the same with the other nine (logprobs_tempered needs TP 1), on 4 workers; with
#             CANDIDATE="OP.FIELD=VALUE ..." set, the engine with those kernel settings. At
#             61d6ab7 (H100) each half ended when one unit's ranks stopped advancing; at cc0ae4b (H200, after the
#             re-arm mend of a1dd992) both passed on 2 and 4 workers (qualify2one: QUALIFY_CONTROLS=... names the
#             controls; 413 s for 8 on 2 workers)
#   step      the benchmark of record at the adopted same-bits defaults (0.9595x paired at bc0ea27), the q/k/v fold
#             against its unfolded control (0.9755x at the old defaults, bc0ea27), ~route:38
#   agent     iquest bench agent on the GPU, prefix reuse on and off (the server's packages travel as wheels: run
#             ci/device_wheels.sh here and copy .whl/ into the snapshot)
#   context   bench context alone: the seven lengths 1K-512K (the context target is the H200's; at bc0ea27 a prefill
#             ran out of memory on the H100 with 28 GB reserved but unusable: the sweep now asks for expandable segments);
#             CONTEXTS="1024,16384,524160" times fewer lengths in a shorter call
#   rest      the context stage, then bench depth (the controller's gain, paired: +16.8% TPOT against fixed depth 3 at
#             bc0ea27)
#   depthprobe lab/depth_probe/gpu_bench.py: the controller's round as graphs (fixed 3, auto since 373a78a's nesting,
#             the rule as one kernel, ablations), node counts a level and decode time a round, paired
#   fold      the router fold: its two kernels tuned, then paired in the round (1.77x the round at bc0ea27: its
#             o-projection 57.6 us a call in the graph against 3.8-25 us in the tune)
#   ncu       under Nsight Compute, alone (the tune's calls): the fold's o-projection (57.6 us a call in the round at
#             bc0ea27, 3.6-25 us in the tune), the q/k/v fold and the o-projection (latency-bound at 170deed: 8.6% and
#             8.8% of peak DRAM throughput), each with its stall reasons' shares
#   ncumoe    Gate/Up and Down alone under Nsight Compute at 9 experts, full sections and each SASS line's stalls
#   trace     bench graph-trace: kernels and dependent steps a decoder layer, with and without each fold (10 at bc0ea27)
#   folds7    the router fold and Down ending in the tail together (8 and 9 steps apart at 5bc518f): their dependent
#             steps from the captured graph, then the round paired against the default and the fold alone
#   tune      bench tune: the MoE at 38 experts, then the attention, the router, the tails, the top-k, the head, the
#             fold's o-projection, an op a process (at 1946ffa a candidate of attention_full's made an illegal memory
#             access; block_n=16 alone ran clean)
#   tunectx   the attention's tune at 1K, 4K and 16K (the context sweep's excess sits at 4K-16K), an op a process
#             (TUNE_CONTEXTS, TUNE_OPS, TUNE_BUDGET narrow it)
#   stepctx   a candidate (CANDIDATE=...) paired with the defaults in the round at 4K and 16K
#   ctxpin    the context sweep (CONTEXTS, default 1K and 512K) as it runs and with the routing pinned at 14 experts
#   foldbranch the router fold's terms on a side stream, the chain piece captured (lab/fold_branch.py)
#   long      full layers' long splits with more tiles in flight (attention_full.long_stages): its GPU cases, then the
#             op's grid at 128K and 512K (one layer's cache fits an H100)
#   pair512   the defaults against PAIR512 (default triton@attention_full.long_stages=2), paired in one process at
#             512K: two engines there need an H200's memory (an H100 ran out at c29c1b3)
#   step2     the sliding layers' one K/V tile in flight and the top-k's 1024 tile against the two and 2048 before them
#             (same bits; with full layers' two, since back at three, 0.9903x paired at 61d6ab7)
#   downprod  Down's scales on the step's product capped at 128 registers (MoESettings.down_scale, down_registers:
#             the default since 362189d) against the weight form and the uncapped launch: its GPU cases, then the
#             round paired at 1K and 38 experts
#   launch    the o-projection's direct kernel (LinearSettings.direct, the default) against its Triton kernel, the
#             same bits: the round paired at 1K, then its engine-level GPU test
#   branch    the expert prefetch's branch stream: its GPU tests three times and the pooled-stream control
#   prefetch  the expert prefetch, paired, at 4 and 5 live rows (drafts 3 and 4), where it launches
#   candidate a numerical candidate (CANDIDATE="OP.FIELD=VALUE ...", e.g. attention_full.min_split=128):
#             qualification at TP 1 with it, the round paired against the defaults at 1K, then its context sweep, in
#             one call (each part within its own limit; 17fb4ea's took 259 s to qualify)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sha=${IQUEST_COMMIT:?set IQUEST_COMMIT to the commit under test}
out=${OUT:?set OUT to the folder the device tool brings back}
gpu() { bash "$here/gpu.sh" "$@"; }
file_tag() { printf '%s' "$1" | tr ' =' '-_' | tr -cd 'A-Za-z0-9._-'; }  # settings or a variant, in a file name
optional_candidate() {  # CANDIDATE="OP.FIELD=VALUE ..." (fast/kernel_settings.py), may be unset: settings, a file-name
  # tag and qualify's --kernel-setting arguments (all empty without it)
  settings=${CANDIDATE:-}
  tag=$(file_tag "$settings")
  setting_args=$([ -z "$settings" ] || printf -- '--kernel-setting %s ' $settings)
}
candidate_settings() {  # the same, CANDIDATE required; and the bench variant
  : "${CANDIDATE:?set CANDIDATE to the OP.FIELD=VALUE settings under test}"
  optional_candidate
  variant=triton$(printf '@%s' $settings)
}
# Compiled kernels travel between calls (ci/triton_cache.py): carried in from .triton-cache/ beside ci/, brought back
# from every stage (copy the returned triton-cache-part-* files into that folder before the next snapshot). The tool
# brings back eight files a call: a stage that writes more gets them as one results.tar.xz (tar xf it).
export TRITON_CACHE_DIR=/tmp/iquest-triton-cache
python3 "$here/triton_cache.py" unpack "$here/../.triton-cache" "$TRITON_CACHE_DIR" \
  || echo "triton cache: not unpacked" >&2
trap 'python3 "$here/triton_cache.py" pack "$TRITON_CACHE_DIR" "$out" || echo "triton cache: not packed" >&2' EXIT
case "${1:-}" in
  tests)  # 111 s at 17fb4ea on an H100, compiled cold (467 passed). -vv against gpu.sh's -q: a line a test as it
    # ends, so a log cut by a time limit still names the failures (at cc0ae4b one F came in a 95 s cut, unnamed)
    timeout 540 bash "$here/gpu.sh" tests -vv -n 8 --dist load --ignore tests/test_tp_collectives.py tests \
      > "$out/gpu-tests-$sha.log" 2>&1 || echo "gpu tests: exit $?" >&2
    tail -3 "$out/gpu-tests-$sha.log" ;;
  mps)  # 295 s at 170deed on an H100, every test passing (the TP 2, 4 and 8 engines, the captured loop)
    timeout 540 bash "$here/gpu.sh" mps tests tests/test_tp_collectives.py > "$out/gpu-tests-mps-$sha.log" 2>&1 \
      || echo "mps tests: exit $?" >&2
    tail -3 "$out/gpu-tests-mps-$sha.log" ;;
  qualify)  # with CANDIDATE="OP.FIELD=VALUE ..." set: that engine alone (no router fold), the candidate's TP 1 half
    # of its qualification without the candidate stage's round and context sweep; FOLD_ONLY=1: --router-fold alone
    optional_candidate
    folds=("" --router-fold)
    [ -z "$settings" ] || folds=("")
    [ "${FOLD_ONLY:-}" != 1 ] || folds=(--router-fold)  # the fold alone: both do not fit one call (1af897b)
    for fold in "${folds[@]}"; do
      name=qualify-mini-cuda-bf16${fold:+-router-fold}${tag:+-cand-$tag}-$sha
      gpu iquest qualify --model fixtures/iquest-q1-mini --device cuda --dtype bf16 --jobs 14 $fold --json \
        $setting_args > "$out/$name.json" 2> "$out/$name.log" || echo "$name: exit $?" >&2
      tail -2 "$out/$name.log"
    done ;;
  qualify2a|qualify2b)  # 10 and 11 units on 4 workers (QUALIFY_JOBS): at bc0ea27 10 units side by side (20 rank
    # processes on one GPU) finished 6 in 128 s and 4 never, and at 61d6ab7 6 workers stalled a unit; since a1dd992's
    # mend, 4 workers passed 9 controls in 181-248 s (cc0ae4b, 9c6eda1), 6 are not yet shown to
    controls="ring_exact_w drop_sink scalar_sink rope_shift_rows rope_double_dims rope_last_dims raw_residual
      open_causal_mask"
    [ "$1" = qualify2b ] && controls="keep_rejected_kv skip_redraft draft_target_embedding draft_window_4096
      mtp_router_shift router_bf16 fp8_scales_transposed top_p_drops_crossing replacement_from_p"
    # CANDIDATE (optional, as the candidate stage's): qualify a numerical candidate at TP 2 before it is the default
    optional_candidate
    name=qualify-mini-cuda-bf16-tp2-${1#qualify2}${tag:+-cand-$tag}-$sha
    timeout 570 bash "$here/gpu.sh" mps iquest qualify --tp 2 --device cuda --share-gpu --dtype bf16 \
      --jobs "${QUALIFY_JOBS:-4}" --stall-limit 400 --json $(printf -- '--control %s ' $controls) $setting_args \
      > "$out/$name.json" 2> "$out/$name.log" || echo "$name: exit $?" >&2
    tail -4 "$out/$name.log" ;;
  qualify2one)  # the healthy engine, lossless and each control named, on 2 workers
    name=qualify-mini-cuda-bf16-tp2-one-$sha
    timeout 570 bash "$here/gpu.sh" mps iquest qualify --tp 2 --device cuda --share-gpu --dtype bf16 --jobs 2 \
      --stall-limit 300 --json $(printf -- '--control %s ' ${QUALIFY_CONTROLS:-rope_shift_rows drop_sink}) \
      > "$out/$name.json" 2> "$out/$name.log" || echo "$name: exit $?" >&2
    tail -4 "$out/$name.log" ;;
  candidate)  # a numerical candidate in one call: qualified at TP 1 (every check, every control, with the candidate's
    # settings), paired in the round against the defaults, then swept from 1K to 512K. CANDIDATE="OP.FIELD=VALUE ..."
    # (fast/kernel_settings.py)
    candidate_settings
    name=qualify-mini-cuda-bf16-cand-$tag-$sha
    timeout 290 bash "$here/gpu.sh" iquest qualify --model fixtures/iquest-q1-mini --device cuda --dtype bf16 --jobs 14 \
      --json $setting_args > "$out/$name.json" 2> "$out/$name.log" \
      || echo "$name: exit $?" >&2
    tail -3 "$out/$name.log"
    # with more than one setting, each alone beside them all: a loss in one is not hidden by a gain in another
    singles=$(set -- $settings; [ $# -lt 2 ] || printf ',triton@%s' "$@")
    timeout 190 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
      --kernels "triton$singles,$variant" --out "$out/step-cand-$tag-ctx1k-d5-$sha.json" \
      > "$out/step-cand-$tag-ctx1k-d5-$sha.log" 2>&1 || echo "bench step: exit $?" >&2
    grep -E "against triton|differs at|/graph " "$out/step-cand-$tag-ctx1k-d5-$sha.log"
    # the candidate from 1K to 512K: at 17fb4ea the round paired at 1K only, and 32-slot tiles on full layers, faster
    # there, put the added context at 1.85x its KV bytes (1946ffa). Set against the default's sweep (the plan's rest)
    timeout 110 bash "$here/gpu.sh" bench context --kernels "$variant" --out "$out/context-cand-$tag-$sha.json" \
      > "$out/context-cand-$tag-$sha.log" 2>&1 || echo "bench context: exit $?" >&2
    tail -2 "$out/context-cand-$tag-$sha.log" ;;
  tunectx)  # the attention where the context sweep's excess sits (4K-16K, docs/PERF.md): each layer type's grid at
    # those lengths and at 1K beside them, an op a process, so a 1K-only choice is not taken for one that holds at 4K
    # (the draft's window, 512 slots, is full at all three: its 1K tune stands). TUNE_CONTEXTS and TUNE_OPS narrow it:
    # TUNE_CONTEXTS="131072 524160" TUNE_OPS=attention_full asks where the 512K row's excess sits (one layer's cache,
    # 268 MB at 512K, fits an H100, where the round's two engines at 512K do not)
    for ctx in ${TUNE_CONTEXTS:-1024 4096 16384}; do
      for op in ${TUNE_OPS:-attention_sliding attention_full}; do
        budget=${TUNE_BUDGET:-30}
        timeout $((budget + 30)) bash "$here/gpu.sh" bench tune --ops $op --context $ctx --budget $budget \
          --out "$out/tune-$op-ctx$ctx-$sha.json" > "$out/tune-$op-ctx$ctx-$sha.log" 2>&1 \
          || echo "tune $op $ctx: exit $?" >&2
        grep -E "^$op |Error" "$out/tune-$op-ctx$ctx-$sha.log" | cut -c1-150
      done
    done ;;
  stepctx)  # a candidate paired with the defaults at 4K and 16K (CANDIDATE="OP.FIELD=VALUE ..."): two context sweeps
    # are two calls, and at 9c6eda1 their 1K rounds differed by as much as the change under test
    candidate_settings
    for ctx in 4096 16384; do
      timeout 250 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
        --context $ctx --history synthetic --kernels "triton,$variant" \
        --out "$out/step-cand-$tag-ctx$ctx-d5-$sha.json" > "$out/step-cand-$tag-ctx$ctx-d5-$sha.log" 2>&1 \
        || echo "bench step $ctx: exit $?" >&2
      grep -E "against triton|differs at|identical" "$out/step-cand-$tag-ctx$ctx-d5-$sha.log"
    done ;;
  long)  # full layers' long splits with more tiles in flight (AttentionSettings.long_stages): the attention's GPU
    # cases (the same bits with it), then the op's grid at 128K and 512K, where a split is 8 and 31 tiles
    timeout 120 bash "$here/gpu.sh" tests -q tests/test_kernel_decode_attention.py \
      > "$out/gpu-tests-attention-$sha.log" 2>&1 || echo "attention tests: exit $?" >&2
    tail -3 "$out/gpu-tests-attention-$sha.log"
    TUNE_CONTEXTS="${TUNE_CONTEXTS:-131072 524160}" TUNE_OPS=attention_full TUNE_BUDGET=${TUNE_BUDGET:-100} \
      bash "$0" tunectx ;;
  pair512)  # the round at 512K, a candidate against the defaults (two engines at 512K fit an H200, not an H100)
    cand=${PAIR512:-triton@attention_full.long_stages=2}
    tag=$(file_tag "$cand")
    timeout 500 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 --context 524160 \
      --history synthetic --kernels "triton,$cand" \
      --out "$out/step-$tag-ctx524160-$sha.json" > "$out/step-$tag-ctx524160-$sha.log" 2>&1 \
      || echo "bench step 512K: exit $?" >&2
    grep -E "against triton|differs at|identical|OutOfMemory" "$out/step-$tag-ctx524160-$sha.log" ;;
  step|step2)  # at most three engines a process: seven did not finish their prefills and captures in 290 s (72c654b)
    kernels="triton,triton^qkv_rope,triton~route:38"
    [ "$1" = step2 ] && kernels=triton,triton@attention_sliding.num_stages=2@topk.tile=2048
    gpu bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 --kernels "$kernels" \
      --out "$out/$1-full-tp8slice-ctx1k-d5-$sha.json" 2>&1 | tee "$out/$1-full-tp8slice-ctx1k-d5-$sha.log" ;;
  downprod)  # Down's scales on the step's product (MoESettings.down_scale): its GPU cases, then the round paired at 1K
    # and at 38 experts (at a00e0a2 on an H100, the form capped against the weight form, then the default: 0.9870x and
    # 0.9841x; uncapped 0.9865x and 1.0012x, its kernel at 142 registers against 128)
    timeout 150 bash "$here/gpu.sh" tests -vv -k "down_product" tests/test_kernel_moe.py \
      > "$out/gpu-tests-downprod-$sha.log" 2>&1 || echo "gpu tests: exit $?" >&2
    tail -3 "$out/gpu-tests-downprod-$sha.log"
    weight=@moe.down_scale=weight uncapped=@moe.down_registers=None
    for arm in "ctx1k:triton,triton$weight,triton$uncapped" \
               "route38:triton~route:38,triton~route:38$weight,triton~route:38$uncapped"; do
      timeout 200 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
        --kernels "${arm#*:}" --out "$out/step-downprod-${arm%%:*}-d5-$sha.json" \
        > "$out/step-downprod-${arm%%:*}-d5-$sha.log" 2>&1 || echo "bench step ${arm%%:*}: exit $?" >&2
      grep -E "median round|against|differs at|identical" "$out/step-downprod-${arm%%:*}-d5-$sha.log"
    done ;;
  launch)  # the FP8 linears' weights straight into the MMA's registers (LinearSettings.direct, the o-projection's
    # default: 0.9628x paired at 1e8646c, 1.0345x turned off at 5bc518f, H100s) against its Triton kernel: the round
    # paired at 1K, then the engine's bits. (Gate/Up's tiles through tensor descriptors, paired here at 5bc518f:
    # 1.0162x, removed after 2034e14)
    # the pairing first: a call cut short by its limit still brings back the figure
    timeout 240 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
      --kernels triton,triton@o_proj.direct=False \
      --out "$out/step-launch-ctx1k-d5-$sha.json" > "$out/step-launch-ctx1k-d5-$sha.log" 2>&1 \
      || echo "bench step: exit $?" >&2
    grep -E -A3 "median round|against|differs at|identical|Error" "$out/step-launch-ctx1k-d5-$sha.log"
    # (the direct kernel's own GPU cases are in the `tests` stage's suite, unchanged since 362189d: 478 passed)
    timeout 200 bash "$here/gpu.sh" tests -vv -k "cuda_direct" tests/test_fast_kernels.py \
      > "$out/gpu-tests-launch-$sha.log" 2>&1 || echo "gpu tests: exit $?" >&2
    grep -E "FAILED|ERROR" "$out/gpu-tests-launch-$sha.log" | cut -c1-160 || true  # none found is the good case
    tail -2 "$out/gpu-tests-launch-$sha.log" ;;
  branch)  # the expert prefetch's branch stream (e884b73): its GPU tests three times, then the pooled-stream control
    # (lab/branch_stream_control.py: the test must fail with the branch's stream pooled; then the captured loop with
    # the branch on the capture stream, in a process of its own, since a fault ends it)
    for i in $(seq "${REPEATS:-3}"); do
      timeout 150 bash "$here/gpu.sh" tests -vv tests/test_expert_prefetch.py \
        > "$out/gpu-tests-prefetch-$i-$sha.log" 2>&1 || echo "gpu tests $i: exit $?" >&2
      tail -1 "$out/gpu-tests-prefetch-$i-$sha.log"
    done
    mkdir -p /tmp/pkg && ln -sfn "$(cd "$here/.." && pwd)" /tmp/pkg/iquest
    for mode in check crash; do
      PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 -m iquest.lab.branch_stream_control $mode \
        >> "$out/branch-stream-control-$sha.log" 2>&1 && rc=0 || rc=$?  # 139: a segmentation fault
      echo "control $mode: exit $rc" | tee -a "$out/branch-stream-control-$sha.log"
    done
    grep -E "control|branch on|captured loop|Segmentation|Error" "$out/branch-stream-control-$sha.log" | cut -c1-200 ;;
  prefetch)
    for d in 3 4; do
      gpu bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 --drafts $d \
        --kernels triton,triton+expert_prefetch \
        --out "$out/step-full-tp8slice-ctx1k-d$d-prefetch-$sha.json" 2>&1 | tail -25 \
        | tee "$out/step-full-tp8slice-ctx1k-d$d-prefetch-$sha.log"
    done ;;
  tune)  # one budget a part, spent in that order, so that one call returns what it reached; an op a process, since a
    # candidate's illegal memory access ends its process (at 1946ffa one of attention_full's took the ops after it)
    gpu bench tune --ops moe --distinct 38 --only gate_up_split=1,gate_up_split=2,gate_up_split=8,gate_up_stages=6 \
      --budget 100 --out "$out/tune-moe38-$sha.json" 2>&1 | tee "$out/tune-moe38-$sha.log" | tail -8
    for op in attention_full attention_sliding router add_norm topk lm_head o_proj_router; do
      timeout 60 bash "$here/gpu.sh" bench tune --ops $op --budget 30 --out "$out/tune-$op-$sha.json" \
        > "$out/tune-$op-$sha.log" 2>&1 || echo "tune $op: exit $?" >&2
      grep -E "^$op |Error" "$out/tune-$op-$sha.log" | cut -c1-150
    done ;;
  fold)
    timeout 120 bash "$here/gpu.sh" bench tune --ops o_proj_router,add_norm_route --budget 60 \
      --out "$out/tune-fold-$sha.json" > "$out/tune-fold-$sha.log" 2>&1 || echo "tune: exit $?" >&2
    tail -14 "$out/tune-fold-$sha.log"
    gpu bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
      --kernels triton,triton+router_fold,triton+router_fold@o_proj_router.block_e=16 \
      --out "$out/step-fold-ctx1k-d5-$sha.json" 2>&1 | tee "$out/step-fold-ctx1k-d5-$sha.log" | tail -40 ;;
  ncu)  # --clock-control none: the clocks stay the machine's (METHOD.md); a process tree (bash, then python). Ops alone
    # (the tune's calls): at 170deed ncu failed to profile a kernel inside bench step's round at the published
    # dimensions and hung to its limit, so no stage profiles the round
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    prof() {  # prof NAME KERNELS LIMIT COMMAND...: launches 40..43 of KERNELS, with each stall reason's share
      local name=$1 kernels=$2 limit=$3
      shift 3
      timeout "$limit" "$ncu" --clock-control none --target-processes all -k "regex:$kernels" -s 40 -c 4 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --csv --page details \
        --log-file "$out/ncu-$name-$sha.csv" "$@" > "$out/ncu-$name-$sha.log" 2>&1 || echo "ncu $name: exit $?" >&2
      tail -3 "$out/ncu-$name-$sha.log"
    }
    prof o-proj-router _o_proj_router_kernel 120 bash "$here/gpu.sh" bench tune --ops o_proj_router --only block_e=16 \
      --budget 20
    prof qkv-rope-kv _qkv_rope_kv_kernel 90 bash "$here/gpu.sh" bench tune --ops qkv_rope_kv --budget 15
    prof linear-o _fp8_linear_kernel 90 bash "$here/gpu.sh" bench tune --ops linear_o --budget 15 ;;
  ncumoe)  # Gate/Up and Down alone at the decode routing (9 experts), the full section set with source counters: each
    # SASS line's stall reasons (--page source), the question after owners first (8ea3bc4) left the churn out
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    for k in _gate_up_kernel _down_kernel; do
      timeout 200 "$ncu" --clock-control none --target-processes all -k "regex:^$k\$" -s 40 -c 1 --set full \
        --import-source yes -o "/tmp/ncu$k" bash "$here/gpu.sh" bench tune --ops moe --distinct 9 \
        --only down_prefetch=False --budget 20 > "$out/ncu-moe$k-$sha.log" 2>&1 || echo "ncu $k: exit $?" >&2
      "$ncu" -i "/tmp/ncu$k.ncu-rep" --page details --csv > "$out/ncu-moe$k-details-$sha.csv" 2>&1 || true
      "$ncu" -i "/tmp/ncu$k.ncu-rep" --page source --csv --print-source sass > "$out/ncu-moe$k-source-$sha.csv" 2>&1 \
        || true
      grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$out/ncu-moe$k-details-$sha.csv" | head -6
    done ;;
  trace)
    gpu bench graph-trace --kernels triton,triton+router_fold,triton+down_tail,triton^moe_combine,triton^qkv_rope \
      --out "$out/graph-trace-$sha.json" 2>&1 | tee "$out/graph-trace-$sha.log" ;;
  folds7)  # the step target (<= 7 a layer) asks which form reaches it and at what cost in the round (at 1af897b on an
    # H100: 7 steps, 1.3191x the round; docs/PERF.md)
    both=triton+router_fold+down_tail
    timeout 240 bash "$here/gpu.sh" bench graph-trace --kernels "triton,$both" --out "$out/graph-trace-folds7-$sha.json" \
      > "$out/graph-trace-folds7-$sha.log" 2>&1 || echo "graph-trace: exit $?" >&2
    grep -iE "median|steps|replay" "$out/graph-trace-folds7-$sha.log" | head -12
    timeout 300 bash "$here/gpu.sh" bench step --config configs/iquest-q1.json --tp-slice 8 --repeats 5 \
      --kernels "triton,$both,triton+router_fold" --out "$out/step-folds7-ctx1k-d5-$sha.json" \
      > "$out/step-folds7-ctx1k-d5-$sha.log" 2>&1 || echo "bench step: exit $?" >&2
    grep -E "against triton|differs at|identical" "$out/step-folds7-ctx1k-d5-$sha.log" ;;
  agent)  # the server's packages the image lacks, from the wheels beside ci/ (ci/device_wheels.sh)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$here"/../.whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    gpu bench agent --device cuda --compare --out "$out/agent-cuda-$sha.json" > "$out/agent-cuda-$sha.log" 2>&1 \
      || echo "bench agent: exit $?" >&2
    tail -30 "$out/agent-cuda-$sha.log" ;;
  depthprobe)  # a lab module: the package link ci/gpu.sh makes
    mkdir -p /tmp/pkg && ln -sfn "$(cd "$here/.." && pwd)" /tmp/pkg/iquest
    PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} timeout 500 python3 -m iquest.lab.depth_probe.gpu_bench 16 64 3 \
      > "$out/depth-probe-$sha.log" 2>&1 || echo "depth probe: exit $?" >&2
    tail -30 "$out/depth-probe-$sha.log" ;;
  foldbranch)  # lab/fold_branch.py: the fold's two terms on a side stream (A = W' r, B = F a) and the tail at T = 1,
    # against the default chain and today's fold, the attention to the experts' choice captured and paired
    mkdir -p /tmp/pkg && ln -sfn "$(cd "$here/.." && pwd)" /tmp/pkg/iquest
    PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} timeout 300 python3 -m iquest.lab.fold_branch \
      --out "$out/fold-branch-$sha.json" > "$out/fold-branch-$sha.log" 2>&1 || echo "fold branch: exit $?" >&2
    tail -8 "$out/fold-branch-$sha.log" ;;
  ctxpin)  # the sweep's premise (only the KV read grows) against its experts column (13.9 distinct a main layer at
    # 1K, 19.5 at 512K on the H200 at 3d54963): the same lengths with the routing pinned at 14 distinct experts (the
    # router still runs; lab/ablation.py), so the added round is the added context's alone, beside the default sweep
    for kernels in triton triton~route:14; do
      tag=$(file_tag "$kernels")
      timeout 280 bash "$here/gpu.sh" bench context --contexts "${CONTEXTS:-1024,524160}" --kernels "$kernels" \
        --out "$out/context-$tag-$sha.json" > "$out/context-$tag-$sha.log" 2>&1 || echo "bench context: exit $?" >&2
      tail -5 "$out/context-$tag-$sha.log"
    done ;;
  context|rest)  # whole logs under $OUT: a cut run still returns where it stopped
    timeout 400 bash "$here/gpu.sh" bench context ${CONTEXTS:+--contexts "$CONTEXTS"} \
      --out "$out/context-tp8slice-$sha.json" > "$out/context-tp8slice-$sha.log" 2>&1 || echo "bench context: exit $?" >&2
    tail -20 "$out/context-tp8slice-$sha.log"
    [ "$1" = context ] && exit 0
    gpu bench depth --device cuda --prompts 16 --tokens 64 --repeats 5 --out "$out/depth-mini-cuda-$sha.json" \
      > "$out/depth-mini-cuda-$sha.log" 2>&1 || echo "bench depth: exit $?" >&2
    tail -8 "$out/depth-mini-cuda-$sha.log" ;;
  *) echo "usage: IQUEST_COMMIT=<sha> bash ci/gpu_plan.sh STAGE (tests|mps|qualify|qualify2a|qualify2b|qualify2one|"\
"candidate|tunectx|stepctx|long|pair512|step|step2|downprod|launch|branch|prefetch|tune|fold|ncu|ncumoe|trace|folds7|"\
"agent|depthprobe|foldbranch|ctxpin|context|rest)" >&2
     exit 2 ;;
esac

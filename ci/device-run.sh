# device call 1 (nvidia-h200): kernel GPU tests + qualify side by side (correctness, not timings), then the mini bench alone
C=$1
nvidia-smi --query-gpu=name,memory.used --format=csv
( timeout 400 bash ci/gpu.sh iquest qualify --device cuda --dtype bf16 --kernels triton --jobs 12 --json $OUT/qualify-mini-cuda-bf16-triton.json > $OUT/qualify.log 2>&1; echo "qualify rc=$?" >> $OUT/qualify.log ) &
sleep 15
timeout 300 bash ci/gpu.sh tests tests/test_kernel_moe.py tests/test_kernel_topk.py tests/test_kernel_sample.py tests/test_fast_kernels.py > /dev/null 2>&1; echo "tests rc=$?" >> $OUT/gpu-tests.log
wait
IQUEST_COMMIT=$C timeout 140 bash ci/gpu.sh bench step --model fixtures/iquest-q1-mini --context 1024 --drafts 5 --repeats 8 --kernels torch,triton --out $OUT/step-mini-kernels-all-d5.json > $OUT/mini.log 2>&1; echo "mini rc=$?" >> $OUT/mini.log
tail -4 $OUT/*.log

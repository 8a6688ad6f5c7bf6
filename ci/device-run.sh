# device call 3 (nvidia-h200-x2): GPU0 qualify (triton kernels, bf16) then the full-size rank slice (timings);
# GPU1 qualify (torch fallback, bf16) then the GPU tests of the engine with kernels
C=$1
nvidia-smi --query-gpu=name,memory.used --format=csv
( export CUDA_VISIBLE_DEVICES=0 IQUEST_COMMIT=$C
  timeout 290 bash ci/gpu.sh iquest qualify --device cuda --dtype bf16 --kernels triton --jobs 11 --json $OUT/qualify-mini-cuda-bf16-triton.json > $OUT/qualify-triton.log 2>&1; echo "qualify rc=$?" >> $OUT/qualify-triton.log
  timeout 230 bash ci/gpu.sh bench step --config configs/iquest-q1.json --tp-slice 8 --context 1024 --drafts 5 --repeats 5 --kernels triton,torch --out $OUT/step-full-tp8slice-ctx1k-d5.json > $OUT/full.log 2>&1; echo "full rc=$?" >> $OUT/full.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 290 bash ci/gpu.sh iquest qualify --device cuda --dtype bf16 --kernels torch --jobs 11 --json $OUT/qualify-mini-cuda-bf16-torch.json > $OUT/qualify-torch.log 2>&1; echo "qualify rc=$?" >> $OUT/qualify-torch.log
  timeout 200 bash ci/gpu.sh tests tests/test_fast_kernels.py tests/test_fast_gpu.py > /dev/null 2>&1; echo "tests rc=$?" >> $OUT/gpu-tests.log ) &
wait
for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done

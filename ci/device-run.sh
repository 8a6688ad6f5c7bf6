# device call 2 (nvidia-h200-x2): two-GPU all-reduce first (alone), then GPU0: full-size rank slice and the mini
# bench (timings); GPU1 at the same time: qualify and GPU tests (correctness, separate device)
C=$1
nvidia-smi --query-gpu=name,memory.used --format=csv
IQUEST_COMMIT=$C timeout 75 bash ci/gpu.sh bench allreduce --ranks 2 --out $OUT/allreduce-x2.json > $OUT/allreduce.log 2>&1; echo "allreduce rc=$?" >> $OUT/allreduce.log
( export CUDA_VISIBLE_DEVICES=0 IQUEST_COMMIT=$C
  timeout 330 bash ci/gpu.sh bench step --config configs/iquest-q1.json --tp-slice 8 --context 1024 --drafts 5 --repeats 5 --kernels triton,torch --out $OUT/step-full-tp8slice-ctx1k-d5.json > $OUT/full.log 2>&1; echo "full rc=$?" >> $OUT/full.log
  timeout 110 bash ci/gpu.sh bench step --model fixtures/iquest-q1-mini --context 1024 --drafts 5 --repeats 8 --kernels torch,triton --out $OUT/step-mini-kernels-all-d5.json > $OUT/mini.log 2>&1; echo "mini rc=$?" >> $OUT/mini.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 380 bash ci/gpu.sh iquest qualify --device cuda --dtype bf16 --kernels triton --jobs 12 --json $OUT/qualify-mini-cuda-bf16-triton.json > $OUT/qualify.log 2>&1; echo "qualify rc=$?" >> $OUT/qualify.log
  timeout 60 bash ci/gpu.sh tests tests/test_fast_kernels.py > /dev/null 2>&1; echo "tests rc=$?" >> $OUT/gpu-tests.log ) &
wait
for f in $OUT/*.log; do echo "== $f"; tail -n 4 $f; done

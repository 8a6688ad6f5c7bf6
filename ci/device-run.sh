# device call 4 (nvidia-h200-x2): GPU0 qualify torch/bf16 (ring_exact_w control only, after its intended classes
# gained the MTP ring's depth-1 rows); GPU1 qualify triton/fp32 (every check and control)
C=$1
( export CUDA_VISIBLE_DEVICES=0
  timeout 215 bash ci/gpu.sh iquest qualify --device cuda --dtype bf16 --kernels torch --control ring_exact_w --jobs 3 --json $OUT/qualify-mini-cuda-bf16-torch-ring.json > $OUT/qualify-torch-ring.log 2>&1; echo "qualify rc=$?" >> $OUT/qualify-torch-ring.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 215 bash ci/gpu.sh iquest qualify --device cuda --dtype fp32 --kernels triton --jobs 11 --json $OUT/qualify-mini-cuda-fp32-triton.json > $OUT/qualify-triton-fp32.log 2>&1; echo "qualify rc=$?" >> $OUT/qualify-triton-fp32.log ) &
wait
for f in $OUT/*.log; do echo "== $f"; tail -n 14 $f; done

#!/usr/bin/env bash
# Session 5, call A (carry .whl + .snap): install, unpack the committed tree, GPU tests of the fused
# split-K merge and the chunked argmax, then decode replays with the fused merge on (default) / off.
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader 2>/dev/null
stamp tests
timeout 200 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_flash_decode_gpu.py \
    tests/gpu/test_kernels_gpu.py tests/gpu/test_spec_drafters_gpu.py -k "vs_paged or argmax or drafter" > $OUT/tests_a.txt 2>&1
grep -E "passed|failed|^E  |^FAILED" $OUT/tests_a.txt | cut -c1-250 | tail -10
timeout 150 python3 -m pytest -q -m gpu -p no:warnings -x tests/gpu/test_cuda_backend_gpu.py tests/gpu/test_fused_gemv_gpu.py \
    > $OUT/tests_b.txt 2>&1
grep -E "passed|failed|^E  |^FAILED" $OUT/tests_b.txt | cut -c1-250 | tail -10
stamp replays
for fm in true false; do
  echo "--- decode_attention_fused_merge=$fm"
  ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.decode_attention_fused_merge=$fm"
  ab --model smollm2-135m-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.decode_attention_fused_merge=$fm"
  ab --model llama-3.2-1b-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.decode_attention_fused_merge=$fm"
done
stamp done

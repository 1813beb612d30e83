#!/usr/bin/env bash
# Session 16, call 3 (carry .whl .snap; ~6 minutes): sliding-window attention on CUDA (issue 20):
# the window GPU tests and the attention kernels' own GPU tests (nothing else may regress), then
# Engine.generate on the Gemma 3 270M shape and the 8B shape (its replay beside this morning's).
source "$(dirname "$0")/common.sh"
stamp "window tests"
gpu_tests window 240 tests/gpu/test_conformance_gpu.py tests/gpu/test_gemma_gpu.py tests/gpu/test_flash_decode_gpu.py \
    tests/gpu/test_flash_prefill_gpu.py
for m in gemma3-270m-shape llama-3-8b-shape; do
  stamp $m
  timeout 170 python3 -m bench.user_decode --model $m --batch 1 32 --json $OUT/user_$m.json 2>&1 | grep -E "user_decode|Error"
done
stamp done

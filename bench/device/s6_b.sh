#!/usr/bin/env bash
# Session 6, call 1 of 4 (carry .whl + .snap): the PDL trigger modes A/B (levers.pdl_trigger early |
# late | exit; late = a trigger after each kernel's main loop, new this session) on the batch-1
# steps and 8B batch 32, after the GPU tests of the kernels it touches. Calls 2-4: the speculation
# run, `REPS=10 bash bench/device/s6_spec.sh` with carries .m1, .m2, .m3.
source "$(dirname "$0")/common.sh"
stamp tests
gpu_tests s6b 240 tests/gpu/test_fused_gemv_gpu.py tests/gpu/test_pdl_gpu.py \
    -k "fused_decode or reproducible or glu or trigger_mode"
stamp replays
for mode in exit late early; do
  echo "--- pdl_trigger=$mode"
  ab --model smollm2-135m-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.pdl_trigger=$mode"
  ab --model llama-3.2-1b-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.pdl_trigger=$mode"
  ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.pdl_trigger=$mode"
done
stamp done

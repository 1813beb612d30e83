#!/usr/bin/env bash
# Session 7: the loop a step ahead on the H200 (carry .whl + .snap: the committed tree without assets).
# GPU test of the fed embedding, Engine.generate ahead / synchronous beside graph replay for the three
# shapes at batch 1 and 32, the served path after the HTTP fixes, then the RoPE / backend GPU tests.
source "$(dirname "$0")/common.sh"
stamp "overlap GPU test"
gpu_tests s7e_overlap 120 tests/gpu/test_overlap_gpu.py
for m in ${MODELS:-smollm2-135m-shape llama-3.2-1b-shape llama-3-8b-shape}; do
  stamp "user decode $m"
  timeout 200 python3 -m bench.user_decode --model $m --batch 1 32 --json $OUT/user_$m.json 2>&1 \
      | grep -E "user_decode|Error|error" | cut -c1-250
done
stamp "served, SmolLM2 shape"
MODEL=smollm2-135m-shape bash bench/device/s7_b.sh 2>&1 | grep -E "clients|tok/s|ITL|TTFT|polls" | head -12
stamp "backend GPU tests"
gpu_tests s7e_backend ${TEST_LIMIT:-150} tests/gpu/test_cuda_backend_gpu.py tests/gpu/test_kernels_gpu.py
stamp done

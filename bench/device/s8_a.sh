#!/usr/bin/env bash
# Session 8, first call (carry .whl .snap): the engine split and the on-disk kernel cache on the H200.
# Start-up first/again (1B shape), the GPU tests the split touches, Engine.generate beside replay.
source "$(dirname "$0")/common.sh"
stamp "startup 1B shape, fresh kernel cache then again"
timeout 200 python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --json $OUT/startup_1b.json 2>&1 | tail -4
stamp "gpu tests"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_overlap_gpu.py tests/gpu/test_cuda_backend_gpu.py \
    tests/gpu/test_hybrid_gpu.py tests/test_sampling_gpu.py tests/gpu/test_spec_drafters_gpu.py 2>&1 | tail -6
stamp "user decode, SmolLM2 + 1B shapes"
for m in smollm2-135m-shape llama-3.2-1b-shape; do
  timeout 120 python3 -m bench.user_decode --model $m --batch 1 32 --json $OUT/user_$m.json 2>&1 | grep user_decode
done
stamp done

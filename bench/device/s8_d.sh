#!/usr/bin/env bash
# Session 8, fourth call (carry .whl .snap): the GPU tests of the refactor (one backend per device,
# engine split, sampled rows ahead), then Engine.generate beside graph replay for the three shapes
# (sampled rows too), offline serving.
source "$(dirname "$0")/common.sh"
stamp "gpu tests"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_cuda_backend_gpu.py tests/gpu/test_hybrid_gpu.py \
    tests/gpu/test_deepseek_gpu.py tests/gpu/test_mixed_graphs_gpu.py tests/gpu/test_overlap_gpu.py tests/test_sampling_gpu.py \
    tests/gpu/test_conformance_gpu.py tests/gpu/test_rope_scaling_gpu.py tests/gpu/test_cuda_runtime_gpu.py 2>&1 | tee $OUT/gpu_tests.txt | grep -E "passed|failed|^FAILED|^ERROR" | head -30
stamp "user decode"
for m in smollm2-135m-shape llama-3.2-1b-shape llama-3-8b-shape; do
  timeout 150 python3 -m bench.user_decode --model $m --batch 1 32 --sampled --json $OUT/user_$m.json 2>&1 | grep -E "user_decode|Error"
done
stamp "offline"
timeout 150 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape 2>&1 | grep -E "^\[offline\]"
stamp done

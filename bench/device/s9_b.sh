#!/usr/bin/env bash
# Session 9's changes on the H200, one call (carry .whl .snap; ~8 minutes): the GPU tests they added
# or touch (short prefills through the decode graphs and the mixed buckets, the sampling graphs,
# overlap, the backend, conformance), then Engine.generate beside replay for the three shapes
# (greedy and sampled) and the offline run (the host loop's O(batch) cut), all in one lease.
source "$(dirname "$0")/common.sh"
stamp "gpu tests"
gpu_tests s9 300 tests/gpu/test_mixed_graphs_gpu.py tests/test_sampling_gpu.py tests/gpu/test_overlap_gpu.py \
    tests/gpu/test_cuda_backend_gpu.py tests/gpu/test_conformance_gpu.py
stamp "user decode"
for m in smollm2-135m-shape llama-3.2-1b-shape llama-3-8b-shape; do
  timeout 150 python3 -m bench.user_decode --model $m --batch 1 32 --sampled --json $OUT/user_$m.json 2>&1 | grep -E "user_decode|Error"
done
stamp "offline"
timeout 200 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape \
    2>&1 | grep -E "^\[offline\]|Error"
stamp done

#!/usr/bin/env bash
# Session 13, one call (carry .whl .snap): penalized rows a step ahead: the overlap GPU tests (overlap on
# = off with penalties), the sampling GPU tests, Engine.generate sampled / penalized beside greedy on
# two shapes. ~4 minutes.
source "$(dirname "$0")/common.sh"
stamp "GPU tests: overlap, sampling"
gpu_tests pen 200 tests/gpu/test_overlap_gpu.py tests/test_sampling_gpu.py
for m in smollm2-135m-shape llama-3.2-1b-shape; do
  stamp "user_decode $m"
  timeout 100 python3 -m bench.user_decode --model $m --batch 1 32 --sampled --json $OUT/user_$m.json 2>&1 | grep user_decode
done
stamp done

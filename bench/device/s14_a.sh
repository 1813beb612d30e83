#!/usr/bin/env bash
# Session 14, one call (carry .whl .snap; ~300 s of device time left): penalized rows a step ahead on
# the GPU (overlap on = off with penalties; the device sampler pipeline and its captured form), then
# Engine.generate greedy / sampled / penalized on the 1B shape.
source "$(dirname "$0")/common.sh"
stamp "GPU tests: overlap, sampling pipeline"
gpu_tests pen 150 tests/gpu/test_overlap_gpu.py tests/test_sampling_gpu.py -k "overlap or penalized or greedy or pipeline or captured"
stamp "user_decode llama-3.2-1b-shape"
timeout 100 python3 -m bench.user_decode --model llama-3.2-1b-shape --batch 1 32 --sampled --json $OUT/user_1b.json 2>&1 | grep user_decode
stamp done

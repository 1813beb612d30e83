#!/usr/bin/env bash
# Session 16, call 7 (carry .whl .snap; ~3 minutes): the RoPE scalings on CUDA (issue 20's cases on
# the H200) and Engine.generate on the SmolLM2 shape (the third shape of this session's table).
source "$(dirname "$0")/common.sh"
stamp "rope tests"
gpu_tests rope 120 tests/gpu/test_rope_scaling_gpu.py
stamp smollm2
timeout 100 python3 -m bench.user_decode --model smollm2-135m-shape --batch 1 32 --json $OUT/user_smollm2.json 2>&1 \
    | grep -E "user_decode|Error"
stamp done

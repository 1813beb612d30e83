#!/usr/bin/env bash
# Session 16, call 4 (carry .whl .snap; ~4 minutes): Gemma 3 with the host a step ahead (its fed
# embedding): the overlap GPU tests on the SmolLM2 and Gemma 3 270M shapes, then Engine.generate on
# the Gemma shape (ahead and synchronous beside replay; the bench now fails a point whose requests error).
source "$(dirname "$0")/common.sh"
stamp "overlap tests"
gpu_tests overlap 240 tests/gpu/test_overlap_gpu.py
stamp gemma3-270m-shape
timeout 170 python3 -m bench.user_decode --model gemma3-270m-shape --batch 1 32 --json $OUT/user_gemma.json 2>&1 \
    | grep -E "user_decode|Error" | tail -4
stamp done

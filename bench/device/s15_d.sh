#!/usr/bin/env bash
# Session 15, call 4 (carry .whl .snap; ~2 minutes): the families new on CUDA (issue 20): Qwen3-MoE,
# Qwen3-Next with MoE layers, Gemma 3, each against its NumPy twin; the tiny-dim refusals.
source "$(dirname "$0")/common.sh"
stamp "families on CUDA"
gpu_tests families 125 tests/gpu/test_moe_gpu.py tests/gpu/test_gemma_gpu.py tests/gpu/test_conformance_gpu.py -k "not window_smaller and not inside_the_window and not deepseek"
stamp done

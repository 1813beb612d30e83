#!/usr/bin/env bash
# Session 15, call 3 (carry .whl .snap; ~4 minutes): gemv_mq's warps by shape at one n-tile only
# (s15_b: 16 warps of 8 n-tiles out of registers at T = 40; batch 16 slower than with 8 warps), its
# GPU tests, Qwen3-MoE's CUDA part, and the 8B step native (batch 1 to 64) beside bf16 in the same lease.
source "$(dirname "$0")/common.sh"
stamp "kernel GPU tests (fragment layout at the 8B shapes)"
gpu_tests quant_fragments 120 tests/gpu/test_quant_gpu.py -k "fragment"
stamp "Qwen3-MoE on CUDA (runtime/cuda_moe.py) against NumPy"
gpu_tests moe 100 tests/gpu/test_moe_gpu.py tests/gpu/test_conformance_gpu.py -k "moe or refused"
stamp "quant_decode native"
timeout 130 python3 -m bench.quant_decode --weights native --batch 1 2 8 16 32 64 \
    > $OUT/quant_decode.txt 2>&1; grep -E "tok/s|Error" $OUT/quant_decode.txt | tail -6
stamp "quant_decode bf16"
timeout 100 python3 -m bench.quant_decode --weights bf16 --batch 1 8 32 \
    > $OUT/quant_decode_bf16.txt 2>&1; grep -E "tok/s|Error" $OUT/quant_decode_bf16.txt | tail -6
stamp done

#!/usr/bin/env bash
# Session 13, one call (carry .whl .snap): the fragment layout end to end: GPU tests (kernels, quant_linear
# on the three roads, the native backend with levers.quant_mma_rows=1 and 2), the 8B native decode at
# B 1-64 with quant_mma_rows 1 (every Q4_K / Q6_K product of up to 64 rows on the tensor cores), bf16 B 16-64. ~6 minutes.
source "$(dirname "$0")/common.sh"
stamp "GPU tests"
gpu_tests quant 300 tests/gpu/test_quant_gpu.py -k "mma or many_rows" tests/gpu/test_quant_backend_gpu.py
METRALE_TEST_QUANT_MMA_ROWS=1 gpu_tests quant_backend_mq 200 tests/gpu/test_quant_backend_gpu.py
stamp "quant_decode native, quant_mma_rows=1, and bf16"
timeout 150 python3 -m bench.quant_decode --weights native --batch 1 2 8 16 32 64 --override levers.quant_mma_rows=1 \
    > $OUT/quant_decode_mq.txt 2>&1
grep -E "^decode|weights=|Error" $OUT/quant_decode_mq.txt | cut -c1-200
timeout 120 python3 -m bench.quant_decode --weights bf16 --batch 16 32 64 > $OUT/quant_decode_bf16_big.txt 2>&1
grep -E "^decode|Error" $OUT/quant_decode_bf16_big.txt | cut -c1-200
stamp done

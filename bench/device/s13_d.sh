#!/usr/bin/env bash
# Session 13, one call (carry .whl .snap): the fragment layout end to end: GPU tests (kernels, quant_linear
# on the three roads, the native backend with levers.quant_mma_rows=1 and 2), the 8B native decode at
# B 1 2 4 8 with quant_mma_rows 1 (every Q4_K product on the tensor cores, fragment layout). ~5 minutes.
source "$(dirname "$0")/common.sh"
stamp "GPU tests"
gpu_tests quant 300 tests/gpu/test_quant_gpu.py -k "mma or many_rows" tests/gpu/test_quant_backend_gpu.py
METRALE_TEST_QUANT_MMA_ROWS=1 gpu_tests quant_backend_mq 200 tests/gpu/test_quant_backend_gpu.py
stamp "quant_decode native, quant_mma_rows=1"
timeout 150 python3 -m bench.quant_decode --weights native --batch 1 2 4 8 --override levers.quant_mma_rows=1 \
    > $OUT/quant_decode_mq.txt 2>&1
grep -E "^decode|weights=|Error" $OUT/quant_decode_mq.txt | cut -c1-200
stamp done

#!/usr/bin/env bash
# Session 13, one call (carry .whl .snap): the Q4_K tensor-core GEMV (kernels_numba/quant_mma.py):
# its GPU tests and the native backend's, kernel times at 1-8 rows beside the dp4a GEMV for three
# block sizes, then the 8B native decode step with levers.quant_mma_rows 2 (default) and 1. ~6 minutes.
source "$(dirname "$0")/common.sh"
stamp "GPU tests: mma GEMV, native backend"
gpu_tests mma 240 tests/gpu/test_quant_gpu.py -k "mma" tests/gpu/test_quant_backend_gpu.py
stamp "quant kernels Q4_K/Q6_K, rows 1 2 4 8, mma W 4 8 16"
timeout 200 python3 -m bench.quant_kernels --types Q4_K --rows 1,2,4,8 --no-torch --precompile 14 \
    --json $OUT/quant_kernels_mma.json > $OUT/quant_kernels_mma.txt 2>&1
grep -E "Q4_K|Error|error" $OUT/quant_kernels_mma.txt | cut -c1-170 | head -70
for r in 2 1; do
  stamp "quant_decode native, quant_mma_rows=$r"
  timeout 150 python3 -m bench.quant_decode --weights native --batch 1 2 4 8 --override levers.quant_mma_rows=$r \
      > $OUT/quant_decode_mma$r.txt 2>&1
  grep -E "^decode|weights=|Error" $OUT/quant_decode_mma$r.txt | cut -c1-200
done
stamp done

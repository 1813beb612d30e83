#!/usr/bin/env bash
# Session 15, one call (carry .whl .snap; ~8 minutes): the fragment layout at one row after the Q6_K
# lm_head went back to dp4a there (PLANES_MMA_MIN_ROWS) and the norm / activation quantize x in their
# own launch (norm_quantize_x, silu_quantize_x), beside the default; the per-kernel times of
# every 8B shape at 1 and 8 rows (o, down and the Q6_K lm_head were never timed in the fragment
# layout / planes mma); the native GPU tests with the fragment layout (timed out at 200 s in s13_cd).
source "$(dirname "$0")/common.sh"
stamp "quant_decode native, quant_mma_rows 2 vs 1"
for r in 2 1; do
  timeout 150 python3 -m bench.quant_decode --weights native --batch 1 2 8 16 --override levers.quant_mma_rows=$r \
      > $OUT/quant_decode_mma$r.txt 2>&1; grep -E "tok/s|Error" $OUT/quant_decode_mma$r.txt | tail -5
done
stamp "quant_kernels: Q4_K and Q6_K, all shapes, 1 and 8 rows"
timeout 150 python3 -m bench.quant_kernels --types Q4_K,Q6_K --rows 1,8 --no-torch --mma-warps 8:2:2 \
    > $OUT/quant_kernels.txt 2>&1; grep -E "mma|dp4a|Error" $OUT/quant_kernels.txt | cut -c1-170 | tail -40
stamp "GPU tests, fragment layout"
METRALE_TEST_QUANT_MMA_ROWS=1 gpu_tests quant_mq 200 tests/gpu/test_quant_backend_gpu.py tests/gpu/test_quant_gpu.py
stamp done

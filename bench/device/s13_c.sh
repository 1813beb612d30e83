#!/usr/bin/env bash
# Session 13, one call (carry .whl .snap): variants of the Q4_K tensor-core GEMV on the planes (warps, 16-row
# tiles a warp, launch-bound blocks) and on the fragment layout (quant_mma.repack_mq) at 1 and 8 rows on the 8B shapes, the quantize launch alone,
# and Q6_K's dp4a GEMV at 8 rows (the lm_head of a Q4_K_M file). ~3 minutes.
source "$(dirname "$0")/common.sh"
stamp "mma variants"
timeout 300 python3 -m bench.quant_kernels --types Q4_K,Q6_K --rows 1,8 --no-torch --precompile 14 \
    --mma-warps 4,8,8:1:4,8:2:2 --json $OUT/quant_mma_variants.json > $OUT/quant_mma_variants.txt 2>&1
grep -E "Q4_K|Q6_K|layout|Error|error" $OUT/quant_mma_variants.txt | grep -v "bf16 gemm" | cut -c1-190 | head -80
stamp done

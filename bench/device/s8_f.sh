#!/usr/bin/env bash
# Session 8, last call (carry .whl .snap): the served path in both modes beside the library
# (bench/device/s8_serve.sh, 128-token streams), then the quantized GEMVs at batch 1 on the 8B
# shapes for Q4_K / Q6_K / Q8_0 beside the bf16 GEMV (a subset of bench/device/quant.sh).
source "$(dirname "$0")/common.sh"
TOKENS=128 timeout 200 bash bench/device/s8_serve.sh 2>&1 | grep -vE "^\s*$" | tail -22
stamp "quant GEMV subset"
timeout 110 python3 -m bench.quant_kernels --types Q4_K,Q6_K,Q8_0 --rows 1 --shapes gate_up,down,lm_head --no-torch \
    --precompile 15 --json $OUT/quant_subset.json > $OUT/quant_subset.txt 2>&1
grep -vE "^\s*$" $OUT/quant_subset.txt | cut -c1-200 | tail -20
stamp done

#!/usr/bin/env bash
# Session 13, one call (carry .whl .snap): the quant GEMV at 1, 2, 4 and 8 rows per shape and type
# (kernel times), the native decode step with a graph per batch (session 12's B=2/4 replayed the B=8
# graph), then the offline + Poisson stage (16 and 64 req/s, graph counters during each). ~8 minutes.
source "$(dirname "$0")/common.sh"
stamp "quant GEMV kernels, rows 1 2 4 8"
timeout 200 python3 -m bench.quant_kernels --types Q4_K,Q6_K,Q8_0 --rows 1,2,4,8 --no-torch --precompile 14 \
    --json $OUT/quant_kernels.json > $OUT/quant_kernels.txt 2>&1
grep -vE "^#" $OUT/quant_kernels.txt | cut -c1-160 | head -70
for w in native bf16; do
  stamp "quant_decode $w"
  timeout 150 python3 -m bench.quant_decode --weights $w --batch 1 2 4 8 > $OUT/quant_decode_$w.txt 2>&1
  grep -E "^decode|weights=|Error" $OUT/quant_decode_$w.txt | cut -c1-200
done
stamp "offline + Poisson"
timeout 300 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape \
    2>&1 | grep -E "^\[offline\]|^\[poisson\]|Error" | cut -c1-400
stamp done

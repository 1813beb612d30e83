#!/usr/bin/env bash
# Issue 18's two cells past 2% in s17_a, again (carry .whl .snap; ~3 minutes): the 8B shape's
# batch-1 graph replay three times (run-to-run spread), and offline serving twice on both shapes.
source "$(dirname "$0")/common.sh"
for i in 1 2 3; do
  stamp "replay 8B B=1, run $i"
  AB_LIMIT=120 ab --model llama-3-8b-shape --batch 1 --override "levers.graph_batch_sizes=[1]"
done
for i in 1 2; do
  stamp "offline, run $i"
  timeout 200 python3 -m bench.run_all --stage offline --out $OUT/raw$i --models smollm2-135m-shape llama-3.2-1b-shape \
      2>&1 | grep -E "^\[offline\]|Error" | cut -c1-300
done
stamp done

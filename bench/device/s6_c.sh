#!/usr/bin/env bash
# Session 6, second sequence, call 1 (carry .whl + .snap): the PDL trigger modes at batch 32 on the
# small shapes (s6_b.sh measured batch 1: late wins on SmolLM2 and the 1B, early on the 8B), to set
# levers.pdl_trigger=auto. Calls 2-4: `METHODS=ngram bash bench/device/s6_spec.sh` (.m1 .m2 .m3).
source "$(dirname "$0")/common.sh"
for mode in late early exit; do
  echo "--- pdl_trigger=$mode"
  ab --model llama-3.2-1b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.pdl_trigger=$mode"
  ab --model smollm2-135m-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.pdl_trigger=$mode"
done
stamp done

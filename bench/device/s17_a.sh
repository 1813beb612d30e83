#!/usr/bin/env bash
# Issue 18's re-measure in one lease, part 1 (carry .whl .snap; ~6 minutes): graph replay of the
# decode step at batch 1 and 32 on the three shapes (bench.profile_graph --time-only, context 512),
# then offline serving (nano-vllm protocol) on the SmolLM2 and 1B shapes. Part 2, in the same warm
# window: METHODS=ngram RUNS="64:5:150" bash bench/device/spec_h200.sh with [.m1], [.m2], [.m3].
source "$(dirname "$0")/common.sh"
for m in smollm2-135m-shape llama-3.2-1b-shape llama-3-8b-shape; do
  stamp "replay $m"
  AB_LIMIT=150 ab --model $m --batch 1 32 --override "levers.graph_batch_sizes=[1,32]"
done
stamp offline
timeout 240 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape \
    2>&1 | grep -E "^\[offline\]|Error" | cut -c1-300
stamp done

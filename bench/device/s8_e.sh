#!/usr/bin/env bash
# Session 8, fifth call (carry .whl .snap): the conformance GPU test after the warm-up fix, then
# Engine.generate beside graph replay for the three shapes, greedy and sampled.
source "$(dirname "$0")/common.sh"
stamp "gpu conformance"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_conformance_gpu.py 2>&1 | grep -E "passed|failed|^FAILED|^E " | head
stamp "user decode"
for m in smollm2-135m-shape llama-3.2-1b-shape llama-3-8b-shape; do
  timeout 150 python3 -m bench.user_decode --model $m --batch 1 32 --sampled --json $OUT/user_$m.json 2>&1 | grep -E "user_decode|Error"
done
stamp done

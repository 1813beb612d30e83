#!/usr/bin/env bash
# Session 8, second call (carry .whl .snap): start-up with the kernel cache (first / again), then
# Engine.generate beside graph replay.
source "$(dirname "$0")/common.sh"
stamp "startup 1B shape, fresh kernel cache then again"
timeout 200 python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --json $OUT/startup_1b.json 2>&1 | tail -4
stamp "user decode, SmolLM2 + 1B shapes"
for m in smollm2-135m-shape llama-3.2-1b-shape; do
  timeout 120 python3 -m bench.user_decode --model $m --batch 1 32 --json $OUT/user_$m.json 2>&1 | grep -E "user_decode|Error"
done
stamp done

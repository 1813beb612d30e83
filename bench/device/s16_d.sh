#!/usr/bin/env bash
# Session 16, call 6 (carry .whl .snap; ~7 minutes): issue 19's serving figures after the block-table
# copy shrank (offline at batch 256 copied 512 table columns a row, 512 KB a step): offline (nano-vllm
# protocol) on the SmolLM2 and 1B shapes, then the served SmolLM2 shape (engine in its own process)
# at 1 and 64 streams beside Engine.generate on the same prompts.
source "$(dirname "$0")/common.sh"
stamp offline
timeout 240 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape \
    2>&1 | grep -E "^\[offline\]|Error" | cut -c1-300
MODES=true TOKENS=128 bash "$(dirname "$0")/s8_serve.sh" 2>&1 | tail -14
stamp done

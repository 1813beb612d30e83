#!/usr/bin/env bash
# Session 22, call a (carry .whl .snap): levers.compile_workers on the GPU, trimmed to a small budget:
# its GPU test (a first start with workers, a second, one compiled in-process), then the 1B shape's
# start-up with 8 workers, a first start (empty cache) and a second (the cuBLASLt picks from disk).
source "$(dirname "$0")/common.sh"
stamp "precompile GPU test"
timeout 150 python3 -m pytest -q -x -s tests/gpu/test_precompile_gpu.py -p no:cacheprovider 2>&1 | grep -E "first start|passed|failed|Error|assert" | cut -c1-600 | head -20
stamp "startup workers 8"
timeout 75 python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --levers '{"compile_workers": 8}' 2>&1 | grep -E "^startup|Error" | cut -c1-400
stamp end

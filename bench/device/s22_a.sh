#!/usr/bin/env bash
# Session 22, call a (carry .whl .snap), for a small device budget: the 1B shape's start-up with 8
# compile workers (a first start with an empty cache, then a second: the cuBLASLt picks from disk),
# then levers.compile_workers' GPU test (a first start with workers, a second, one compiled in-process;
# equal tokens).
source "$(dirname "$0")/common.sh"
stamp "startup workers 8"
timeout ${START_S:-60} python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --levers '{"compile_workers": 8}' 2>&1 | grep -E "^startup|Error" | cut -c1-400
stamp "precompile GPU test"
timeout ${TEST_S:-95} python3 -m pytest -q -x -s tests/gpu/test_precompile_gpu.py -p no:cacheprovider 2>&1 | grep -E "first start|passed|failed|Error|assert" | cut -c1-600 | head -20
stamp end

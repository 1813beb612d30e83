#!/usr/bin/env bash
# Session 22, call b (carry .whl only: the working tree, with metrale/assets, runs): the 1B shape's
# start-up with 8 compile workers (a first start, empty cache, and a second), then the MTP head on
# the device (tests/gpu/test_mtp_cuda_gpu.py: drafts against the NumPy head, greedy equality, timing).
source "$(dirname "$0")/common.sh"
stamp "startup workers 8"
timeout 70 python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --levers '{"compile_workers": 8}' 2>&1 | grep -E "^startup|Error" | cut -c1-400
stamp "mtp device head GPU test"
timeout ${MTP_S:-100} python3 -m pytest -q -x -s tests/gpu/test_mtp_cuda_gpu.py -p no:cacheprovider 2>&1 | grep -vE "^\s*$" | cut -c1-300 | tail -40
stamp end

#!/usr/bin/env bash
# Session 16, call 5 (carry .whl .snap; ~5 minutes): a step copies only the block-table columns it
# uses (cuMemcpy2DAsync; the 1B shape's 131,072 positions made the table grid 1 MB a step at
# batch 32): the overlap and mixed-graph GPU tests, Engine.generate on the 1B shape (0.952 of replay
# at batch 32 this morning), and the host profile of that loop.
source "$(dirname "$0")/common.sh"
stamp "tests"
gpu_tests tables 200 tests/gpu/test_overlap_gpu.py tests/gpu/test_mixed_graphs_gpu.py -k "not gemma"
stamp "1B"
timeout 120 python3 -m bench.user_decode --model llama-3.2-1b-shape --batch 1 32 --json $OUT/user_1b.json 2>&1 | grep -E "user_decode|Error"
stamp "profile"
timeout 100 python3 -m bench.ahead_profile --model llama-3.2-1b-shape --batch 32 > $OUT/ahead_profile.txt 2>&1
grep -E "ahead_profile|Error" $OUT/ahead_profile.txt; grep -A22 "tottime" $OUT/ahead_profile.txt | cut -c1-150
stamp done

#!/usr/bin/env bash
# Session 5, call C (carry .whl + .snap): cuBLASLt autotune timed with a cold L2 (the B=32 picks),
# and the one-row GEMV's warps / loads in flight swept inside the 8B batch-1 decode graph.
source "$(dirname "$0")/common.sh"
stamp tests
timeout 90 python3 -m pytest -q -m gpu -p no:warnings -s tests/gpu/test_cublaslt_gpu.py -k autotune > $OUT/tests_c.txt 2>&1
grep -E "passed|failed|^E  |^FAILED|autotune" $OUT/tests_c.txt | cut -c1-200 | tail -8
stamp replays
echo "--- 8B B=32, cold-L2 autotune, two backends"
ab --model llama-3-8b-shape --batch 32 --override "levers.graph_batch_sizes=[32]"
ab --model llama-3-8b-shape --batch 32 --override "levers.graph_batch_sizes=[32]"
for wu in "0 0" "0 4" "0 1" "4 0" "4 4" "8 4"; do
  set -- $wu
  echo "--- gemv_warps=$1 gemv_unroll=$2"
  ab --model llama-3-8b-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.gemv_warps=$1" "levers.gemv_unroll=$2"
done
stamp done

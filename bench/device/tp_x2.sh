#!/usr/bin/env bash
# Device call (kind nvidia-h100-x2 or nvidia-h200-x2; carry [".whl", ".snap"] with nccl4py-0.6.0 and
# its libnccl wheel in .whl; run timeout_s 600): issue 25's tensor parallelism on two GPUs.
#   1. tests/gpu/test_tp_cuda_gpu.py: TP=2 greedy == TP=1 on a small real-layout checkpoint, graphs
#      on, PDL on and off; the CLI on two GPU ranks (bounded by TEST_S, default 240 s)
#   2. python -m bench.tp_bench --allreduce: NCCL all-reduce latency of [T, 4096] (eager and inside a
#      graph), then Llama-3-8B shape decode tok/s through Engine.generate, TP=2 vs TP=1 at batch 1 and
#      32 (bounded by BENCH_S, default 300 s; records in $OUT/tp.json, the log in $OUT/tp_bench.txt)
# NCCL_DEBUG=INFO goes to $OUT/nccl.<pid>.log, one file a rank.
source "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0            # NVLink multicast stays off on a shared host (KINDS.md)
stamp diagnostics
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
nvidia-smi topo -m 2>&1 | head -4
nccl_ready || { echo "nccl4py cannot load libnccl: carry nccl4py and its NCCL runtime in .whl"; exit 3; }
export NCCL_DEBUG=INFO NCCL_DEBUG_FILE=$OUT/nccl.%p.log
stamp "tp GPU test"
timeout ${TEST_S:-240} python3 -m pytest -q -x -s -m gpu tests/gpu/test_tp_cuda_gpu.py -p no:cacheprovider \
    > $OUT/tests_tp.txt 2>&1
grep -E "passed|failed|skipped|^E  |^FAILED|Error" $OUT/tests_tp.txt | cut -c1-300 | tail -12
stamp "tp bench"
timeout ${BENCH_S:-300} python3 -m bench.tp_bench --allreduce --out $OUT/tp.json --timeout $(( ${BENCH_S:-300} - 20 )) \
    2>&1 | tee $OUT/tp_bench.txt | grep -vE "^\s*$" | cut -c1-300 | tail -40
stamp "tp bench rc=${PIPESTATUS[0]}"
grep -h "WARN" $OUT/nccl.*.log 2>/dev/null | sort | uniq -c | head -10
grep -h -m1 -E "NCCL version" $OUT/nccl.*.log 2>/dev/null | head -2
stamp end

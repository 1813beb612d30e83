#!/usr/bin/env bash
# Session 4, call C (carry .whl): the split heuristic (132x4 warps) and the GEMV weight loads before
# the PDL wait: correctness (flash-decode + fused GEMV GPU tests), decode replays with each PDL
# trigger, the split sweep over more batches/contexts.
set -u
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 150 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_flash_decode_gpu.py tests/gpu/test_fused_gemv_gpu.py \
    > $OUT/tests_c.txt 2>&1; grep -E "passed|failed|^E  |^FAILED" $OUT/tests_c.txt | cut -c1-250 | tail -8
stamp replays
ab() { timeout 80 python3 -m bench.profile_graph --time-only --context 512 "$@" 2>&1 | grep -E "replay|Error|error" | cut -c1-200 | tail -3; }
for t in early exit; do
  echo "-- pdl_trigger=$t"
  ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" levers.pdl_trigger=$t
  ab --model smollm2-135m-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" levers.pdl_trigger=$t
done
stamp split_sweep
timeout 120 python3 -m bench.decode_floor --split --no-floor --out $OUT/split.json 2>&1 | grep -E "attn|Error" | cut -c1-160
stamp done

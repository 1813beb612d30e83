#!/usr/bin/env bash
# Session 4, call A (carry .whl): install, GPU tests after session 3's review edits (backend, hybrid,
# DeepSeek), the carried-norm-sums fused test and A/B (8B B=1/32, SmolLM2 B=1).
set -u
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 300 python3 -m pytest -q -m gpu -p no:warnings -x --durations=8 tests/gpu/test_cuda_backend_gpu.py \
    tests/gpu/test_hybrid_gpu.py tests/gpu/test_deepseek_gpu.py tests/gpu/test_fused_gemv_gpu.py > $OUT/tests.txt 2>&1
grep -E "passed|failed|^E  |^FAILED|s call" $OUT/tests.txt | cut -c1-250 | tail -16
stamp carry_ab
ab() { timeout 60 python3 -m bench.profile_graph --time-only --context 512 "$@" 2>&1 | grep -E "replay|Error|error" | cut -c1-200 | tail -3; }
for c in false true; do
  echo "-- carry_norm_sums=$c"
  ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" levers.carry_norm_sums=$c
  ab --model smollm2-135m-shape --batch 1 --override "levers.graph_batch_sizes=[1]" levers.carry_norm_sums=$c
done
stamp done

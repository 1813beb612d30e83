#!/usr/bin/env bash
# Session 3, call F (carry .whl): first GPU runs of levers.mixed_graphs and levers.carry_norm_sums.
set -u
if [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
      --target /tmp/site .whl/*.whl .whl/*.tar.gz
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp carry_tests
timeout 70 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_fused_gemv_gpu.py > $OUT/carry_tests.txt 2>&1
grep -E "passed|failed|^E  " $OUT/carry_tests.txt | cut -c1-300 | tail -6
stamp carry_ab
G="levers.graph_batch_sizes=[1]"
ab() { timeout 60 python3 -m bench.profile_graph --time-only --context 512 --batch 1 "$@" 2>&1 | grep -E "replay|Error|error" | cut -c1-200 | tail -2; }
ab --model llama-3-8b-shape --override "$G"
ab --model smollm2-135m-shape --override "$G"
ab --model smollm2-135m-shape --override "$G" levers.carry_norm_sums=false
stamp mixed_tests
timeout 90 python3 -m pytest -q -m gpu -p no:warnings -s tests/gpu/test_mixed_graphs_gpu.py > $OUT/mixed_tests.txt 2>&1
grep -E "passed|failed|mixed graphs:|prefill 512|diverged|^E  " $OUT/mixed_tests.txt | cut -c1-300 | tail -12
stamp host_profile
timeout 45 python3 -m bench.host_profile --model smollm2-135m-shape --prefill 512 --top 12 \
    --override levers.mixed_graphs=true > $OUT/host_profile.txt 2>&1
grep -E "prefill 512|Error|function calls" $OUT/host_profile.txt | head -3
stamp done

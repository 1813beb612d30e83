#!/usr/bin/env bash
# Session 3, call E: levers.mixed_graphs (prefill and mixed steps as bucketed CUDA graphs).
# Runs from the working tree (carry .whl on a fresh machine; /tmp/site reused when warm):
#   1. tests/gpu/test_mixed_graphs_gpu.py (lever on vs off: tokens, logits, replays, a 512 timing)
#   2. bench.host_profile --prefill 512, lever on, SmolLM2 and 1B shapes (compare: 54 ms eager)
#   3. tests/gpu/test_cuda_backend_gpu.py with the lever on (plugin tests/gpu/mixed_graphs_on.py)
set -u
if [ ! -d /tmp/site/hydra ]; then
  [ -d .whl ] || { echo "FRESH MACHINE: packages missing (carry .whl)"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
      --target /tmp/site .whl/*.whl .whl/*.tar.gz
fi
grep -q mixed_graphs metrale/config.py || { echo "this tree has no levers.mixed_graphs"; exit 4; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp mixed_tests
timeout 100 python3 -m pytest -q -m gpu -p no:warnings -s tests/gpu/test_mixed_graphs_gpu.py > $OUT/mixed_tests.txt 2>&1
grep -E "passed|failed|mixed graphs:|prefill 512|diverged|Error|assert" $OUT/mixed_tests.txt | cut -c1-300 | tail -14
stamp host_profile
for m in smollm2-135m-shape llama-3.2-1b-shape; do
  timeout 50 python3 -m bench.host_profile --model $m --prefill 512 --top 12 --override levers.mixed_graphs=true \
      > $OUT/host_profile_$m.txt 2>&1
  echo "$m (mixed_graphs=true): $(grep -E 'prefill 512|Error' $OUT/host_profile_$m.txt | head -2)"
  grep -E "function calls" $OUT/host_profile_$m.txt | head -1
done
stamp backend_tests_lever_on
timeout 110 python3 -m pytest -q -m gpu -p no:warnings -p tests.gpu.mixed_graphs_on tests/gpu/test_cuda_backend_gpu.py \
    -k "not real_smollm2" > $OUT/backend_tests_on.txt 2>&1
grep -E "passed|failed|Error|assert" $OUT/backend_tests_on.txt | cut -c1-300 | tail -10
stamp done

#!/usr/bin/env bash
# Session 3, call A (carry .whl and .snap): install the packages; the CUDA backend's GPU tests and the
# sampling GPU tests with programmatic dependent launch on (the default); then the PDL A/B: device
# time of one decode graph replay, levers.pdl=true vs false, for three model shapes at B = 1 and 32.
set -u
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 200 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_cuda_backend_gpu.py tests/test_sampling_gpu.py \
    -k "not real_smollm2" > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
stamp ab
G="levers.graph_batch_sizes=[1,32]"
for m in smollm2-135m-shape llama-3-8b-shape llama-3.2-1b-shape; do
  for p in true false; do
    timeout 100 python3 -m bench.profile_graph --model $m --batch 1 32 --time-only --override "$G" levers.pdl=$p 2>&1 \
      | grep -E "replay|Error|error" | tail -3
  done
done
stamp done

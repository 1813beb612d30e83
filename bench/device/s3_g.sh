#!/usr/bin/env bash
# Session 3, call G (carry .whl): carried norm sums, for real: fused-vs-unfused GPU test, 8B B=1 replay.
set -u
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
timeout 45 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_fused_gemv_gpu.py -k "fused_decode_equals" 2>&1 | grep -E "passed|failed|^E  " | cut -c1-250 | tail -5
timeout 50 python3 -m bench.profile_graph --time-only --context 512 --batch 1 --model llama-3-8b-shape \
    --override "levers.graph_batch_sizes=[1]" 2>&1 | grep -E "replay|Error" | cut -c1-200

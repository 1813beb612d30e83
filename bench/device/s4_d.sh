#!/usr/bin/env bash
# Session 4, call D (carry .whl): decode attention writes cuBLASLt's bf16 input (no cast launch):
# GPU tests, decode replays, and the torch.compile peer at 8B B=32 in the same run.
set -u
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 170 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_flash_decode_gpu.py tests/gpu/test_cuda_backend_gpu.py \
    -k "not timing" > $OUT/tests_d.txt 2>&1; grep -E "passed|failed|^E  |^FAILED" $OUT/tests_d.txt | cut -c1-250 | tail -8
stamp replays
ab() { timeout 80 python3 -m bench.profile_graph --time-only --context 512 "$@" 2>&1 | grep -E "replay|Error|error" | cut -c1-200 | tail -3; }
ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]"
ab --model smollm2-135m-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]"
stamp torch_peer
timeout 200 python3 -m bench.run_all --stage peers --out $OUT/raw --peer-jobs torch_decode:llama-3-8b-shape:32 2>&1 \
    | grep "\[peers\]" | cut -c1-300
stamp done

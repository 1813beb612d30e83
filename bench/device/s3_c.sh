#!/usr/bin/env bash
# Session 3, call C (carry .snap; warm machine or .whl): balanced flash-decode partitions and cuBLASLt
# autotune: GPU tests, then graph-replay A/B (8B: all on / autotune off; PDL early trigger off;
# SmolLM2 + 1B shapes).
set -u
if [ ! -d /tmp/site/hydra ]; then
  [ -d .whl ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
      --target /tmp/site .whl/*.whl .whl/*.tar.gz
fi
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 170 python3 -m pytest -q -m gpu -p no:warnings -s tests/gpu/test_flash_decode_gpu.py tests/gpu/test_cublaslt_gpu.py \
    tests/gpu/test_cuda_backend_gpu.py -k "not real_smollm2 and not timing and not prefill" > $OUT/tests.txt 2>&1
grep -E "passed|failed|autotune|Error" $OUT/tests.txt | tail -8
stamp ab
G="levers.graph_batch_sizes=[1,32]"
ab() { timeout 100 python3 -m bench.profile_graph --time-only --context 512 "$@" 2>&1 | grep -E "replay|autotune|Error|error" | cut -c1-400 | tail -6; }
ab --model llama-3-8b-shape --batch 1 32 --override "$G"
ab --model llama-3-8b-shape --batch 1 32 --override "$G" levers.cublaslt_autotune=0
ab --model llama-3-8b-shape --batch 1 32 --override "$G" levers.pdl_trigger=exit
ab --model smollm2-135m-shape --batch 1 32 --override "$G"
ab --model smollm2-135m-shape --batch 1 32 --override "$G" levers.pdl_trigger=exit
ab --model llama-3.2-1b-shape --batch 1 32 --override "$G"
stamp hybrid
timeout 150 python3 -m pytest -q -m gpu -p no:warnings -x tests/gpu/test_hybrid_gpu.py > $OUT/hybrid_tests.txt 2>&1
grep -E "passed|failed|Error|error|assert" $OUT/hybrid_tests.txt | tail -12
timeout 80 python3 -m bench.hybrid_bench --model qwen3-next-1b-shape --batch 1 32 --out $OUT 2>&1 | tail -6
stamp done

#!/usr/bin/env bash
# Session 3, call D (carry .whl): first GPU runs of the hybrid (GDN) and DeepSeek (MLA/MoE) CUDA paths.
set -u
[ -d /tmp/site/hydra ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp hybrid
timeout 150 python3 -m bench.hybrid_bench --model qwen3-next-1b-shape --batch 1 32 --out $OUT 2>&1 | tail -8
stamp deepseek
timeout 230 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_deepseek_gpu.py > $OUT/deepseek_tests.txt 2>&1
grep -E "passed|failed|^E  |Error" $OUT/deepseek_tests.txt | head -14
stamp done

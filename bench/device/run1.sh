#!/usr/bin/env bash
# Device call: cuBLASLt check, Numba-vs-cuBLASLt GEMM crossover, 8B decode/prefill with both libraries.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "from metrale.runtime.cuda.cublaslt import available; print(available())"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cublaslt_gpu.py -x 2>&1 | tail -15
timeout 200 python3 -m bench.gemm_library_bench --out $OUT/gemm_library.json 2>&1 | tail -60
for lib in numba cublaslt; do
  timeout 150 python3 -m bench.decode_metrale --model llama-3-8b-shape --batch 1 32 128 --prefill 4096 \
     --override levers.gemm_library=$lib levers.cublaslt_min_rows=16 2>&1 | tail -8
done

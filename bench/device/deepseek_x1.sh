#!/usr/bin/env bash
# Device call (nvidia-h200, carry [".whl"]): DeepSeek on the CUDA backend (MLA + MoE) vs NumPy,
# then the MLA-decode and MoE-layer kernel benchmark (records under $OUT).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 420 python3 -m pytest -q -m gpu tests/gpu/test_deepseek_gpu.py -x -s 2>&1 | tail -40
timeout 150 python3 -m bench.deepseek_bench --out $OUT/deepseek_kernels.json 2>&1 | tail -20

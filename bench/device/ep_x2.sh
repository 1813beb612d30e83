#!/usr/bin/env bash
# Device call (nvidia-h200-x2, carry [".whl"] with nccl4py in it): expert parallelism over NCCL,
# one process per GPU: EP=2 greedy tokens == single GPU, then V2-Lite-shaped MoE decode tok/s at
# batch 1 and 64 on one GPU vs two (records under $OUT).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 - <<'PY'
import importlib
for m in ("cuda.core", "cuda.pathfinder", "cuda.bindings", "nccl.core"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING:", repr(e))
PY
timeout 540 python3 -m bench.ep_bench --out $OUT/deepseek_ep.json 2>&1 | tail -60

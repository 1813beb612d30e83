#!/usr/bin/env bash
# Device call: the sampling kernels' GPU tests and the sampling bench (after the launch-bound fix).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null || exit 1
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
timeout 60 python3 -m pytest -q -m gpu -p no:warnings tests/test_sampling_gpu.py 2>&1 | tail -3
timeout 70 python3 -m bench.sampling_bench --quick --out $OUT/sampling.json 2>&1 | tail -27

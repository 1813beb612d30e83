#!/usr/bin/env bash
# Device call: GPU tests of the session's new kernels, then quick measurements of each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 240 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_flash_prefill_gpu.py tests/gpu/test_fused_gemv_gpu.py \
   tests/test_sampling_gpu.py tests/gpu/test_cuda_backend_gpu.py -s 2>&1 | grep -v "^$" | tail -45
stamp attention_bench
timeout 90 python3 bench/attention_bench.py --json $OUT 2>&1 | tail -12
stamp fma_sweep
timeout 120 python3 bench/gemm_bench.py --fma-sweep --json $OUT/fma_sweep.json 2>&1 | tail -40
stamp decode
timeout 90 python3 -m bench.decode_metrale --model smollm2-135m-shape --batch 1 32 2>&1 | grep -E "decode|prefill"
timeout 90 python3 -m bench.decode_metrale --model smollm2-135m-shape --batch 1 --override levers.fuse_decode=false 2>&1 | grep -E "decode|prefill"
timeout 150 python3 -m bench.decode_metrale --model llama-3-8b-shape --batch 1 32 128 --prefill 4096 2>&1 | grep -E "decode|prefill"
stamp profile
timeout 120 python3 -m bench.profile_step --model llama-3-8b-shape --batch 32 2>&1 | grep -v -i warn | head -20
stamp sampling
timeout 120 python3 -m bench.sampling_bench --quick --out $OUT/sampling.json 2>&1 | tail -30
stamp done

#!/usr/bin/env bash
# Final device run, call N1 (carry .snap; warm machine with /tmp/site): new kernels' GPU tests and
# timings (flash_decode, sampling), the sampling bench, the metrale decode/prefill sweeps.
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp flash_decode
timeout 110 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_flash_decode_gpu.py tests/gpu/test_cuda_backend_gpu.py \
   -k "flash_decode_gpu or tensor_core or 1b_shape" -s > $OUT/flash_decode.txt 2>&1 && touch /tmp/flash_decode_ok && echo "flash decode OK"
grep -E "passed|failed|TB/s|Error" $OUT/flash_decode.txt | tail -24
stamp sampling
timeout 40 python3 -m pytest -q -m gpu -p no:warnings tests/test_sampling_gpu.py 2>&1 | tail -2
timeout 50 python3 -m bench.sampling_bench --quick --out $OUT/sampling.json 2>&1 | tail -26
stamp metrale
L=""; [ -f /tmp/flash_decode_ok ] && L="--lever decode_attention_kernel=mma"
timeout 170 python3 -m bench.run_all --stage metrale --out $OUT/raw $L 2>&1 | grep "\[metrale\]"
stamp done

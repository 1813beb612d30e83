#!/usr/bin/env bash
# Final device run, call C (carry .m3; A and B within the warm window): join SmolLM2, GPU tests on
# the real weights and the new kernels, the speculative-decoding bench, real-weight decode, sampling.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
[ -f /tmp/mdl/smolpart.ab ] || { echo "FRESH MACHINE: redo calls A and B"; exit 3; }
cat /tmp/mdl/smolpart.aa /tmp/mdl/smolpart.ab .m3/smolpart.ac > /tmp/mdl/smollm2.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/mdl/smollm2.gguf" | sha256sum -c || exit 4
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
FD=""; [ -f tests/gpu/test_flash_decode_gpu.py ] && FD=tests/gpu/test_flash_decode_gpu.py
timeout 130 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_cuda_backend_gpu.py tests/test_sampling_gpu.py \
   -k "not tensor_core" -q 2>&1 | grep -v "^$" | tail -15
stamp flash_decode
[ -n "$FD" ] && timeout 120 python3 -m pytest -q -m gpu -p no:warnings $FD tests/gpu/test_cuda_backend_gpu.py -k "flash or tensor_core" -s > $OUT/flash_decode.txt 2>&1 \
   && touch /tmp/flash_decode_ok && echo "flash decode OK"; grep -E "passed|failed|TB/s|us" $OUT/flash_decode.txt | tail -22
stamp spec
timeout 230 python3 -m bench.spec_bench --device cuda --model /tmp/mdl/smollm2.gguf --batch 1 32 --max-tokens 64 \
   --out $OUT/spec.json --records $OUT/spec_records.json 2>&1 | grep -v -i warn | tail -30
stamp real_decode
timeout 40 python3 -m bench.decode_metrale --model /tmp/mdl/smollm2.gguf --batch 1 8 32 2>&1 | grep -E "decode|loaded"
stamp sampling
timeout 60 python3 -m bench.sampling_bench --quick --out $OUT/sampling.json 2>&1 | tail -28
stamp done

#!/usr/bin/env bash
# Session 21, call d: levers.compile_workers (kernels_numba/precompile.py) on the GPU: its test, then
# the 1B shape's start-up with workers (default 8) and without (0) in the same lease, each a first
# start (empty cache) and a second; then the served path at one stream beside the library.
#   bash bench/device/s21_d.sh     (carry .whl .snap)
source "$(dirname "$0")/common.sh"
RES=$OUT/s21d; mkdir -p $RES
stamp "precompile GPU test"
timeout 300 python3 -m pytest -q -x -s tests/gpu/test_precompile_gpu.py -p no:cacheprovider 2>&1 | grep -E "first start|passed|failed|Error|assert" | cut -c1-600 | head -20
for lv in '{"compile_workers": 8}' '{"compile_workers": 0}'; do
  stamp "startup $lv"
  timeout 200 python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --levers "$lv" 2>&1 | grep -E "^startup|Error" | cut -c1-400
done
if [ -n "${FP8:-}" ]; then    # FP8=1: the FP8 GEMV's GPU test (T = 1, 8: x rows in registers) and the 8B FP8 decode
  stamp "fp8 gemv GPU test"
  timeout 150 python3 -m pytest -q -x tests/gpu/test_quant_gpu.py -k fp8_gemv -p no:cacheprovider 2>&1 | tail -2
  stamp "fp8 decode"
  timeout 120 python3 -m bench.quant_decode --fp8 --batch 1 2 4 8 32 2>&1 | grep -E "^decode|Error" | cut -c1-200
fi
[ -n "${SERVE:-}" ] || { stamp end; exit 0; }    # SERVE=1: the one-stream served check too
stamp "one stream: served, then the library"
PORT=8315
python3 -m metrale serve device=cuda model=smollm2-135m-shape server.port=$PORT server.engine_process=true > $RES/server1.txt 2>&1 &
SPID=$!
for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
timeout 100 python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model smollm2-135m-shape --clients 1 --requests 4 --max-tokens 32 --prompt-words 16 > /dev/null 2>&1
for r in 1 2; do timeout 100 python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model smollm2-135m-shape --clients 1 \
    --requests 8 --max-tokens 128 --prompt-words 16 2>&1 | grep -E "output tok/s" | head -1; done
kill -TERM $SPID; wait $SPID
for r in 1 2; do timeout 100 python3 -m bench.loadtest --library model=smollm2-135m-shape device=cuda --clients 1 --requests 8 \
    --max-tokens 128 --prompt-words 16 2>&1 | grep -E "output tok/s" | head -1; done
stamp end

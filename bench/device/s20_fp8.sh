#!/usr/bin/env bash
# Session 20: FP8 e4m3 checkpoints on a GPU for the first time (commit 96d7eb5, docs/quant.md "FP8
# checkpoints"). The GPU tests of tests/gpu/test_fp8_backend_gpu.py (a small Llama written as block-scaled
# 128 x 128 and fbgemm per-channel FP8 checkpoints: levers.weights=native against bf16 and the CPU
# float32 engine: memory report, last-position logits on the FP8 GEMV and bf16 scratch roads, greedy
# tokens) and tests/gpu/test_quant_backend_gpu.py (the GGUF native road, unchanged), then the
# Llama-3-8B-shape decode timing of random FP8 weights (native: DeviceFP8) against bf16 at batch
# 1 / 8 / 32 (bench.quant_decode; tok/s, device weight bytes, TB/s of weights + KV).
#   bash bench/device/s20_fp8.sh     (carry .whl [.snap]; TESTS_LIMIT=... raises the tests' 240 s;
#   PARTS=tests or PARTS=decode runs one half)
#   out: $OUT/tests_s20_fp8.txt, $OUT/s20_fp8/decode_fp8.txt, decode_bf16.txt (each ends in a JSON line)
source "$(dirname "$0")/common.sh"
RES=$OUT/s20_fp8; mkdir -p $RES
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$RES/nvidia_smi.txt" 2>&1
PARTS=${PARTS:-tests decode}
if [[ $PARTS == *tests* ]]; then
stamp "GPU tests"
gpu_tests s20_fp8 ${TESTS_LIMIT:-240} -rP tests/gpu/test_fp8_backend_gpu.py tests/gpu/test_quant_backend_gpu.py
grep -E "^(block128|fbgemm)|rel err|native ==" "$OUT/tests_s20_fp8.txt" | cut -c1-200 | head -24
fi
[[ $PARTS == *decode* ]] || { stamp end; exit 0; }
stamp "decode fp8 (native DeviceFP8)"
timeout 240 python3 -m bench.quant_decode --fp8 --batch 1 8 32 > $RES/decode_fp8.txt 2>&1
grep -vE "^\{" $RES/decode_fp8.txt | cut -c1-220 | tail -6
stamp "decode bf16"
timeout 150 python3 -m bench.quant_decode --weights bf16 --batch 1 8 32 > $RES/decode_bf16.txt 2>&1
grep -vE "^\{" $RES/decode_bf16.txt | cut -c1-220 | tail -6
stamp end

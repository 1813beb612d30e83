#!/usr/bin/env bash
# Session 15, call 2 (carry .whl .snap; ~8 minutes): the fragment layout as the default
# (levers.quant_mma_rows=1) with gemv_mq's warps chosen by shape (quant_mma.mq_warps): the native
# backend GPU tests, with a stack dump of any test past 100 s (s13_cd and s15_a timed out at 200 s
# with no output), the kernel tests at the 8B shapes, and the 8B native step at batch 1 to 32.
source "$(dirname "$0")/common.sh"
stamp "native backend GPU tests (quant_mma_rows=1)"
timeout 260 python3 -m pytest -v -m gpu -p no:warnings -o faulthandler_timeout=100 --durations=0 \
    tests/gpu/test_quant_backend_gpu.py > $OUT/tests_quant_backend.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout|^E  |File \"/tmp/src" $OUT/tests_quant_backend.txt | cut -c1-220 | tail -30
stamp "quant_decode native (fragment layout, warps by shape)"
timeout 130 python3 -m bench.quant_decode --weights native --batch 1 2 8 16 32 \
    > $OUT/quant_decode.txt 2>&1; grep -E "tok/s|Error" $OUT/quant_decode.txt | tail -6
stamp "kernel GPU tests (fragment layout at the 8B shapes, mma, fused quantizations)"
gpu_tests quant_kernels 150 tests/gpu/test_quant_gpu.py -k "fragment or mma or fused or many_rows"
stamp done

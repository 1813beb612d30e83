#!/bin/bash
# Issue 22's quantized kernels on the H200, one call (~6-8 minutes): the GPU tests of
# tests/gpu/test_quant_gpu.py and the kernel benchmark bench/quant_kernels.py (every GGUF type's
# GEMV on Llama-3-8B's shapes at 1 / 8 / 32 rows beside the bf16 GEMV and torch).
#   run: carry [".whl"] (or [".whl", ".snap"] with .snap made from HEAD), command
#        "bash bench/device/quant.sh"
#   out: $OUT/tests_quant.txt, $OUT/bench_quant.txt, $OUT/quant_kernels.json, $OUT/nvidia_smi.txt
# Kernels compile first in parallel processes into Numba's disk cache (kernels_numba/jit.py), so the
# tests and the benchmark load them instead of compiling them one by one (the generated GEMV kernels
# take 5-10 s each to compile; 32 of them). SWEEP=1 adds the GEMV geometry sweep on gate_up /
# lm_head for Q4_K and Q6_K (more compiles: ~2 minutes more).
source bench/device/common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
PROCS=$(( $(nproc) > 16 ? 15 : $(nproc) - 1 ))
stamp precompile
timeout 200 python3 -m bench.quant_kernels --precompile "$PROCS" --precompile-only --shapes o,down 2>&1 | tail -3
stamp tests
gpu_tests quant ${TEST_LIMIT:-230} tests/gpu/test_quant_gpu.py -k "not 128256 and not vocab"
gpu_tests quant_vocab ${VOCAB_LIMIT:-90} tests/gpu/test_quant_gpu.py -k "128256 or vocab"
stamp bench
timeout ${BENCH_LIMIT:-240} python3 -m bench.quant_kernels --json "$OUT/quant_kernels.json" \
    > "$OUT/bench_quant.txt" 2>&1
grep -vE "^\s*$" "$OUT/bench_quant.txt" | grep -E "T=  1 (Q4_K|Q6_K|Q8_0)|bf16|#|Error|error" | cut -c1-200 | tail -40
if [ "${SWEEP:-0}" = 1 ]; then
  stamp sweep
  timeout 200 python3 -m bench.quant_kernels --types Q4_K,Q6_K --rows 1 --shapes gate_up,lm_head --sweep --no-torch \
      > "$OUT/sweep_quant.txt" 2>&1
  grep sweep "$OUT/sweep_quant.txt" | tail -12
fi
stamp done

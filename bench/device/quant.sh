#!/bin/bash
# Issue 22's quantized kernels on the H200 in one call (limits add up to 9.5 minutes; ~5-6 expected): the GPU tests of
# tests/gpu/test_quant_gpu.py and the kernel benchmark bench/quant_kernels.py (every GGUF type's and
# FP8's GEMV on Llama-3-8B's shapes at 1 / 8 / 32 rows beside the bf16 GEMV and torch, same run).
#   run:   carry [".whl"] (numpy 2.4, gguf, ml-dtypes; or [".whl", ".snap"], .snap made from HEAD),
#          command "bash bench/device/quant.sh"; PART=tests or PART=bench runs one half only
#   out:   $OUT/tests_quant.txt, tests_quant_vocab.txt, bench_quant.txt, quant_kernels.json, nvidia_smi.txt
# The GEMV kernels (32 generated ones, 5-10 s each to compile) are compiled first in parallel
# processes into Numba's disk cache (kernels_numba/jit.py); the tests and the benchmark then load
# them (bench_quant.txt's last line says how many came from the cache). SWEEP=1 adds the GEMV geometry
# sweep at T = 1 on gate_up / lm_head for Q4_K and Q6_K (its own compiles: ~2 minutes more).
# HINT_AB=1 (default): the T = 1 figures of Q4_K / Q6_K / Q8_0 / FP8 again without the streaming
# load hints (~1 minute, bench_quant_nohint.txt).
source bench/device/common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
PROCS=$(( $(nproc) > 16 ? 15 : $(nproc) - 1 ))
PART=${PART:-all}
stamp precompile
timeout ${PRE_LIMIT:-120} python3 -m bench.quant_kernels --precompile "$PROCS" --precompile-only --shapes o,down 2>&1 | tail -3
if [ "$PART" != bench ]; then
  stamp tests
  gpu_tests quant ${TEST_LIMIT:-160} tests/gpu/test_quant_gpu.py -k "not 128256 and not vocab"
  gpu_tests quant_vocab ${VOCAB_LIMIT:-50} tests/gpu/test_quant_gpu.py -k "128256 or vocab"
fi
if [ "$PART" != tests ]; then
  stamp bench
  timeout ${BENCH_LIMIT:-160} python3 -m bench.quant_kernels --json "$OUT/quant_kernels.json" \
      > "$OUT/bench_quant.txt" 2>&1
  grep -E "T=  1 (Q4_K|Q6_K|Q8_0|FP8) |T=  1 bf16|^#|Error|error" "$OUT/bench_quant.txt" | cut -c1-170 | tail -40
fi
if [ "${HINT_AB:-1}" = 1 ] && [ "$PART" != tests ]; then
  stamp "load hints A/B"       # the same kernels without .L1::no_allocate.L2::256B on the weight loads
  timeout ${AB_LIMIT:-60} python3 -m bench.quant_kernels --hint 0 --types Q4_K,Q6_K,Q8_0,FP8 --rows 1 \
      --shapes gate_up,down,lm_head --no-torch --precompile 8 > "$OUT/bench_quant_nohint.txt" 2>&1
  grep -E "T=  1 (Q4_K|Q6_K|Q8_0|FP8) |^#" "$OUT/bench_quant_nohint.txt" | cut -c1-170 | tail -16
fi
if [ "${SWEEP:-0}" = 1 ]; then
  stamp sweep
  timeout ${SWEEP_LIMIT:-150} python3 -m bench.quant_kernels --types Q4_K,Q6_K --rows 1 --shapes gate_up,lm_head \
      --sweep --no-torch > "$OUT/sweep_quant.txt" 2>&1
  grep sweep "$OUT/sweep_quant.txt" | tail -12
fi
stamp done

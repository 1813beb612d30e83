#!/bin/bash
# Issue 22's wiring on the H200 (levers.weights=native): the GPU tests of tests/gpu/test_quant_backend_gpu.py
# (a tiny Q4_K_M-typed GGUF through Engine / CudaBackend, native vs bf16 vs a NumPy twin; the real SmolLM2
# native when /tmp/mdl holds it) and the decode benchmark bench/quant_decode.py on the Llama-3-8B shape,
# random Q4_K (Q6_K lm_head) native vs random bf16, B = 1 and 8: tok/s and device weight bytes.
#   run:   carry [".whl"] (numpy 2.4, gguf, ml-dtypes, hydra/omegaconf; or [".whl", ".snap"], .snap made
#          from HEAD), command "PART=tests bash bench/device/s9_quant.sh", then "PART=bench bash ..."
#          (each half fits one 10-minute call; PART=all runs both when the kernels are in the disk cache)
#   out:   $OUT/tests_quant_backend.txt, quant_decode_native.txt, quant_decode_bf16.txt, nvidia_smi.txt
source bench/device/common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
PROCS=$(( $(nproc) > 16 ? 15 : $(nproc) - 1 ))
PART=${PART:-all}
if [ "$PART" != bench ]; then
  smollm2_ready >/dev/null 2>&1 || echo "(no SmolLM2: its native test skips)"
  stamp tests
  gpu_tests quant_backend ${TEST_LIMIT:-420} -s tests/gpu/test_quant_backend_gpu.py
  grep -E "smollm2 native" "$OUT/tests_quant_backend.txt" | tail -2
fi
if [ "$PART" != tests ]; then
  stamp precompile      # the residual GEMVs (o, down) of Q4_K at 1 and 8 rows, in parallel
  timeout ${PRE_LIMIT:-90} python3 -m bench.quant_kernels --precompile "$PROCS" --precompile-only \
      --types Q4_K --rows 1,8 --shapes o,down 2>&1 | tail -2
  for w in native bf16; do
    stamp "decode $w"
    timeout ${BENCH_LIMIT:-200} python3 -m bench.quant_decode --weights $w --batch 1 8 \
        > "$OUT/quant_decode_$w.txt" 2>&1
    grep -E "device weights|^decode|Error|error" "$OUT/quant_decode_$w.txt" | cut -c1-220 | tail -6
  done
fi
stamp done

#!/usr/bin/env bash
# Session 4, call E (after s4_spec.sh's first call unpacked .snap into /tmp/src and installed /tmp/site):
# the one-row epilogues (SwiGLU in gate_up, RoPE + K/V store in QKV): GPU tests, then decode replays.
[ -d /tmp/site/hydra ] || { echo "packages missing"; exit 3; }
cd /tmp/src 2>/dev/null || echo "no /tmp/src: the working tree"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp tests
timeout 100 python3 -m pytest -q -m gpu -p no:warnings -x tests/gpu/test_fused_gemv_gpu.py \
    tests/gpu/test_cuda_backend_gpu.py -k "fused_decode or glu or ragged or verify" > $OUT/tests_e.txt 2>&1
grep -E "passed|failed|^E  |^FAILED|graph nodes" $OUT/tests_e.txt | cut -c1-250 | tail -8
stamp replays
ab() { timeout 60 python3 -m bench.profile_graph --time-only --context 512 "$@" 2>&1 | grep -E "replay|Error|error" | cut -c1-200 | tail -3; }
ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]"
ab --model smollm2-135m-shape --batch 1 --override "levers.graph_batch_sizes=[1]"
ab --model llama-3.2-1b-shape --batch 1 --override "levers.graph_batch_sizes=[1]"
stamp done

#!/usr/bin/env bash
# Session 5, call B (carry .whl + .snap): the o_proj L2 prefetch during decode attention
# (levers.prefetch_o_proj; the split-K merge triggers before its wait) and the fixed-point carried
# norm sums: GPU tests, replays with the prefetch on / off, the torch.compile peer at 8B B=32.
source "$(dirname "$0")/common.sh"
stamp tests
timeout 170 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_fused_gemv_gpu.py tests/gpu/test_cuda_backend_gpu.py \
    -k "fused_decode or reproducible or glu or ragged or verify or prefill_logits" > $OUT/tests_b.txt 2>&1
grep -E "passed|failed|^E  |^FAILED|graph nodes" $OUT/tests_b.txt | cut -c1-250 | tail -8
stamp replays
for pf in true false; do
  echo "--- prefetch_o_proj=$pf"
  ab --model llama-3-8b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.prefetch_o_proj=$pf"
  ab --model llama-3.2-1b-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.prefetch_o_proj=$pf"
  ab --model smollm2-135m-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.prefetch_o_proj=$pf"
done
stamp "torch.compile peer, 8B B=32"
timeout 150 python3 -m bench.run_all --stage peers --out $OUT/raw --peer-jobs torch_decode:llama-3-8b-shape:32 \
    > $OUT/peer.txt 2>&1; echo "exit $?"
grep -E "tok/s|Error" $OUT/peer.txt | cut -c1-200 | tail -4
stamp done

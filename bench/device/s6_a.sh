#!/usr/bin/env bash
# Prepared in session 5 for the next device session (not yet run). Carry .whl + .snap.
# GPU tests of what landed after session 5's last device call, then the A/Bs it left:
#   levers.fuse_attention_merge (SmolLM2 / 1B batch 1: attention partials merged in the o_proj GEMV),
#   levers.cublaslt_split_k (8B batch 32: one-kernel cuBLASLt picks only), the torch.compile peer.
source "$(dirname "$0")/common.sh"
stamp tests
timeout 200 python3 -m pytest -q -m gpu -p no:warnings -s tests/gpu/test_fused_gemv_gpu.py tests/gpu/test_cublaslt_gpu.py \
    -k "merge or split_k or reproducible or fused_decode or autotune" > $OUT/tests_s6a.txt 2>&1
grep -E "passed|failed|^E  |^FAILED|graph nodes|split" $OUT/tests_s6a.txt | cut -c1-250 | tail -10
stamp replays
for fm in false true; do
  echo "--- fuse_attention_merge=$fm"
  ab --model smollm2-135m-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.fuse_attention_merge=$fm"
  ab --model llama-3.2-1b-shape --batch 1 --override "levers.graph_batch_sizes=[1]" "levers.fuse_attention_merge=$fm"
done
for sk in true false; do
  echo "--- cublaslt_split_k=$sk"
  ab --model llama-3-8b-shape --batch 32 --override "levers.graph_batch_sizes=[32]" "levers.cublaslt_split_k=$sk"
done
stamp "torch.compile peer, 8B B=32"
timeout 150 python3 -m bench.run_all --stage peers --out $OUT/raw --peer-jobs torch_decode:llama-3-8b-shape:32 \
    > $OUT/peer.txt 2>&1; echo "exit $?"; grep -E "tok_s" $OUT/peer.txt | cut -c1-200 | tail -2
stamp done

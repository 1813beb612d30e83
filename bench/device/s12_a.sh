#!/usr/bin/env bash
# Session 12, one call (carry .whl .snap): the top-p rows drawn from spans (levers.sampling_split with
# top-p): their GPU tests, the sampled steps' A/B, Engine.generate sampled beside greedy on two shapes,
# then the offline + Poisson serving stage (nano-vllm protocol, TTFT p99 at 16 req/s). ~8 minutes.
source "$(dirname "$0")/common.sh"
stamp "split sampling rows with top-p (GPU tests)"
gpu_tests split 200 -s tests/test_sampling_gpu.py -k "split or equal_reference"
grep -E "^V=|^top-p" "$OUT/tests_split.txt"
stamp "sampled steps, 1B: batch 1 and 32"
timeout 120 python3 -m bench.sampled_profile --model llama-3.2-1b-shape --batch 1 32 2>&1 | grep -E "tok/s|DevicePipeline" | head -16
for m in smollm2-135m-shape llama-3.2-1b-shape; do
  stamp "user_decode $m"
  timeout 100 python3 -m bench.user_decode --model $m --batch 1 32 --sampled --json $OUT/user_$m.json 2>&1 | grep user_decode
done
stamp "offline + Poisson"
timeout 240 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape \
    2>&1 | grep -E "^\[offline\]|oisson|TTFT" | cut -c1-400
stamp done

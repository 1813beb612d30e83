#!/usr/bin/env bash
# Session 10's follow-ups on the H200, one call (carry .whl .snap): the served 64 streams
# after the engine process's command reader took whole reads (TTFT p50 was 150 ms, 0.63 of the library),
# then where an offline forward's 3.67 ms goes (136-256 rows of ~1,000-token contexts: the offline run's
# median step; its KV bound is ~0.8 ms), the split sampling rows' GPU test, and the 1B shape's sampled
# steps at batch 1 and 32 (split on / off; batch 32 was 0.959 of replay) profiled. ~8 minutes.
source "$(dirname "$0")/common.sh"
stamp "served, 128 tokens"
TOKENS=128 bash "$(dirname "$0")/s8_serve.sh" 2>&1 | sed -n '/=== table/,$p'
stamp "offline-shaped decode step"
timeout 150 python3 -m bench.profile_step --model smollm2-135m-shape --batch 136 256 --context 1024 2>&1 | head -40
stamp "split sampling rows (levers.sampling_split, off until this passes)"
gpu_tests split 150 -s tests/test_sampling_gpu.py -k "split or equal_reference"
grep -E "^V=" "$OUT/tests_split.txt"
stamp "sampled steps, 1B: batch 1 and 32 (split A/B), batch 32 profiled"
timeout 150 python3 -m bench.sampled_profile --model llama-3.2-1b-shape --batch 1 32 --profile 2>&1 \
    | grep -E "sampled_profile|cProfile" | head -30
stamp done

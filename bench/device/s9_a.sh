#!/usr/bin/env bash
# Session 9, first call (carry .whl .snap): where sampled steps and a served first token spend
# their time. The three GPU tests s9_b failed (test fixes); bench.sampled_profile (greedy / T / T+top-p tok/s, the
# sampling pipeline's host and device time, cProfile of a sampled generate) on two shapes; the
# sampling kernels alone (bench.sampling_bench); one served stream's first token beside the
# engine's own (bench.ttft_probe) with the engine in its own process, short prefills graphed or not.
source "$(dirname "$0")/common.sh"
stamp "gpu tests fixed after s9_b"
gpu_tests s9a 150 tests/gpu/test_mixed_graphs_gpu.py::test_many_short_prompts_take_a_mixed_bucket \
    tests/test_sampling_gpu.py::test_engine_device_pipeline_equals_numpy_pipeline \
    tests/test_sampling_gpu.py::test_captured_sampling_equals_eager_launches
stamp "sampled profile"
timeout 150 python3 -m bench.sampled_profile --model smollm2-135m-shape --batch 1 32 --profile 2>&1 | grep -v "^\s*$" | head -150
timeout 100 python3 -m bench.sampled_profile --model llama-3.2-1b-shape --batch 1 2>&1 | grep sampled_profile
stamp "sampling kernels"
timeout 100 python3 -m bench.sampling_bench --batch 1 32 --vocab 49152 128256 --no-forward --out $OUT/sampling.json 2>&1 | tail -20
stamp "served first token"
PORT=8312
for mixed in true false; do     # false: short prefills run eagerly (the session-8 path)
  python3 -m metrale serve device=cuda model=smollm2-135m-shape server.port=$PORT levers.mixed_graphs=$mixed > $OUT/server_$mixed.txt 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  grep serving $OUT/server_$mixed.txt
  echo "--- levers.mixed_graphs=$mixed"
  timeout 60 python3 -m bench.ttft_probe --url http://127.0.0.1:$PORT --model smollm2-135m-shape --requests 20 --max-tokens 16
  timeout 60 python3 -m bench.ttft_probe --url http://127.0.0.1:$PORT --model smollm2-135m-shape --requests 10 --max-tokens 128
  kill -TERM $SPID; wait $SPID
done
stamp done

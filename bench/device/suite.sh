#!/usr/bin/env bash
# Named benchmark suites for the GPU machine: bash bench/device/suite.sh decode|serving|spec|peers|sweeps
# (carry .whl, and .snap for a committed tree; see README.md here). Each prints its table last and
# leaves raw JSON under $OUT.
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  decode)    # Engine.generate (loop ahead / synchronous, greedy and sampled) beside graph replay, three shapes, batch 1 and 32
    for m in smollm2-135m-shape llama-3.2-1b-shape llama-3-8b-shape; do
      timeout 200 python3 -m bench.user_decode --model $m --batch 1 32 --sampled --json $OUT/user_$m.json 2>&1 | grep user_decode
    done ;;
  serving)   # nano-vllm offline + Poisson, then the HTTP server as users run it
    timeout 240 python3 -m bench.run_all --stage offline --out $OUT/raw --models smollm2-135m-shape llama-3.2-1b-shape \
        2>&1 | grep -E "^\[offline\]"
    MODEL=smollm2-135m-shape bash "$(dirname "$0")/s7_b.sh" 2>&1 | grep -E "clients|tok/s|ITL|TTFT" ;;
  spec)      # the speculation benchmark with the real SmolLM2 (four calls: [.whl .snap] [.m1] [.m2] [.m3])
    bash "$(dirname "$0")/spec_h200.sh" ;;
  peers)     # torch.compile loop and HF generate on the same GPU
    timeout 500 python3 -m bench.run_all --stage peers --out $OUT/raw 2>&1 | tail -20 ;;
  sweeps)    # the pytest-benchmark lever sweeps on the SmolLM2 shape
    timeout 500 python3 -m pytest bench/ --benchmark-only -m gpu -k gpu -p no:cacheprovider -q \
        --benchmark-json $OUT/sweeps.json --bench-records $OUT/records 2>&1 | tail -40 ;;
  *) echo "usage: bash bench/device/suite.sh decode|serving|spec|peers|sweeps"; exit 2 ;;
esac

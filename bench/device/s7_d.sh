#!/usr/bin/env bash
# Session 7: the served step with the real SmolLM2 (carries: [.whl], [.m1], [.m2], [.m3], one a call):
# in-process (library stream beside the server on one engine), then `python -m metrale serve` in
# its own process with the loop thread profiled.
source "$(dirname "$0")/common.sh"
smollm2_ready || exit 0
stamp "in-process, real SmolLM2"
timeout 200 python3 -m bench.serve_profile device=cuda model=/tmp/mdl/smollm2.gguf --tokens 256 --clients 1 64 \
    2>&1 | grep -E "^(library|served)" | cut -c1-220
MODEL=/tmp/mdl/smollm2.gguf bash "$(dirname "$0")/s7_b.sh"

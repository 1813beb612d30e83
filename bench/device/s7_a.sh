#!/usr/bin/env bash
# Session 7, first call (carry .whl): where a served step's time goes on the H200.
# The library's stream() (main and worker thread) beside the in-process server, one engine,
# poll times and gaps, cProfile of the engine-loop thread at 1 client.
source "$(dirname "$0")/common.sh"
stamp "serve profile, SmolLM2 shape"
timeout 300 python3 -m bench.serve_profile device=cuda model=smollm2-135m-shape --tokens 256 --clients 1 64 \
    --profile ${PROFILE_ARGS:-} 2>&1 | tee $OUT/serve_profile.txt | grep -v "^$" | cut -c1-220 | tail -45
stamp done

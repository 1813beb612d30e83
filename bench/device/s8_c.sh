#!/usr/bin/env bash
# Session 8, third call (carry .whl .snap): what stalls the first token under Poisson arrivals, and
# levers.warm_mixed against it; each case a fresh process with a fresh kernel cache (a user's first run),
# then warm_mixed again on the cache it left (a second run); start-up of the 1B shape with it.
source "$(dirname "$0")/common.sh"
for m in smollm2-135m-shape llama-3.2-1b-shape; do
  for w in false true; do
    stamp "poisson $m warm_mixed=$w (fresh cache)"
    XDG_CACHE_HOME=$(mktemp -d) timeout 150 python3 -m bench.poisson_stalls --model $m --json $OUT/poisson_${m}_$w.json levers.warm_mixed=$w 2>&1 | grep -E "^poisson|Error"
  done
done
stamp "poisson SmolLM2 shape, warm_mixed, 64 req/s"
XDG_CACHE_HOME=/tmp/xc timeout 150 python3 -m bench.poisson_stalls --model smollm2-135m-shape --rate 64 --n 128 --json $OUT/poisson_64.json 2>&1 | grep -E "^poisson|Error"
stamp "again, same cache (second run)"
XDG_CACHE_HOME=/tmp/xc timeout 150 python3 -m bench.poisson_stalls --model smollm2-135m-shape --json $OUT/poisson_again.json 2>&1 | grep -E "^poisson|Error"
stamp "startup 1B with warm_mixed"
timeout 200 python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --json $OUT/startup_1b_warm.json 2>&1 | tail -3
stamp done

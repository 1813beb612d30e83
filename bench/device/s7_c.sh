#!/usr/bin/env bash
# Session 7: is the served path's per-chunk latency in the HTTP layer? The fake engine (1 ms steps,
# text in every delta) behind the in-process server, uvloop vs asyncio, 1 and 64 clients.
source "$(dirname "$0")/common.sh"
python3 -c "import uvloop, sys; print('uvloop', uvloop.__version__)" 2>&1 | tail -1
for lp in uvloop asyncio; do for c in 1 64; do
  echo "--- fake engine, 1 ms steps, $lp, $c clients"
  timeout 60 python3 -m bench.loadtest --fake --fake-step-ms 1 --uvicorn-loop $lp --clients $c --max-tokens 256 \
      --duration 4 2>&1 | tail -4
done; done

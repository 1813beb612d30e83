#!/usr/bin/env bash
# Session 7: the served step as users run it: `python -m metrale serve` in its own process
# (uvicorn in the main thread), bench.loadtest --url from another, the loop thread profiled.
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-smollm2-135m-shape}
stamp "server up ($MODEL)"
python3 -m bench.serve_profile --serve $OUT/served_profile.txt serve device=cuda model=$MODEL server.port=8311 \
    ${SERVE_ARGS:-} > $OUT/server_log.txt 2>&1 &
SPID=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8311/health >/dev/null && break; sleep 1; done
stamp "loadtest"
for c in 1 64; do
  echo "--- $c clients"
  timeout 120 python3 -m bench.loadtest --url http://127.0.0.1:8311 --model $MODEL --clients $c --requests $((c * 2)) \
      --max-tokens 256 --duration 60 --prompt-words 16 2>&1 | tail -4
done
kill -INT $SPID; wait $SPID
stamp "loop-thread profile"
cut -c1-200 $OUT/served_profile.txt | head -40
tail -5 $OUT/server_log.txt

#!/usr/bin/env bash
# Session 18: where the served engine process's time goes at 64 streams (issue 19: 0.76 of the
# library in session 18's s8_serve run, the engine process at 95% of a core): the server under
# bench.serve_profile --serve (its loop's polls timed and cProfiled in the engine process),
# bench.loadtest 64 clients x 4 requests x TOKENS tokens, then the report.
#   bash bench/device/s18_a.sh     (carry .whl with the server's wheels)
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-smollm2-135m-shape}
TOKENS=${TOKENS:-128}
PORT=8313
stamp "serve_profile --serve ($MODEL)"
python3 -m bench.serve_profile --serve $OUT/serve_prof.txt serve device=${DEVICE:-cuda} model=$MODEL \
    server.port=$PORT server.engine_process=true > $OUT/server_prof_log.txt 2>&1 &
SPID=$!
for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
    kill -0 $SPID 2>/dev/null || { echo "the server exited:"; tail -5 $OUT/server_prof_log.txt; exit 1; }; sleep 1; done
load() { timeout 150 python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model $MODEL --clients $1 \
    --requests $2 --max-tokens $3 --duration 90 --prompt-words 16 2>&1 | tail -4; }
load 64 64 32 > /dev/null
load 64 256 $TOKENS
kill -TERM $SPID; wait $SPID
for i in $(seq 1 20); do [ -s $OUT/serve_prof.txt ] && break; sleep 1; done
head -60 $OUT/serve_prof.txt
stamp done

#!/usr/bin/env bash
# Session 20: is the served engine process host-bound at 64 streams? s19_a's served and library
# runs, each poll recorded with the time it waited for the device's ids (wait_ms), then the
# engine's host time a step on this machine's CPU (bench.host_loop, library vs served loop).
#   bash bench/device/s20_a.sh     (carry .whl [.snap])
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-smollm2-135m-shape}
TOKENS=${TOKENS:-128}
PORT=8314
RES=$OUT/s20; mkdir -p $RES
load() { timeout 150 python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model $MODEL --clients $1 \
    --requests $2 --max-tokens $3 --duration 90 --prompt-words 16 "${@:4}" 2>&1 | tail -4; }
for v in ${VARIANTS:-default:}; do
  name=${v%%:*}; over=$(echo "${v#*:}" | tr ',' ' ')
  stamp "serve $name ($over)"
  python3 -m bench.serve_profile --serve-trace $RES/$name.txt serve device=cuda model=$MODEL \
      server.port=$PORT server.engine_process=true $over > $RES/server_$name.txt 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
      kill -0 $SPID 2>/dev/null || { echo "the server exited:"; tail -5 $RES/server_$name.txt; break; }; sleep 1; done
  load 64 64 32 > /dev/null
  load 1 2 32 > /dev/null
  load 64 256 $TOKENS --server-pid $SPID --json $RES/serve_$name.json
  load 1 4 $TOKENS --server-pid $SPID --json $RES/serve_${name}_1.json
  kill -TERM $SPID; wait $SPID
  for i in $(seq 1 20); do [ -s $RES/$name.txt ] && break; sleep 1; done
  head -1 $RES/$name.txt
done
stamp "library"
for c in 64 1; do
  timeout 150 python3 -m bench.loadtest --library model=$MODEL device=cuda ${LIB_OVER:-} --clients $c \
      --requests $((c * 4)) --max-tokens $TOKENS --prompt-words 16 --json $RES/library_$c.json \
      --trace $RES/library_$c.jsonl 2>&1 | head -1
done
stamp "host loop"
for i in 1 2; do
  python3 -m bench.host_loop --batch 64 --tokens 128 --ahead 2>&1 | tail -1
  python3 -m bench.host_loop --batch 64 --tokens 128 --ahead --served 2>&1 | tail -1
done
python3 -m bench.host_loop --batch 64 --tokens 128 --ahead --served --profile > $RES/host_loop_profile.txt 2>&1
stamp end

#!/usr/bin/env bash
# Session 19: where a 64-stream wave's first token goes (issue 19: served 0.76-0.79 of the library
# at 64 streams, the loss in TTFT). The server under bench.serve_profile --serve-trace (every poll
# of the engine process recorded) at 64 clients x 4 requests x TOKENS tokens, for each lever
# setting in VARIANTS ("name:overrides,comma,separated"), then Engine.generate at batch 64 on the
# same prompts; then 1 stream and batch 1 the same way. Traces and JSON in $OUT/s19/.
#   bash bench/device/s19_a.sh     (carry .whl: the base and the server wheels; TESTS="tests/gpu/..." adds GPU tests)
#   python -m bench.wave_timeline $OUT/s19/default.txt.jsonl $OUT/s19/timeline_default.json  (here, after)
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-smollm2-135m-shape}
TOKENS=${TOKENS:-128}
PORT=8314
RES=$OUT/s19; mkdir -p $RES
load() { timeout 150 python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model $MODEL --clients $1 \
    --requests $2 --max-tokens $3 --duration 90 --prompt-words 16 "${@:4}" 2>&1 | tail -4; }
for v in ${VARIANTS:-default:}; do
  name=${v%%:*}; over=$(echo "${v#*:}" | tr ',' ' ')
  stamp "serve $name ($over)"
  python3 -m bench.serve_profile --serve-trace $RES/$name.txt serve device=${DEVICE:-cuda} model=$MODEL \
      server.port=$PORT server.engine_process=true $over > $RES/server_$name.txt 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
      kill -0 $SPID 2>/dev/null || { echo "the server exited:"; tail -5 $RES/server_$name.txt; break; }; sleep 1; done
  load 64 64 32 > /dev/null
  load 1 2 32 > /dev/null
  load 64 256 $TOKENS --server-pid $SPID --json $RES/serve_$name.json --timeline $RES/timeline_$name.json
  load 1 4 $TOKENS --server-pid $SPID --json $RES/serve_${name}_1.json
  kill -TERM $SPID; wait $SPID
  for i in $(seq 1 20); do [ -s $RES/$name.txt ] && break; sleep 1; done
  head -1 $RES/$name.txt
done
stamp "library"
for c in 64 1; do      # bench.loadtest's library mode: Engine.generate on the same prompts, c at a time
  timeout 150 python3 -m bench.loadtest --library model=$MODEL device=${DEVICE:-cuda} --clients $c \
      --requests $((c * 4)) --max-tokens $TOKENS --prompt-words 16 --json $RES/library_$c.json 2>&1 | head -1
done

if [ -n "${TESTS:-}" ]; then
  stamp "GPU tests: $TESTS"
  gpu_tests s19 ${TESTS_LIMIT:-240} $TESTS
fi
stamp end

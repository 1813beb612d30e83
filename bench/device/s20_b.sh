#!/usr/bin/env bash
# Session 20: why the served engine process is sometimes host-bound at 64 streams (s20_a: steps of
# 1.6-2.1 ms with no wait for the device, the library's 1.18). The served run of s20_a, RUNS times
# (run-to-run spread), then with the engine decoding every request's text (server.decode_in_server=false),
# with the GIL switch interval at Python's default 5 ms instead of the
# engine process's 1 ms, then with the server and engine processes pinned to two physical cores and
# the client to two others; each with every thread's CPU (bench.loadtest --server-pid).
#   bash bench/device/s20_b.sh     (carry .whl [.snap])
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-smollm2-135m-shape}
TOKENS=${TOKENS:-128}
PORT=8314
RES=$OUT/s20b; mkdir -p $RES
load() { timeout 150 ${CLIENT_PIN:-} python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model $MODEL --clients $1 \
    --requests $2 --max-tokens $3 --duration 90 --prompt-words 16 "${@:4}" 2>&1 | tail -4; }
serve() {   # NAME [ENV=VALUE [OVERRIDE ...]]: one server, warmed, measured at 64 streams twice
  local name=$1 envs=${2:-X=}; local over="${*:3}"; stamp "serve $name ${2:-} $over"
  env $envs ${PIN:-} python3 -m bench.serve_profile --serve-trace $RES/$name.txt serve device=cuda model=$MODEL \
      server.port=$PORT server.engine_process=true $over > $RES/server_$name.txt 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
      kill -0 $SPID 2>/dev/null || { echo "the server exited:"; tail -5 $RES/server_$name.txt; break; }; sleep 1; done
  load 64 64 32 > /dev/null
  load 64 256 $TOKENS --server-pid $SPID --json $RES/serve_${name}_a.json | head -1
  load 64 256 $TOKENS --server-pid $SPID --json $RES/serve_${name}_b.json | head -1
  kill -TERM $SPID; wait $SPID
  for i in $(seq 1 20); do [ -s $RES/$name.txt ] && break; sleep 1; done
}
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|CPU max)" ; nproc
# one logical CPU of each physical core, in order: PIN_SERVER (2 cores) for the server and its engine
# process, PIN_CLIENT (2 others) for the load generator
read PIN_SERVER PIN_CLIENT < <(python3 - <<'PY'
import glob, os
first = {}
for d in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda p: int(p.rsplit("cpu", 1)[1])):
    cpu = int(d.rsplit("cpu", 1)[1])
    try:
        key = (open(d + "/topology/physical_package_id").read().strip(), open(d + "/topology/core_id").read().strip())
    except OSError:
        continue
    if cpu in os.sched_getaffinity(0):
        first.setdefault(key, cpu)
c = list(first.values())
print(f"{c[0]},{c[1]}", f"{c[2]},{c[3]}" if len(c) > 3 else f"{c[-1]}")
PY
)
echo "physical-core pins: server+engine $PIN_SERVER, client $PIN_CLIENT"
for r in $(seq 1 ${RUNS:-2}); do serve default$r; done
serve engine_text X= server.decode_in_server=false
if [ -z "${NO_EXTRA:-}" ]; then     # NO_EXTRA=1: only the default and engine_text servers
serve switch5ms BENCH_SWITCH_INTERVAL=0.005
PIN="taskset -c $PIN_SERVER" CLIENT_PIN="taskset -c $PIN_CLIENT" serve pinned
fi
stamp "library"
timeout 150 python3 -m bench.loadtest --library model=$MODEL device=cuda --clients 64 --requests 256 \
    --max-tokens $TOKENS --prompt-words 16 --json $RES/library_64.json --trace $RES/library_64.jsonl 2>&1 | head -1
python3 - $RES <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/serve_*.json")):
    d = json.load(open(f)); th = d.get("thread_cpu_s", {})
    print(f.split("/")[-1], round(d["out_tok_per_s"]), "engine us/tok", round(d.get("engine_cpu_us_per_token", 0), 1),
          "threads:", list(th.items())[:6])
PY
stamp end

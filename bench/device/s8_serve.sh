#!/usr/bin/env bash
# Session 8: the served path in both modes beside the library, one run: `python -m metrale serve`
# with server.engine_process=true (the engine in its own process) and =false (a thread of the
# server's), bench.loadtest --url from another process at 1 and 64 streams (greedy, ignore_eos,
# TOKENS tokens, warm: each shape served once before), the CPU per token of the server and engine
# processes, then Engine.generate on the same prompts in batches of 1 and 64 (bench.loadtest's
# library mode). Prints a table; JSON per point in $OUT/s8_serve/.
#   bash bench/device/s8_serve.sh     (carry .whl .snap; MODEL=..., TOKENS=..., MODES="true false", DEVICE=cpu to try it here, SERVE_ARGS=...)
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-smollm2-135m-shape}
DEVICE=${DEVICE:-cuda}
TOKENS=${TOKENS:-256}
PORT=8312
RES=$OUT/s8_serve
mkdir -p $RES
load() {  # load CLIENTS REQUESTS MAX_TOKENS [extra loadtest args]
  timeout 150 python3 -m bench.loadtest --url http://127.0.0.1:$PORT --model $MODEL --clients $1 --requests $2 \
      --max-tokens $3 --duration 90 --prompt-words 16 "${@:4}" 2>&1
}
for mode in ${MODES:-true false}; do
  stamp "serve server.engine_process=$mode ($MODEL)"
  python3 -m metrale serve device=$DEVICE model=$MODEL server.port=$PORT server.engine_process=$mode \
      ${SERVE_ARGS:-} > $RES/server_$mode.txt 2>&1 &
  SPID=$!
  up=0
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && { up=1; break; }; sleep 1; done
  if [ $up != 1 ]; then echo "the server did not come up"; tail -5 $RES/server_$mode.txt; kill -9 $SPID; continue; fi
  grep "serving" $RES/server_$mode.txt
  EPID=$(sed -n 's/.*engine process \([0-9]*\).*/\1/p' $RES/server_$mode.txt | head -1)
  for c in 1 64; do load $c $c 32 > /dev/null; done           # warm-up: compiles, graph captures
  for c in 1 64; do
    echo "--- engine_process=$mode, $c stream(s)"
    load $c $((c * 4)) $TOKENS --server-pid $SPID --json $RES/serve_${mode}_$c.json | tail -5
  done
  kill -TERM $SPID; wait $SPID; echo "server exit status $?"
  if [ -n "$EPID" ] && kill -0 $EPID 2>/dev/null; then echo "WARNING: engine process $EPID outlived its server"; kill -9 $EPID; fi
done
stamp "library: Engine.generate, same prompts"
timeout 300 python3 - "$MODEL" "$TOKENS" "$RES" "$DEVICE" <<'EOF'
import json, sys
from bench.loadtest import run_library, summarize
from metrale import Engine
model, tokens, res, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
engine = Engine(model=model, device=device)
for c in (1, 64):
    stats, wall = run_library(engine, clients=c, requests=c * 4, max_tokens=tokens, prompt_words=16)
    s = summarize(stats, wall)
    print(f"--- library, batch {c}: {s['out_tok_per_s']:.0f} tok/s ({s['requests']} requests in {wall:.2f} s)")
    json.dump({"clients": c, "library": True, **s}, open(f"{res}/library_{c}.json", "w"), indent=1)
EOF
stamp "table"
python3 - "$RES" <<'EOF'
import json, os, sys
res = sys.argv[1]
def get(name):
    path = os.path.join(res, name)
    return json.load(open(path)) if os.path.exists(path) else None
print(f"{'path':28} {'streams':>7} {'tok/s':>8} {'/library':>8} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
      f"{'server us/tok':>13} {'engine us/tok':>13}")
for c in (1, 64):
    lib = get(f"library_{c}.json")
    rows = [("Engine.generate", lib)] + [(f"serve engine_process={m}", get(f"serve_{m}_{c}.json")) for m in ("true", "false")]
    for name, r in rows:
        if r is None:
            print(f"{name:28} {c:>7} {'(no result)':>8}")
            continue
        ratio = r["out_tok_per_s"] / lib["out_tok_per_s"] if lib else float("nan")
        print(f"{name:28} {c:>7} {r['out_tok_per_s']:>8.0f} {ratio:>8.2f} {r['ttft_p50_ms']:>7.1f}ms "
              f"{r['itl_p50_ms']:>6.2f}ms {r['itl_p99_ms']:>6.2f}ms {r.get('server_cpu_us_per_token', float('nan')):>13.1f} "
              f"{r.get('engine_cpu_us_per_token', float('nan')):>13.1f}")
EOF
stamp done

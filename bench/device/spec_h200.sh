#!/usr/bin/env bash
# Speculative decoding on the H200 with the real SmolLM2-135M-Instruct (issue 6: the gate keeps the
# worst case within 3% of plain decode). One script for every call of the warm window; each call
# does what its carries allow (a call holds 64 MiB: the ~21 MB tree + one carry):
#   carry [".whl", ".snap"]   packages (if /tmp/site is not installed yet), the committed tree
#   carry [".m1"], then [".m2"]                                   SmolLM2 parts into /tmp/mdl
#   carry [".m3"]             join, sha256, then the runs below (~3-5 min)
# Methods ngram self draft mtp (dflash drafts on the NumPy backend only), batch 1 and 32, both
# tasks; plain decode re-run before every rep. Settings (environment):
#   RUNS="tokens:reps:timeout_s ..."   request lengths (default "256:5:260 64:5:150")
#   TESTS="<pytest -k expression>"     GPU tests of tests/gpu/ with the real model first (default none)
#   FORCED=1                           also a 64-token run with the gate forced open (acceptance)
#   METHODS="ngram ..."                the drafters (default: ngram self draft mtp)
source "$(dirname "$0")/common.sh"
smollm2_ready || exit 0
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing, carry .whl"; exit 3; }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,utilization.gpu --format=csv,noheader 2>/dev/null
if [ -n "${TESTS:-}" ]; then
  stamp "GPU tests with the real SmolLM2: $TESTS"
  timeout 120 python3 -m pytest -q -m gpu -p no:warnings tests/gpu -k "$TESTS" > $OUT/tests_spec.txt 2>&1
  grep -E "passed|failed|^E  |^FAILED" $OUT/tests_spec.txt | cut -c1-250 | tail -6
fi
bench() {   # tokens reps timeout name [extra spec_bench arguments]
  local n=$1 reps=$2 limit=$3 name=$4; shift 4
  stamp "spec $name: max_tokens=$n reps=$reps"
  timeout $limit python3 -m bench.spec_bench --device cuda --model /tmp/mdl/smollm2.gguf --batch 1 32 --max-tokens $n \
      --reps $reps --methods ${METHODS:-ngram self draft mtp} --tasks repetitive open_chat "$@" \
      --out $OUT/spec_$name.json --records $OUT/spec_records_$name.json > $OUT/spec_$name.txt 2>&1
  echo "exit $?"; grep -E "Error|error|Traceback" $OUT/spec_$name.txt | cut -c1-200 | tail -4
}
tables=()
for run in ${RUNS:-256:5:260 64:5:150}; do
  IFS=: read -r n reps limit <<< "$run"
  bench $n $reps $limit $n
  tables+=($OUT/spec_$n.json)
done
if [ "${FORCED:-0}" = 1 ]; then
  bench 64 1 150 forced --lever spec_verify_cost=0 --lever spec_measured_gate=off --lever spec_draft_cost=0  # old names: settings.RENAMED
  grep -E "speedup" $OUT/spec_forced.txt | cut -c1-200 | tail -20
fi
stamp table
python3 - "${tables[@]}" <<'PY'
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"{path}: missing"); continue
    d = json.load(open(path))
    rows = sorted(d["results"], key=lambda r: (r["task"], r["batch"], r["method"]))
    print(f"max_tokens {d['max_tokens']}, reps {d['reps']}, {d['gpu']}, {d['wall_s']:.0f} s")
    print(f"{'task':10s} {'B':>3s} {'method':6s} {'plain':>8s} {'spec':>8s} {'speedup':>7s} {'paired':>7s} {'95% CI':>11s} {'tok/vf':>6s} {'verifies':>8s} same")
    for r in rows:
        ok, ci = r["lossless"], r.get("paired_ci95", (0, 0, 0))
        print(f"{r['task']:10s} {r['batch']:3d} {r['method']:6s} {r['plain_tok_s']:8.0f} {r['tok_s']:8.0f} "
              f"{r['speedup']:6.2f}x {r.get('paired_speedup', r['speedup']):6.2f}x {ci[1]:5.2f}-{ci[2]:5.2f} "
              f"{r['tokens_per_verify'] or 0:6.2f} {r['verifies']:8d} {ok['identical']}/{ok['sequences']}")
    w = min(rows, key=lambda r: r["speedup"])
    print(f"worst cell: {w['method']} {w['task']} B={w['batch']} {w['speedup']:.3f}x; every cell within 3%: "
          f"{all(r['speedup'] >= 0.97 for r in rows)}; gate (open chat, largest B): {d['gate_worst_case']}")
PY
stamp done

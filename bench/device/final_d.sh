#!/usr/bin/env bash
# Final device run, call D: metrale decode/prefill sweeps (3 shapes) and the offline + Poisson serving bench.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
L=""; [ -f /tmp/flash_decode_ok ] && L="--lever decode_attention_kernel=mma" && echo "with the tensor-core decode attention"
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp metrale
timeout 230 python3 -m bench.run_all --stage metrale --out $OUT/raw $L 2>&1 | grep "\[metrale\]"
stamp offline
timeout 300 python3 -m bench.run_all --stage offline --out $OUT/raw --copy-tb-s 4.23 $L 2>&1 | grep -E "\[offline\]|\[poisson\]|Error|error" | tail -12
stamp done

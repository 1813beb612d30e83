#!/usr/bin/env bash
# Final device run, call N2 (carry .snap; warm machine): offline + Poisson serving, then the peers.
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
L=""; [ -f /tmp/flash_decode_ok ] && L="--lever decode_attention_kernel=mma"
stamp offline
timeout 180 python3 -m bench.run_all --stage offline --out $OUT/raw --copy-tb-s 4.23 $L 2>&1 | grep -E "\[offline\]|Error" | tail -8
stamp peers
timeout 120 python3 -m bench.run_all --stage peers --out $OUT/raw --peer-jobs hf_offline:llama-3.2-1b-shape:32 2>&1 | grep "\[peers\]" | cut -c1-400
stamp done

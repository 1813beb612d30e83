#!/usr/bin/env bash
# Session 3, call B (warm machine from s3_a; carry .snap): Nsight Compute per-kernel time and DRAM bytes
# of one decode graph replay: Llama-3-8B shape at B = 32 and B = 1, SmolLM2 shape at B = 1 (PDL off:
# ncu serializes the nodes anyway).
set -u
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
export PATH=$PATH:/usr/local/cuda/bin
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
G="levers.graph_batch_sizes=[1,32]"
for spec in "llama-3-8b-shape 32" "llama-3-8b-shape 1" "smollm2-135m-shape 1"; do
  set -- $spec; m=$1; b=$2
  stamp "ncu $m B=$b"
  timeout 200 ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes.sum \
      --csv --log-file $OUT/ncu_${m}_b$b.csv python3 -m bench.profile_graph --model $m --batch $b \
      --override "$G" levers.pdl=false 2>&1 | grep -E "replay|profiled|Error|error" | tail -4
  python3 -m bench.profile_graph --summarize $OUT/ncu_${m}_b$b.csv | head -24
done
stamp done

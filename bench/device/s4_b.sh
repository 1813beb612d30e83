#!/usr/bin/env bash
# Session 4, call B (warm after A): offline serving with levers.mixed_graphs on and off, then the
# backend GPU tests with the lever on.
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
for m in true false; do
  stamp offline_mixed_$m
  timeout 200 python3 -m bench.run_all --stage offline --out $OUT/raw_$m --copy-tb-s 4.23 --lever mixed_graphs=$m \
      2>&1 | grep -E "\[offline\]|Error|mixed" | cut -c1-300 | tail -8
done
stamp mixed_backend_tests
timeout 150 python3 -m pytest -q -m gpu -p no:warnings -p tests.gpu.mixed_graphs_on tests/gpu/test_cuda_backend_gpu.py \
    > $OUT/mixed_backend.txt 2>&1; grep -E "passed|failed|^E  |^FAILED" $OUT/mixed_backend.txt | cut -c1-250 | tail -8
stamp done

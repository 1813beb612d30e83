#!/usr/bin/env bash
# Final device run, call E: the peers a Python user would pick (torch.compile loop, HF generate), ceilings.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing"; exit 3; }
timeout 240 python3 -m bench.run_all --stage peers --out $OUT/raw --peer-jobs torch_decode:llama-3-8b-shape:32 \
   torch_decode:llama-3-8b-shape:1 hf_offline:llama-3.2-1b-shape:32 2>&1 | grep "\[peers\]" | cut -c1-400

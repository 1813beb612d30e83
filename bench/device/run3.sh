#!/usr/bin/env bash
# Device call: decode attention geometry/split sweep; 8B and SmolLM2 decode after the gemv table.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp attention
timeout 200 python3 bench/kernels_bench.py --batches 1,32,128 --contexts 512,1024 --prefill 0 --sweep --json $OUT/attn.json > $OUT/attn.txt 2>&1
grep -i copy $OUT/attn.txt | head -3
python3 - $OUT/attn.txt <<'PY'
import re, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"decode\s+B=(\d+)\s+ctx=(\d+)\s+parts=(\d+)(.*?):\s+([\d.]+) us", line)
    if m:
        rows[(int(m[1]), int(m[2]))].append((float(m[5]), m[3], m[4].strip()))
for key, r in sorted(rows.items()):
    print(key, "default:", r[0], "| best:", sorted(r)[:4])
PY
stamp decode
timeout 100 python3 -m bench.decode_metrale --model llama-3-8b-shape --batch 1 32 2>&1 | grep -E "decode"
timeout 60 python3 -m bench.decode_metrale --model smollm2-135m-shape --batch 1 2>&1 | grep -E "decode"
stamp done

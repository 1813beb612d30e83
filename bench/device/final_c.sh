#!/usr/bin/env bash
# Final device run, call C (carry .m3 and .snap; A and B within the warm window): join SmolLM2, the
# real-weight GPU test, the speculative-decoding bench, real-weight decode. Runs the committed tree
# from .snap (helpers' uncommitted edits in the working copy must not leak into measurements).
[ -f /tmp/mdl/smolpart.ab ] || { echo "FRESH MACHINE: redo calls A and B"; exit 3; }
cat /tmp/mdl/smolpart.aa /tmp/mdl/smolpart.ab .m3/smolpart.ac > /tmp/mdl/smollm2.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/mdl/smollm2.gguf" | sha256sum -c || exit 4
rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src && cd /tmp/src || exit 5
export PYTHONPATH=/tmp/site:/tmp/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
stamp verify_graph_test
timeout 60 python3 -m pytest -q -m gpu -p no:warnings tests/gpu/test_cuda_backend_gpu.py -k "verify_blocks or ragged_decode" 2>&1 | tail -2
stamp spec
timeout 210 python3 -m bench.spec_bench --device cuda --model /tmp/mdl/smollm2.gguf --batch 1 32 --max-tokens 64 \
   --reps 1 --out $OUT/spec.json --records $OUT/spec_records.json > $OUT/spec.txt 2>&1; grep "\[spec\]" $OUT/spec.txt | grep -v elapsed | cut -c1-200 | tail -40
stamp done

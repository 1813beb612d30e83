#!/usr/bin/env bash
# Device call (kind nvidia-h200-x2, carry [".whl"] with nccl4py-0.6.0 in it; run timeout_s 420):
# issue 10's expert parallelism over NCCL, one process per GPU (python -m bench.ep_bench):
#   ready   each rank's GPU, the libnccl nccl4py loaded, a smoke all_to_all_v checked
#   tokens  EP=2 greedy tokens of the tiny DeepSeek == each rank's prompts on its GPU alone
#   rates   V2-Lite-shaped MoE decode tok/s at batch 1 and 64, 2 GPUs EP vs 1 GPU
# each printed as it arrives. Back under $OUT: log.txt (everything printed), ep_raw.json (every
# rank message), deepseek_ep.json (records), nccl.<pid>.log (NCCL_DEBUG=INFO of each rank).
# Nothing waits for ever: ep_bench stops 10 s after a rank fails, after 150 s without a message
# from any rank, or at 300 s; `timeout 330` backs it.
set -u -o pipefail
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
    --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8
export NCCL_NVLS_ENABLE=0            # NVLink multicast stays off on this shared host (KINDS.md)
stamp diagnostics
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.used,memory.total --format=csv
nvidia-smi topo -m 2>&1 | head -8
df -h /dev/shm | tail -1
check() {
python3 - <<'PY'
import importlib.metadata as md, sys
print(sys.executable, sys.version.split()[0])
for d in ("numpy", "numba-cuda", "cuda-core", "cuda-bindings", "cuda-pathfinder", "nccl4py", "nvidia-nccl-cu13"):
    try:
        print(f"  {d:17s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"  {d:17s} MISSING")
try:
    import nccl.core as nccl
    print("  libnccl:", nccl.get_version().libnccl, "| unique id of", len(nccl.get_unique_id().as_bytes), "bytes")
except Exception as e:
    print("  nccl4py could not load libnccl:", repr(e))
    sys.exit(3)
PY
}
if ! check; then                     # cuda.pathfinder looks in the interpreter's site-packages only
    lib=$(python3 -c 'import glob, site, sys
for d in site.getsitepackages() + sys.path:
    for f in glob.glob(d + "/nvidia/nccl/lib/libnccl.so.2*"):
        print(f); raise SystemExit' 2>/dev/null)
    [ -n "$lib" ] || lib=$(find /opt /usr /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -1)
    echo "libnccl found at: ${lib:-nowhere}"
    [ -n "$lib" ] || exit 1
    export LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    check || exit 1
fi
export NCCL_DEBUG=INFO NCCL_DEBUG_FILE=$OUT/nccl.%p.log    # one file per rank (pid)
stamp ep_bench
timeout 330 python3 -m bench.ep_bench --out $OUT/deepseek_ep.json --raw $OUT/ep_raw.json \
    --timeout 300 --stall 150 2>&1 | tee $OUT/log.txt
rc=$?
stamp "ep_bench rc=$rc"
grep -h "WARN" $OUT/nccl.*.log 2>/dev/null | head -20
grep -h -m1 -E "NCCL version" $OUT/nccl.*.log 2>/dev/null | head -2
grep -h -E "via (P2P|SHM|NET)|Channel 00" $OUT/nccl.*.log 2>/dev/null | head -4
exit $rc

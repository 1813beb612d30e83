# Sourced by the device scripts (bash bench/device/<script>.sh on the GPU machine): the packages
# from a carried .whl into /tmp/site (once per warm machine), the committed tree from a carried
# .snap/src.tar.gz into /tmp/src (run from there: no helper edit of the working tree can leak in),
# the environment, and `stamp` (elapsed seconds). Without a .snap, an earlier call's /tmp/src or
# else the working tree runs.
set -u
t0=$(date +%s); stamp() { echo "=== $1 at $(( $(date +%s) - t0 )) s"; }
whl_id=$(ls .whl 2>/dev/null | md5sum | cut -c1-12)
if [ ! -f /tmp/site/.whl_$whl_id ] && ls .whl/*.whl >/dev/null 2>&1; then
  stamp install
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation \
      --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null || exit 1
  touch /tmp/site/.whl_$whl_id
fi
if [ -f .snap/src.tar.gz ]; then
  rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .snap/src.tar.gz -C /tmp/src || exit 5
  sha256sum .snap/src.tar.gz | cut -c1-16 > /tmp/src/.snap_id
fi
# SmolLM2 parts (carried as .m1 .m2 .m3, one a call) collect in /tmp/mdl
mkdir -p /tmp/mdl
for p in .m1/smolpart.aa .m2/smolpart.ab .m3/smolpart.ac; do [ -f "$p" ] && cp "$p" /tmp/mdl/; done
if [ -f /tmp/src/.snap_id ]; then
  cd /tmp/src || exit 5; echo "running the committed tree (.snap $(cat .snap_id))"
else
  echo "running the working tree (no .snap)"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OPENBLAS_NUM_THREADS=8

# The real SmolLM2 GGUF at /tmp/mdl/smollm2.gguf once all three parts arrived: 0; else 1 (says
# which carry comes next).
smollm2_ready() {
  if [ ! -f /tmp/mdl/smollm2.gguf ]; then
    for p in aa ab ac; do
      [ -f /tmp/mdl/smolpart.$p ] || { echo "SmolLM2 parts so far: $(ls /tmp/mdl | tr '\n' ' '); carry the next of .m1 .m2 .m3"; return 1; }
    done
    cat /tmp/mdl/smolpart.aa /tmp/mdl/smolpart.ab /tmp/mdl/smolpart.ac > /tmp/mdl/smollm2.gguf
  fi
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/mdl/smollm2.gguf" | sha256sum -c || {
    rm -f /tmp/mdl/smollm2.gguf; return 1; }
}

# One graph-replay timing (bench.profile_graph --time-only, context 512; arguments: --model ...
# --batch ... --override ...): its replay lines, or the error.
ab() { timeout ${AB_LIMIT:-90} python3 -m bench.profile_graph --time-only --context 512 "$@" 2>&1 \
    | grep -E "replay|Error|error" | cut -c1-200 | tail -3; }

# gpu_tests NAME LIMIT_S PYTEST_ARGS...: the GPU tests into $OUT/tests_NAME.txt, their summary printed.
gpu_tests() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -m gpu -p no:warnings "$@" > "$OUT/tests_$name.txt" 2>&1
  grep -E "passed|failed|^E  |^FAILED|graph nodes" "$OUT/tests_$name.txt" | cut -c1-250 | tail -8
}

# nccl4py loads a libnccl (two-GPU scripts): 0, with LD_LIBRARY_PATH pointed at a libnccl.so.2 found
# in site-packages or under /opt /usr when cuda.pathfinder's search missed it; else 1.
nccl_ready() {
  local probe='import nccl.core as n; print("  nccl4py", n.__version__, "libnccl", n.get_version().libnccl)'
  python3 -c "$probe" 2>/dev/null && return 0
  local lib
  lib=$(python3 -c 'import glob, site, sys
for d in site.getsitepackages() + sys.path:
    for f in glob.glob(d + "/nvidia/nccl/lib/libnccl.so.2*"):
        print(f); raise SystemExit' 2>/dev/null)
  [ -n "$lib" ] || lib=$(find /opt /usr /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -1)
  echo "libnccl found at: ${lib:-nowhere}"
  [ -n "$lib" ] || return 1
  export LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  python3 -c "$probe"
}

#!/usr/bin/env bash
# The whole GPU suite in one call (issue 18's "the GPU tests pass on the H200"): carry .whl, then
# .m1, .m2, .m3 (the real SmolLM2 for the tests that read it), from the working tree (the MTP and
# DFlash assets with it: no .snap). Each call does what its carries allow; the last runs the tests.
source "$(dirname "$0")/common.sh"
smollm2_ready || exit 0
[ -d /tmp/site/hydra ] || { echo "FRESH MACHINE: packages missing, carry .whl"; exit 3; }
stamp "tests/gpu"
timeout ${LIMIT:-560} python3 -m pytest -q -m gpu -p no:warnings -p no:cacheprovider ${FILES:-tests/gpu} ${PYTEST_ARGS:-} \
    --durations=12 > $OUT/tests_gpu.txt 2>&1
echo "exit $?"
grep -E "passed|failed|error|^FAILED|^ERROR" $OUT/tests_gpu.txt | cut -c1-250 | tail -25
stamp done

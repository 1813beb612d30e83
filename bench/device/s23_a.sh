#!/usr/bin/env bash
# Session 23, call a (carry .whl .snap): every pending single-GPU check in one lease, most important
# first: levers.compile_workers' GPU test, the 1B start-up with 8 workers (first and second start),
# the MTP head on the device (its test needs metrale/assets: copied from the carried working tree
# into the snapshot), then the FP8 GEMV's test and the 8B FP8 decode.
here=$PWD
source "$(dirname "$0")/common.sh"
[ -d "$here/metrale/assets" ] && [ "$PWD" != "$here" ] && cp -r "$here/metrale/assets" metrale/
RES=$OUT/s23a; mkdir -p $RES
stamp "precompile GPU test"
timeout ${PRE_S:-150} python3 -m pytest -q -x -s tests/gpu/test_precompile_gpu.py -p no:cacheprovider > $RES/precompile.txt 2>&1
grep -E "first start|passed|failed|Error|assert" $RES/precompile.txt | cut -c1-600 | head -20
stamp "startup workers 8"
timeout ${START_S:-80} python3 -m bench.startup --model llama-3.2-1b-shape --device cuda --runs 2 --levers '{"compile_workers": 8}' > $RES/startup.txt 2>&1
grep -E "^startup|Error" $RES/startup.txt | cut -c1-400
stamp "mtp device head GPU test"
timeout ${MTP_S:-200} python3 -m pytest -q -x -s tests/gpu/test_mtp_cuda_gpu.py -p no:cacheprovider > $RES/mtp.txt 2>&1
grep -vE "^\s*$" $RES/mtp.txt | cut -c1-300 | tail -30
stamp "fp8 gemv GPU test"
timeout ${FP8T_S:-60} python3 -m pytest -q -x tests/gpu/test_quant_gpu.py -k fp8_gemv -p no:cacheprovider > $RES/fp8_test.txt 2>&1
tail -2 $RES/fp8_test.txt
stamp "fp8 decode"
timeout ${FP8D_S:-90} python3 -m bench.quant_decode --fp8 --batch 1 2 4 8 32 > $RES/fp8_decode.txt 2>&1
grep -E "^decode|Error" $RES/fp8_decode.txt | cut -c1-200
stamp end

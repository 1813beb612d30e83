#!/usr/bin/env bash
# Session 21, call a: the served A/B of server.decode_in_server (s20_b.sh with the default and
# engine_text servers only, the library beside), then where a first and a second start of the 1B
# shape spend their seconds (bench.startup_profile).
#   bash bench/device/s21_a.sh     (carry .whl .snap)
source "$(dirname "$0")/common.sh"
NO_EXTRA=1 RUNS=${RUNS:-2} bash bench/device/s20_b.sh 2>&1 | grep -v "^   " | tail -40
stamp "startup profile"
mkdir -p $OUT/s21a
timeout 240 python3 -m bench.startup_profile --model llama-3.2-1b-shape --device cuda --json $OUT/s21a/startup.json \
    --profile-lines 45 2>&1 | tail -150
stamp end

#!/usr/bin/env bash
# Session 5, second speculation run (after the fixed-point norm sums: reproducible batch-1 decoding;
# the incremental n-gram index): 5 reps at both lengths; see spec_h200.sh.
RUNS=${RUNS:-"256:5:260 64:5:150"} TESTS=${TESTS:-"reproducible or real_smollm2"} \
    exec bash "$(dirname "$0")/spec_h200.sh"

#!/usr/bin/env bash
# Session 5, first speculation run: the real-model drafter / greedy GPU tests, 64 and 256 tokens, and
# a 64-token run with the gate forced open (every drafter's acceptance); see spec_h200.sh.
RUNS=${RUNS:-"64:5:170 256:3:210"} TESTS=${TESTS:-"drafter or real_smollm2"} FORCED=${FORCED:-1} \
    exec bash "$(dirname "$0")/spec_h200.sh"

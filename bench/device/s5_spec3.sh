#!/usr/bin/env bash
# Session 5, third speculation run (after the measured gate's 5% margin and 4-step minimum, cuBLASLt
# tuning only the graph ladder). REPS=10 for a tighter paired_ci95; see spec_h200.sh.
REPS=${REPS:-5}
RUNS=${RUNS:-"256:$REPS:$((50 * REPS + 10)) 64:$REPS:$((30 * REPS))"} exec bash "$(dirname "$0")/spec_h200.sh"

#!/usr/bin/env bash
# Session 6 speculation run (shadow drafts for n-gram, after session 5's measured-row pricing and
# host-loop work): 10 reps for a tighter paired_ci95. Calls 2-4 of the session (carries .m1, .m2,
# .m3 after s6_b.sh installed the packages); see spec_h200.sh.
REPS=${REPS:-10}
RUNS=${RUNS:-"256:$REPS:$((40 * REPS + 20)) 64:$REPS:$((14 * REPS + 20))"} exec bash "$(dirname "$0")/spec_h200.sh"

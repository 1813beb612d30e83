#!/usr/bin/env bash
# Session 4's speculation run (its last call ran "64:3:140" for want of device time); see spec_h200.sh.
RUNS=${RUNS:-"64:5:170 256:3:210"} exec bash "$(dirname "$0")/spec_h200.sh"

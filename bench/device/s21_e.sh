#!/usr/bin/env bash
# Session 21, calls e and f (carry .m1, then .m2, each within 30 s of the call before): a SmolLM2
# part to /tmp/mdl (common.sh copies it).
source "$(dirname "$0")/common.sh"
ls -la /tmp/mdl

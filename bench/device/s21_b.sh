#!/usr/bin/env bash
# Session 21, call b (carry .m1, within 30 s of call a): the first SmolLM2 part to /tmp/mdl, then the
# FP8 decode step of the 8B shape with the per-shape GEMV configuration (s20_fp8.sh's decode half).
#   bash bench/device/s21_b.sh     (carry .m1)
source "$(dirname "$0")/common.sh"
PARTS=decode bash bench/device/s20_fp8.sh

#!/usr/bin/env bash
# Session 6, last call (carry .whl + .snap): PDL 'late' redefined as a mix (kernels with a late site
# trigger after their main loop, every other kernel at its start, as in 'early'), after s6_b / s6_c
# showed late winning at batch 1 and early at batch 32 on the small shapes; the auto default for
# models under 8 GiB. GPU test: every mode gives the same greedy tokens.
source "$(dirname "$0")/common.sh"
stamp tests
gpu_tests s6d 200 tests/gpu/test_pdl_gpu.py
stamp replays
for mode in late early; do
  echo "--- pdl_trigger=$mode"
  ab --model smollm2-135m-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.pdl_trigger=$mode"
  ab --model llama-3.2-1b-shape --batch 1 32 --override "levers.graph_batch_sizes=[1,32]" "levers.pdl_trigger=$mode"
done
stamp done

#!/usr/bin/env bash
# Session 16, call 8 (carry .whl .snap; ~2 minutes): the tensor-core decode attention at offline
# serving's shapes (136-256 rows of 1,024 keys, SmolLM2 and 1B heads): is the ~1.4 TB/s of the
# offline forwards the kernel's geometry (splits, warps, keys a step)?
source "$(dirname "$0")/common.sh"
stamp sweep
timeout 150 python3 -m bench.decode_floor --no-floor --offline --layers 8 --out $OUT/offline_attention.json 2>&1 \
    | grep -E "^\[attn\]|Error" | cut -c1-160
stamp done

#!/usr/bin/env bash
# Session 21, call g (carry .m3, within 30 s of the calls that carried .m1 and .m2): the real SmolLM2
# joined in /tmp/mdl, then the MTP head trained on the GPU (tools/train_mtp.py gpu: metrale samples
# 4 continuations of every prompt of the tool and teacher-forces their hidden rows; torch trains the
# head; the log holds the held-out top-1 of draft 1 and draft 2 before and after).
#   bash bench/device/s21_g.sh     (carry .m3)
source "$(dirname "$0")/common.sh"
smollm2_ready || exit 3
mkdir -p $OUT/mtp
stamp "train_mtp gpu"
M=${GPU_MINUTES:-8.5}
timeout $(python3 -c "print(int($M * 60 + 40))") python3 tools/train_mtp.py gpu --model /tmp/mdl/smollm2.gguf \
    --out $OUT/mtp/head.safetensors --corpus /tmp/mtp_corpus.npz --gpu-minutes $M --samples ${SAMPLES:-4} 2>&1 | grep -vE "^\{\"step" | cut -c1-300 | tail -40
ls -la $OUT/mtp
stamp end

#!/usr/bin/env bash
# Session 23, call g (carry .m3, within 30 s of the calls that carried .m1 and .m2: s21_e.sh): the
# real SmolLM2 joined in /tmp/mdl; its native-Q4_1 greedy top-1 along the float32 reference
# (bench.top1_agreement, step and batch roads), then the MTP head trained on the GPU (s21_g.sh).
here=$PWD
source "$(dirname "$0")/common.sh"
mkdir -p tests/fixtures && cp "$here/tests/fixtures/golden_smollm2.npz" tests/fixtures/ 2>/dev/null
smollm2_ready || exit 3
mkdir -p $OUT/top1 $OUT/mtp
for mode in step batch; do
  stamp "top1 native $mode"
  timeout 90 python3 -m bench.top1_agreement metrale --model /tmp/mdl/smollm2.gguf --device cuda \
      --levers '{"weights": "native"}' --mode $mode --label "metrale CUDA native" --out $OUT/top1/native_$mode.json 2>&1 | cut -c1-200 | tail -12
done
stamp "train_mtp gpu"
M=${GPU_MINUTES:-6}
timeout $(python3 -c "print(int($M * 60 + 40))") python3 tools/train_mtp.py gpu --model /tmp/mdl/smollm2.gguf \
    --out $OUT/mtp/head.safetensors --corpus /tmp/mtp_corpus.npz --gpu-minutes $M --samples ${SAMPLES:-4} 2>&1 | grep -vE "^\{\"step" | cut -c1-300 | tail -40
ls -la $OUT/mtp
stamp end

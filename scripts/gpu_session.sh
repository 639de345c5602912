#!/usr/bin/env bash
# This stop's one device call (about 10 minutes): the compiled path of a patched model on the
# GPU, then Qwen3.5-9B training steps at 32k on fla's core — q35lab, q35lab under torch.compile,
# PEFT + Liger — each in a fresh process; results packed into $OUT/results.tgz after each step.
OUT=${OUT:-/tmp/out}
gpu=nvidia-h200
for v in "q35lab 180" "q35lab+compile 170" "peft+liger 130"; do
  name=${v%% *}; flags=$( [[ $name == *+compile ]] && echo --compile)
  STEPS=e2e E2E_VARIANTS="${name%+compile}" E2E_T=32768 E2E_ARGS="--size 9b --steps 2 $flags" \
      TIMEOUT_e2e=${v##* } bash scripts/gpu_run.sh
done

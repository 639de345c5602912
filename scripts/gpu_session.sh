#!/usr/bin/env bash
# This session's device calls, one stage a call (each under 10 minutes); every step packs what it
# has into $OUT/results.tgz (scripts/gpu_run.sh), so a call cut short still returns its results.
#
#   bash scripts/gpu_session.sh ops       # GPU tests of the ops and the patched module, the conv and
#                                         # SwiGLU sweeps, the compiled patched step (4 layers), and
#                                         # q35lab's 9B step at 32k with its breakdown and floor
#   bash scripts/gpu_session.sh peers     # the peers' 9B steps at 32k, and the long-context options' cost
#   bash scripts/gpu_session.sh long T... # q35lab with the long-context options at T tokens (9B), the
#                                         # next T only when the last did not fit
set -uo pipefail
stage=${1:?usage: gpu_session.sh ops|peers|long T...}; shift
csv=data/bench/nvidia-h200/end_to_end.csv
e2e() {  # e2e SECONDS VARIANTS T ARGS...
  local limit=$1 variants=$2 T=$3; shift 3
  STEPS=e2e E2E_VARIANTS="$variants" E2E_T="$T" E2E_ARGS="$*" TIMEOUT_e2e=$limit bash scripts/gpu_run.sh
}
case $stage in
  ops)
    STEPS=tests TIMEOUT_tests=120 TESTS="tests/test_causal_conv1d.py tests/test_swiglu.py tests/test_module_behaviour.py
        tests/test_long_context.py tests/test_patch.py" bash scripts/gpu_run.sh
    STEPS=check,bench OPS="causal_conv1d swiglu" BENCH_T="32768 131072" STEP_TIMEOUT=45 bash scripts/gpu_run.sh
    e2e 75 q35lab 32768 --size h200 --steps 3
    e2e 130 q35lab 32768 --size h200 --steps 3 --compile
    e2e 170 q35lab 32768 --size 9b --steps 2 --breakdown
    ;;
  peers)
    e2e 130 peft+liger 32768 --size 9b --steps 2
    e2e 140 peft+liger+axolotl 32768 --size 9b --steps 2
    e2e 140 peft 32768 --size 9b --steps 2
    e2e 130 q35lab+long 32768 --size 9b --steps 2
    ;;
  long)
    for T in "$@"; do
      e2e 330 q35lab+long "$T" --size 9b --steps 1 --warmup 0
      python3 - "$csv" "$T" <<'EOF' && break  # stop at the first that fits
import sys, pandas as pd
rows = pd.read_csv(sys.argv[1])
row = rows[(rows.variant == "q35lab+long") & (rows["T"] == int(sys.argv[2]))]
sys.exit(0 if len(row) and row.status.iloc[-1] == "ok" else 1)
EOF
    done
    ;;
esac
python3 - "$csv" <<'EOF'
import sys, pandas as pd
rows = pd.read_csv(sys.argv[1])
cols = [c for c in ("variant", "size", "T", "status", "step_ms", "peak_gib", "floor_ms", "device_ms", "loss") if c in rows]
print(rows[cols].tail(12).to_string(index=False))
EOF

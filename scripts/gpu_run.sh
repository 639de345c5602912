#!/usr/bin/env bash
# One device call: tests compiled on the GPU, kernel tuning, the sweep against peers, numerics,
# figures and the executed notebooks; everything lands under $OUT (a tar + logs).
#   usage (on the GPU machine, from the checkout):  bash scripts/gpu_run.sh [OPS...]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v -e fla -e flash_linear) || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests,tune,bench,notebooks}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
gpu=$(python3 -c "from q35lab.bench import core; print(core.gpu_slug())")
if [[ $STEPS == *tests* ]]; then
  python3 -m pytest -q -x -p no:cacheprovider -o addopts="" tests 2>&1 | tee "$OUT/tests.log" | tail -4
fi
if [[ $STEPS == *tune* ]]; then
  mkdir -p data/bench/$gpu
  python3 scripts/tune_offset_rms_norm.py --out data/bench/$gpu/offset_rms_norm_tuning.csv 2>&1 | tee "$OUT/tune.log"
fi
if [[ $STEPS == *overhead* ]]; then
  mkdir -p data/bench/$gpu
  python3 scripts/host_overhead.py data/bench/$gpu/offset_rms_norm_host_overhead.csv 2>&1 | tee "$OUT/overhead.log"
fi
if [[ $STEPS == *bench* ]]; then
  python3 -m q35lab bench "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '%|' | tail -60
fi
if [[ $STEPS == *notebooks* ]]; then
  (cd notebooks && python3 -m pytest -q -p no:cacheprovider -o addopts="" --nbmake --nbmake-timeout=600 --overwrite *.ipynb 2>&1 | tail -5)
fi
tar czf "$OUT/results.tgz" data notebooks/*.ipynb 2>/dev/null
ls -la "$OUT"

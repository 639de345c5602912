#!/usr/bin/env bash
# One run on a CUDA machine: tests compiled on the GPU, kernel tuning, the sweep against peers,
# numerics, figures, whole training steps and the executed notebooks, each step under a time limit,
# its results written under data/ and its log under /tmp/q35lab-logs/. Where $OUT is set (a machine
# that hands back one folder), every step also packs data/, the notebooks, tuned.json, the logs and
# fla's autotuning results into $OUT/results.tgz, so that a run cut short still returns them.
#
#   usage (on the GPU machine, from the checkout; dev/README.md says which step wrote which file):
#     OPS="gated_rms_norm" STEPS=tune,check,bench,notebooks NOTEBOOKS=02_gated_rmsnorm.ipynb \
#       TIMEOUT_bench=150 STEP_TIMEOUT=60 bash dev/gpu_run.sh [--quick]
#   TIMEOUT_<step> limits one step (TIMEOUT_notebooks: each notebook), STEP_TIMEOUT the others.
#   TESTS picks the test files (default: all of tests/); BENCH_T="16384 32768" measures only those
#   sizes and keeps the CSV's other rows. Steps layer and e2e take LAYER_VARIANTS,
#   LAYER_T, E2E_VARIANTS, E2E_T (space-separated), E2E_FIT=1 (search the longest T that fits) and
#   E2E_ARGS (more options for `python -m q35lab.e2e`, e.g. "--steps 2 --fit-from 196608 --fit-step 1.1").
#
# The delta-rule core is flash-linear-attention's, which refuses the GatedDeltaNet backward on Hopper
# with Triton 3.4-3.7.0 (fla#640): install Triton >= 3.7.1 beside it. Offline, the wheel folders
# of dev/offline/ are installed into /tmp/site first, a slim Triton 3.7.1 shadowing the machine's.
# NO_FLA=1 leaves that fla off the path (the PyTorch delta rule: what users without fla get).
set -uo pipefail
export PYTHONUNBUFFERED=1
[[ -z ${OUT:-} ]] || mkdir -p "$OUT"
ROOT=$PWD
STEPS=${STEPS:-tests,tune,bench,notebooks}
OPS=${OPS:-offset_rms_norm}
NOTEBOOKS=${NOTEBOOKS:-*.ipynb}
# An offline machine's wheel folders (dev/offline/device_wheels.sh), each installed once per machine
# and marked folder by folder: a later call that brings .whl-peers still installs it
for folder in .whl .whl-peers .whl-notebooks .whl-unsloth .whl-qla .whl-tf; do  # .whl-tf last: its transformers replaces the image's
  [[ -d $folder ]] || continue
  marker=/tmp/site/.installed$folder-$(ls $folder | md5sum | cut -c1-12)  # other wheels in it: installed again
  [[ -e $marker ]] && continue
  wheels=$(ls $folder/*.whl 2>/dev/null | grep -v -e fla -e flash_linear)
  if [[ -n $wheels ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
  fi
  if [[ $folder == .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fla \
        $(ls .whl/*.whl | grep -e fla -e flash_linear) 2>/dev/null
    [[ -s .whl/triton-3.7.1-slim.tar.xz ]] && mkdir -p /tmp/tri && tar xJf .whl/triton-3.7.1-slim.tar.xz -C /tmp/tri
  fi
  if [[ $folder == .whl-qla ]]; then  # flash-qla beside fla (NO_FLA drops both); TileLang's slim tree (slim_tilelang.py)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fla \
        .whl-qla/flash_qla-*.whl || exit 1
    mkdir -p /tmp/site && tar xJf .whl-qla/tilelang-*-slim.tar.xz -C /tmp/site || exit 1
  fi
  mkdir -p /tmp/site && touch "$marker"
done
if [[ ! -d .whl-tf ]] && ls /tmp/site/.installed.whl-tf-* >/dev/null 2>&1; then  # a call without it: the image's again
  rm -rf /tmp/site/transformers /tmp/site/transformers-*.dist-info /tmp/site/.installed.whl-tf-*
fi
TRI=
[[ -d /tmp/tri/triton ]] && TRI=/tmp/tri:
export PYTHONPATH=${TRI}$( [[ -n ${NO_FLA:-} ]] || echo /tmp/site_fla:)/tmp/site:$PWD
export TRITON_CACHE_AUTOTUNING=1  # fla autotunes each shape once; later processes reuse the result
# fla autotunes each shape for minutes on a fresh machine: its results (small *.autotune.json files,
# keyed by Triton, the GPU target, the kernel's source and the shape's key) come back in results.tgz
# (triton-autotune/); committed as data/triton-autotune/ (or kept as the git-ignored
# .triton-autotune/), they seed the next machine's Triton cache, and only the chosen configurations
# compile there. A result whose key no longer matches (another Triton, fla or shape) is never read
CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
TUNED=/tmp/triton-autotune
for seed in data/triton-autotune .triton-autotune; do
  if [[ -d $seed ]]; then mkdir -p "$CACHE" && cp -rn $seed/. "$CACHE"/; fi
done
LOGS=/tmp/q35lab-logs; mkdir -p "$LOGS"
pack() {  # everything a call returns, into $OUT/results.tgz (nothing where $OUT is not set)
  [[ -n ${OUT:-} ]] || return 0
  mkdir -p "$TUNED" && [[ -d $CACHE ]] && (cd "$CACHE" && find . -name '*.autotune.json' -exec cp --parents {} "$TUNED" \;)
  # written aside and renamed: a call cut at its limit mid-pack still returns the last whole one
  (cd "$ROOT" && tar czf "$OUT/partial.tgz" data notebooks/*.ipynb $(ls q35lab/ops/tuned.json 2>/dev/null) \
      -C "$LOGS/.." "$(basename "$LOGS")" -C "$TUNED/.." "$(basename "$TUNED")" && mv "$OUT/partial.tgz" "$OUT/results.tgz")
}
# STEPS=pack: only that, after a caller changed data/ (gpu_session.sh joins a call's rows after its step packed)
[[ $STEPS == pack ]] && { pack; exit 0; }
WITH_FLA=$PYTHONPATH
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
gpu=$(python3 -c "from q35lab.bench import core; print(core.gpu_slug())")
mkdir -p data/bench/$gpu

step() {  # step NAME COMMAND...: run with a time limit (TIMEOUT_<name> or STEP_TIMEOUT), log, pack
  local name=$1; shift
  local limit="TIMEOUT_${name%%_*}"
  timeout "${!limit:-${STEP_TIMEOUT:-590}}" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -v '%|' | tail -n 45
  # an e2e parent killed at the limit leaves its finished children's rows unmerged: merge them first
  [[ $name != e2e_* ]] || python3 -m q35lab.e2e --merge-leftovers --out "$e2e_csv" >/dev/null 2>&1 || true
  pack
}

[[ $STEPS == *tests* ]] && step tests python3 dev/gpu_tests.py --out data/bench/$gpu/gpu_tests.csv \
    --limit ${TIMEOUT_testfile:-300} ${TESTS:-}
for op in $OPS; do
  if [[ $STEPS == *tune* && -f q35lab/bench/tune/$op.py ]]; then
    # --shipped: into q35lab/ops/tuned.json, which pack returns for a commit (not the user cache)
    step tune_$op python3 -m q35lab tune $op --shipped --out data/bench/$gpu/${op}_tuning.csv
  fi
done
# where the whole-layer tiled GatedDeltaNet's cost goes: untiled and tiled steps of a 4-layer 9B, profiled
[[ $STEPS == *profile* ]] && step profile python3 benchmarks/profile_tiled_layer.py ${PROFILE_ARGS:-} \
    --out data/bench/$gpu/tiled_layer_profile.csv
# what a Qwen3.5 attention layer's SDPA backward allocates per token (the H100 search's last out of memory)
[[ $STEPS == *attnmem* ]] && step attnmem python3 benchmarks/attention_backward_memory.py \
    --out data/bench/$gpu/attention_backward_memory.csv
if [[ $STEPS == *overhead* ]]; then
  step overhead python3 benchmarks/host_overhead.py data/bench/$gpu/offset_rms_norm_host_overhead.csv
fi
# whole-model measurements: every variant runs in a process of its own
[[ $STEPS == *layer* ]] && step layer python3 -m q35lab.e2e --what layer --layers 1 \
    --variants ${LAYER_VARIANTS:-peft q35lab} --T ${LAYER_T:-8192 32768} --out data/bench/$gpu/gdn_layer.csv
e2e_log=e2e_$(echo "${E2E_VARIANTS:-} ${E2E_T:-} ${E2E_ARGS:-}" | tr -cs 'a-zA-Z0-9.+:' '-')  # one log a run
e2e_csv=data/bench/$gpu/${E2E_OUT:-end_to_end.csv}
[[ $STEPS == *e2e* ]] && step "$e2e_log" python3 -m q35lab.e2e \
    --variants ${E2E_VARIANTS:-peft peft+liger q35lab} --T ${E2E_T:-8192 32768} ${E2E_FIT:+--fit} ${E2E_ARGS:-} \
    --out "$e2e_csv"
[[ $STEPS == *check* ]] && step check env PYTHONPATH=$WITH_FLA python3 -m q35lab check $OPS
[[ $STEPS == *bench* ]] && step bench env PYTHONPATH=$WITH_FLA python3 -m q35lab bench $OPS ${BENCH_T:+--T $BENCH_T} "$@"
[[ $STEPS == *bench* ]] && step plots python3 -m q35lab plots
if [[ $STEPS == *notebooks* ]]; then  # one step per notebook: a slow one cannot starve the next
  # in the order NOTEBOOKS names them (an `ls` of the whole list would sort them)
  for nb in $(cd notebooks && for pattern in $NOTEBOOKS; do ls -d $pattern; done); do
    (cd notebooks && step "notebooks_${nb%.ipynb}" python3 -m pytest -q -p no:cacheprovider \
        -o addopts="" --nbmake --nbmake-timeout=600 --overwrite "$nb")
  done
fi
[[ -z ${OUT:-} ]] || ls -la "$OUT"

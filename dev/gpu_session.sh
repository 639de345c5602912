#!/usr/bin/env bash
# The measurement sets behind the committed results, a stage each (dev/README.md maps every file of
# data/bench/ to its stage). Each step of a stage runs under a time limit through dev/gpu_run.sh,
# which writes data/bench/<gpu>/ (and, where $OUT is set, packs it into $OUT/results.tgz after every
# step). Peers: pip install -e ".[peers]"; axolotl 0.21 (with bitsandbytes) for the axolotl rows,
# unsloth for the unsloth stage, nbmake and ipykernel for notebooks.
#
#   bash dev/gpu_session.sh STAGE STAGE...  # several stages in one run, in order
#   bash dev/gpu_session.sh tests      # every test file compiled on the GPU, 8 files at a time
#                                      # (best last: a run that loses the machine returns nothing)
#   bash dev/gpu_session.sh ops        # tune the conv, then check and sweep it, SwiGLU, the delta-rule core and the row copy
#   bash dev/gpu_session.sh ops_new    # in_proj and the loss at every T, one run (notebooks 04/05 read one run a file)
#   bash dev/gpu_session.sh step       # q35lab's 9B step at 32k with its breakdown and floor
#   bash dev/gpu_session.sh peers      # PEFT + Liger, axolotl's recipe, PEFT at 9B/32k
#   bash dev/gpu_session.sh ablation   # PEFT with one optimization at a time, 9B/32k (ablation.csv)
#   bash dev/gpu_session.sh sizes9b    # 9B at 8k and 64k: q35lab, PEFT + Liger, axolotl's recipe, PEFT
#   bash dev/gpu_session.sh floors     # 27B and 35B-A3B at 32k: q35lab with its breakdown and floor, then
#                                      # FLOOR_PEERS (unset: PEFT + Liger; empty: none)
#   PEERS_AT="27b:peft+liger 35b-a3b:peft" bash dev/gpu_session.sh peers_at  # those variants at 32k
#   bash dev/gpu_session.sh big35      # 35B-A3B: PEFT + Liger at 8k, 32k, 64k; q35lab at 8k and 64k
#   bash dev/gpu_session.sh big27      # 27B: q35lab and PEFT + Liger at 8k and 64k
#   bash dev/gpu_session.sh packed     # the SFT length mix packed at 32k: q35lab, PEFT + Liger, axolotl's
#                                      # recipe, PEFT, q35lab without the varlen attention (PACKED picks)
#   bash dev/gpu_session.sh padded     # the same tokens padded per micro-batch beside packed, the four
#                                      # (PADDED picks): packed_vs_padded.csv
#   bash dev/gpu_session.sh current_tf # q35lab, PEFT + Liger and PEFT at 9B/32k on a newer transformers
#                                      # (.whl-tf, dev/offline/slim_transformers.py): end_to_end_current_transformers.csv
#   bash dev/gpu_session.sh flex       # the packed row under flex attention, q35lab and PEFT + Liger
#   bash dev/gpu_session.sh fsdp       # q35lab and PEFT + Liger under FSDP2 on every GPU of the machine
#                                      # (world size 1 on one GPU: the sharded code path, measured)
#   bash dev/gpu_session.sh long_cost  # q35lab and each long-context option at 32k (their cost), alone and together
#   bash dev/gpu_session.sh tiled_profile  # where the tiled GatedDeltaNet's cost at 32k goes (tiled_layer_profile.csv)
#   LONG_T="T..." bash dev/gpu_session.sh long  # q35lab+long (or LONG_VARIANT) at each T until one fits
#   LONG_FIT="q35lab:262144 peft+liger:262144" bash dev/gpu_session.sh long_fit  # each one's longest step, searched
#   bash dev/gpu_session.sh unsloth    # Unsloth's LoRA path, q35lab and PEFT + Liger at 9B/32k (unsloth.csv)
#   bash dev/gpu_session.sh short      # 9B at 1k, 2k, 4k: q35lab and PEFT + Liger with the profile's kernel count
#                                      # and busy fraction (short_steps.csv)
#   bash dev/gpu_session.sh compiled   # q35lab eager and torch.compile'd at 1k, 4k, 32k (compiled.csv)
#   bash dev/gpu_session.sh ckpt       # checkpointing='auto' between full checkpointing and none, beside PEFT + Liger
#                                      # with and without it, 9B at 8k and 32k (checkpointing.csv; CKPT_SIZES adds 27b)
#   bash dev/gpu_session.sh notebooks  # every notebook executed (outputs kept)
#   bash dev/gpu_session.sh qla        # fla 0.6 handing the delta rule to FlashQLA (.whl-qla, dev/offline/slim_tilelang.py):
#                                      # the core alone beside fla's Triton kernels, then q35lab's 9B step at 32k (flash_qla.csv)
#
# The first step that trains a model at a new shape spends a minute or two in fla's autotuning
# (cached for the later processes of the same machine: TRITON_CACHE_AUTOTUNING=1); the committed
# data/triton-autotune/ (or a .triton-autotune/ folder of an earlier run's results) seeds the
# machine's Triton cache with those results (dev/gpu_run.sh). TIMEOUT_e2e=SECONDS replaces every
# e2e step's own limit (sized for an H100 or H200) on a slower GPU.
#
# The rows name the checkout's commit; Q35LAB_COMMIT=<hash> names it where the tree's git metadata is
# not its own (a copied working tree).
set -uo pipefail
[[ $# -gt 0 ]] || { echo "usage: gpu_session.sh tests|ops|ops_new|step|peers|peers_at|ablation|sizes9b|floors|big35|big27|packed|padded|current_tf|flex|long_cost|tiled_profile|long_fit|long|fsdp|unsloth|short|compiled|ckpt|qla|notebooks ..."; exit 2; }
bench=data/bench/$(python3 -c "from q35lab.bench import core; print(core.gpu_slug())")  # as gpu_run.sh names it
csv=$bench/end_to_end.csv
e2e() {  # e2e SECONDS VARIANTS T ARGS...
  local limit=$1 variants=$2 T=$3; shift 3
  STEPS=e2e E2E_VARIANTS="$variants" E2E_T="$T" E2E_ARGS="$*" TIMEOUT_e2e=${TIMEOUT_e2e:-$limit} bash dev/gpu_run.sh
}
beside_own_call() {  # beside_own_call FILE SECONDS VARIANTS T ARGS...: e2e's rows of this run joined to FILE
  # beside every earlier run's (dev/join_calls.py): merged straight in, a q35lab row would replace the
  # baseline of an earlier run's options
  local kept=$bench/$1 call=${1%.csv}_call.csv; shift
  rm -f $bench/$call
  E2E_OUT=$call e2e "$@"
  python3 dev/join_calls.py $bench/$call "$kept"
  STEPS=pack bash dev/gpu_run.sh >/dev/null  # the step packed before the join: pack the joined rows
}
for stage in "$@"; do
case $stage in
  tests) STEPS=tests TIMEOUT_tests=${TIMEOUT_tests:-330} bash dev/gpu_run.sh ;;
  ops)  # the conv tuned first (python -m q35lab tune causal_conv1d, ~4 min: it writes q35lab/ops/tuned.json)
    STEPS=tune,check,bench OPS="causal_conv1d swiglu delta_rule contiguous_rows" BENCH_T="32768 131072" \
        TIMEOUT_tune=300 STEP_TIMEOUT=270 bash dev/gpu_run.sh ;;
  ops_new)  # the rows notebooks 04 and 05 wait for: in_proj's "q35lab (z own buffer)", the loss's "pytorch, chunked"
    # every T: a run of some T only mixes two runs in files the notebooks read as one
    # the bench step: in_proj ~65 s, the loss ~330 s; in_proj's axolotl row needs axolotl and bitsandbytes
    STEPS=check,bench OPS="in_proj linear_cross_entropy" STEP_TIMEOUT=430 bash dev/gpu_run.sh ;;
  step) e2e 330 q35lab 32768 --size 9b --steps 3 --breakdown --memory-at-peak ;;  # fla's autotuning, 3 steps,
        # the allocator-recorded one, the profiled one: ~250 s on a fresh machine without .triton-autotune
  peers)  # on a fresh machine without .triton-autotune: axolotl's first step ~3 min, PEFT + Liger's > 2 min
    # 3 measured steps each: the median of 2 is their mean, which one slow step moves by a few percent
    e2e 200 peft+liger 32768 --size 9b --steps 3
    e2e 260 peft+liger+axolotl 32768 --size 9b --steps 3 --memory-at-peak  # what it keeps less of than q35lab
    e2e 140 peft 32768 --size 9b --steps 3
    ;;
  ablation)  # ablation.csv: PEFT with one optimization at a time, beside PEFT, PEFT + Liger and all of q35lab
            # in the same run; one variant a run, so that a call cut at its limit keeps the rows before
    # 10 runs of ~45 s: more than one call; ABLATION="..." runs only those (list peft to keep a PEFT row beside)
    for v in ${ABLATION:-q35lab:rms_norm q35lab:swiglu q35lab:conv peft peft+liger q35lab q35lab:lora q35lab:flce \
             q35lab:in_proj q35lab:gated_norm}; do
      E2E_OUT=ablation.csv e2e 110 $v 32768 --size 9b --steps 1
    done
    ;;
  sizes9b)  # 9B at 8k and 64k beside the 32k headline (PEFT at 64k: out of memory by its 32k peak)
    for v in q35lab peft+liger peft+liger+axolotl peft; do e2e 150 $v "8192 65536" --size 9b --steps 2; done
    ;;
  floors)  # the 27B's and the 35B-A3B's step at 32k with their profile and floor (9B's: the step stage), each beside
           # the peers in the same call (FLOOR_PEERS, in order: the call's limit cuts the last first)
    for size in ${FLOORS:-27b 35b-a3b}; do  # FLOORS="35b-a3b": one size a call where the call is short
      e2e 300 q35lab 32768 --size $size --steps 3 --breakdown
      for v in ${FLOOR_PEERS-peft+liger}; do e2e 300 $v 32768 --size $size --steps 3; done
    done
    ;;
  peers_at)  # PEERS_AT="SIZE:VARIANT ...": each at 32k, in order (the call's limit cuts the last first)
    [[ -n ${PEERS_AT:-} ]] || { echo "peers_at: set PEERS_AT (SIZE:VARIANT pairs)"; exit 2; }
    for pair in $PEERS_AT; do e2e 300 "${pair#*:}" 32768 --size "${pair%%:*}" --steps 3; done
    ;;
  big35)  # q35lab's 32k row comes from floors; Liger's MoE kernels compile for over 2 minutes
    e2e 330 peft+liger "32768 8192 65536" --size 35b-a3b --steps 2  # the missing 32k first
    e2e 240 q35lab "8192 65536" --size 35b-a3b --steps 2
    ;;
  big27)  # the 32k rows come from floors and peers_at
    for v in ${BIG27:-q35lab peft+liger}; do e2e 240 $v "8192 65536" --size 27b --steps 2; done
    ;;
  packed)  # the SFT length mix packed into one 32k row, every variant in one call (PACKED="..." picks some);
           # q35lab-varlen_attention: SDPA's dense block-causal mask instead of varlen flash attention
    for v in ${PACKED:-q35lab peft+liger peft+liger+axolotl peft q35lab-varlen_attention}; do
      e2e 150 $v 32768 --size 9b --steps 2 --batch packed
    done
    ;;
  padded)  # the same tokens padded to the longest sequence of each micro-batch (4-5 micro-batches of
           # ~100-130k tokens with padding: q35lab 11 s a step, PEFT + Liger 19 s), each variant beside its
           # own packed row of the same call, in a file of their own: in end_to_end.csv a packed row of
           # this call would replace the packed pair that compares the variants within one run
    for v in ${PADDED:-q35lab peft+liger peft+liger+axolotl peft}; do
      beside_own_call packed_vs_padded.csv 150 $v 32768 --size 9b --steps 2 --batch packed
      beside_own_call packed_vs_padded.csv 240 $v 32768 --size 9b --steps 2 --batch padded
    done
    ;;
  current_tf)  # the image's transformers 5.17 repeats q and k to 32 heads before fla (the step's largest copy) and
               # masks expert-parallel sentinel rows on one GPU (15% of the MoE step); the current release does
               # neither. New fla tuning keys (16 heads), so the first run gets room to tune. CURRENT_TF_SIZES picks
               # the sizes (default 9b; "9b 35b-a3b" adds the MoE, whose Liger row compiles for ~3 min)
    [[ -d .whl-tf ]] || { echo "current_tf: needs .whl-tf (dev/offline/slim_transformers.py)"; exit 2; }
    for size in ${CURRENT_TF_SIZES:-9b}; do
      E2E_OUT=end_to_end_current_transformers.csv e2e 300 q35lab 32768 --size $size --steps 2
      for v in peft+liger peft; do
        [[ $size == 9b || $v != peft ]] || continue  # PEFT alone only at 9B
        E2E_OUT=end_to_end_current_transformers.csv e2e 300 $v 32768 --size $size --steps 2
      done
    done
    ;;
  flex)
    # SDPA takes the packed row's block-causal mask as a dense [T, T] mask (PEFT + Liger packed ran at
    # 0.72x its one-sequence throughput); flex attention's block mask skips the blocks between sequences
    for v in q35lab peft+liger; do e2e 200 $v 32768 --size 9b --steps 2 --batch packed --attention flex_attention; done
    ;;
  long_cost)  # what each long-context option costs at 32k, beside q35lab without them in the same call
    # their own CSV: a plain q35lab row in end_to_end.csv would replace the headline's, measured beside the peers
    # LONG_COST="..." runs only those options, after q35lab (their baseline in the same call)
    costs=${LONG_COST:-q35lab+tiled q35lab+tiled_gdn q35lab+offload q35lab+long q35lab+long_context}
    for v in q35lab $(printf '%s\n' $costs | grep -vx q35lab); do  # q35lab first, once, whatever LONG_COST lists
      beside_own_call long_context.csv 180 $v 32768 --size 9b --steps 3
    done
    ;;
  tiled_profile)  # where the whole-layer tiled GatedDeltaNet's cost at 32k goes: the 9B's dimensions with 4 layers
    # (3 GatedDeltaNet layers), untiled and in tiles of 8192 and 16384, each step timed, then profiled by kernel
    # group (benchmarks/profile_tiled_layer.py: tiled_layer_profile.csv), ~3 min
    STEPS=profile TIMEOUT_profile=${TIMEOUT_profile:-300} bash dev/gpu_run.sh
    ;;
  long_fit)  # the longest 9B step of each variant, searched (e2e's --fit): 32k and 64k, then the line through their
    # peaks guesses the limit, the search steps 3% up from a fit and down from an out of memory in doubling strides (long_fit.csv).
    # LONG_FIT="VARIANT:MAX[:SECONDS[:FROM]] ...": MAX is what an offloading variant plans its host memory for (the
    # longest tried); SECONDS the run's limit (default 240); FROM the first guess after 32k and 64k (default: the line's).
    # A step near 450k tokens is ~4 min on an H100, and each new length adds fla's autotuning (~25 s at 143k): keep
    # the last run's triton-autotune/ as .triton-autotune. The rows name the caching allocator's settings
    # (PYTORCH_CUDA_ALLOC_CONF, inherited: expandable_segments:True lets a step use memory that fragmentation strands)
    [[ -n ${LONG_FIT:-} ]] || { echo "long_fit: set LONG_FIT (VARIANT:MAX[:SECONDS[:FROM]] ...)"; exit 2; }
    for spec in $LONG_FIT; do
      IFS=: read -r v max limit from <<< "$spec"
      E2E_OUT=long_fit.csv e2e "${limit:-240}" "$v" "32768 65536" --size 9b --steps 1 --warmup 0 --fit --fit-max "$max" \
          --fit-from "${from:-0}"
    done
    ;;
  long)  # a step at 512k is predicted at ~4 min (attention alone ~190 s): one T fits a call
    # LONG_VARIANT: q35lab+long (fixed 8192-token tiles, planned offload; the default) or q35lab+long_context (planned)
    [[ -n ${LONG_T:-} ]] || { echo "long: set LONG_T (the lengths to try, in order)"; exit 2; }
    variant=${LONG_VARIANT:-q35lab+long}
    for T in $LONG_T; do
      e2e ${LONG_LIMIT:-450} $variant "$T" --size 9b --steps 1 --warmup 0  # LONG_LIMIT: up to ~560 in a call of its own
      python3 - "$csv" "$T" "$variant" <<'EOF' && break  # stop at the first that fits
import sys, pandas as pd
rows = pd.read_csv(sys.argv[1])
row = rows[(rows.variant == sys.argv[3]) & (rows["T"] == int(sys.argv[2]))]
sys.exit(0 if len(row) and row.status.iloc[-1] == "ok" else 1)
EOF
    done
    ;;
  fsdp)
    STEPS=install bash dev/gpu_run.sh >/dev/null  # installs the offline wheels, if any (no step is named so)
    gpus=$(nvidia-smi -L | wc -l)
    for v in q35lab peft+liger; do
      PYTHONPATH=$( [[ -d /tmp/tri/triton ]] && echo /tmp/tri: )/tmp/site_fla:/tmp/site:$PWD timeout 300 \
        python3 -m torch.distributed.run --standalone --nproc_per_node="$gpus" benchmarks/fsdp2_step.py \
        --size 9b --T 32768 --steps 2 --variant $v --out $bench/fsdp2_step.jsonl 2>&1 | tail -n 5
    done
    ;;
  unsloth)  # Unsloth's Qwen3.5 LoRA path (benchmarks/peers/unsloth.py) beside q35lab and PEFT + Liger, in a file
            # of their own (rows of these two in end_to_end.csv would replace the headline run's). Unsloth writes the
            # 9B as an 18 GB checkpoint, loads it, and inductor compiles each decoder layer's region in the first
            # step: over 4 minutes on a fresh machine, so it has up to 560 s. CALL_SECONDS: a run limited to that
            # many seconds runs the others after it only where ~150 s each are left (else name them in
            # UNSLOTH_VARIANTS of the next run on the same machine, whose inductor cache keeps Unsloth's compile)
    for v in ${UNSLOTH_VARIANTS:-unsloth q35lab peft+liger}; do
      if [[ $v == unsloth ]]; then limit=560 least=300; else limit=150 least=150; fi
      left=$(( ${CALL_SECONDS:-100000} - SECONDS - 30 ))  # 30 s for the step's merge and pack
      if (( left < least )); then
        echo "unsloth stage: $v left for the next run (${SECONDS} s of the run spent)"; continue
      fi
      E2E_OUT=unsloth.csv e2e $(( limit < left ? limit : left )) $v 32768 --size 9b --steps 3
    done
    ;;
  short)  # where a short step's time goes: the host (Python, launches) or the GPU; 5 steps, the median of 4 timed
    for v in ${SHORT:-q35lab peft+liger}; do
      E2E_OUT=short_steps.csv e2e 240 $v "1024 2048 4096" --size 9b --steps 5 --breakdown
    done
    ;;
  compiled)  # eager and compiled in one call, each in its own process (the compiled one's first step compiles)
    E2E_OUT=compiled.csv e2e 200 q35lab "1024 4096 32768" --size 9b --steps 3
    E2E_OUT=compiled.csv e2e 420 q35lab "1024 4096 32768" --size 9b --steps 3 --compile
    ;;
  ckpt)  # the plan's two bounds beside it: every layer checkpointed (q35lab) and none (+no_ckpt, where it fits)
    for size in ${CKPT_SIZES:-9b}; do
      for v in ${CKPT:-q35lab q35lab+ckpt_auto q35lab+no_ckpt peft+liger peft+liger+no_ckpt peft+no_ckpt}; do
        E2E_OUT=checkpointing.csv e2e 240 $v "8192 32768" --size $size --steps 3 --memory-at-peak
      done
    done
    ;;
  notebooks) STEPS=notebooks TIMEOUT_notebooks=280 bash dev/gpu_run.sh ;;
  qla)  # FlashQLA: TileLang JIT-compiles its kernels at the first call (nvcc + g++ by default; NVRTC through cuda-python
        # where no nvcc is found: the image's torch 2.11 brings cuda-bindings and libnvrtc); compiled kernels are cached
        # under TILELANG_CACHE_DIR (~/.tilelang/cache), so the probe's process warms the bench's and the e2e's. Without the
        # slim Triton (it does not fit beside .whl-qla) fla's Triton backward refuses Hopper (fla#640): the bench's "fla"
        # row is an error there, FlashQLA's is not (fla's dispatch takes the whole call; chunk_bwd_dqkwg never runs)
    [[ -d .whl-qla ]] || { echo "qla: needs .whl-qla (dev/offline/slim_tilelang.py)"; exit 2; }
    STEPS=install bash dev/gpu_run.sh >/dev/null  # installs the wheel folders (no step is named so)
    qla_path=$( [[ -d /tmp/tri/triton ]] && echo /tmp/tri: )/tmp/site_fla:/tmp/site:$PWD
    if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc && -z ${CUDA_HOME:-} ]]; then
      export TILELANG_EXECUTION_BACKEND=${TILELANG_EXECUTION_BACKEND:-nvrtc}  # no nvcc here: NVRTC (cuda-python)
      # NVRTC reads CUDA's headers from CUDA_HOME/include: torch's pip CUDA (nvidia/cu13/include) beside CCCL's
      # cuda/std (cute needs it under NVRTC; .whl-qla/cccl/, kept out of /tmp/site's nvidia namespace)
      cu13=$(python3 -c "import nvidia, os; print(next(p for p in nvidia.__path__ if os.path.isdir(p + '/cu13/include')) + '/cu13')" 2>/dev/null)
      rm -rf /tmp/cuda_home && mkdir -p /tmp/cuda_home/include /tmp/cccl && unzip -qo .whl-qla/cccl/*.whl -d /tmp/cccl
      [[ -n $cu13 ]] && ln -s "$cu13"/include/* /tmp/cuda_home/include/ 2>/dev/null
      ln -sfn /tmp/cccl/nvidia/cu13/include/cccl /tmp/cuda_home/include/cccl
      export CUDA_HOME=/tmp/cuda_home
    fi
    echo "qla: nvcc=$(command -v nvcc || echo none) g++=$(command -v g++ || echo none) CUDA_HOME=${CUDA_HOME:-}" \
         "TILELANG_EXECUTION_BACKEND=${TILELANG_EXECUTION_BACKEND:-auto}"; ls ${CUDA_HOME:-/usr/local/cuda}/include | head -n 5
    # QLA picks the parts (default all; a call has 600 s: on a fresh machine "probe check" in one call, then
    # "bench" and "e2e" on the same warm machine, whose ~/.tilelang/cache keeps the compiled kernels)
    [[ " ${QLA:-probe check bench e2e} " == *" probe "* ]] && PYTHONPATH=$qla_path timeout 300 python3 - <<'EOF'  # fla's own predicate on the model's call, q35lab's, one timed call
import time, types, torch, triton
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.gated_delta_rule.backends import FlashQLABackend
from q35lab.hf.gated_delta_net import flash_qla_problem
backend, T = FlashQLABackend(), 4096
print("triton", triton.__version__, "FlashQLA available", backend.is_available(), "enabled", backend.is_enabled())
q = torch.randn(1, T, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = -torch.rand(1, T, 32, device="cuda")
beta = torch.rand(1, T, 32, device="cuda", dtype=torch.bfloat16)
print("fla's verifier on the model's call:", backend.chunk_gated_delta_rule_verifier(q, q, v, g, beta, use_qk_l2norm_in_kernel=True))
print("q35lab's flash_qla_problem:", flash_qla_problem(types.SimpleNamespace(head_k_dim=128, head_v_dim=128)))
start = time.time()
o, _ = chunk_gated_delta_rule(q, q, v, g, beta, use_qk_l2norm_in_kernel=True)
o.sum().backward()
torch.cuda.synchronize()
print(f"first FlashQLA forward+backward, TileLang's compiles included: {time.time() - start:.0f} s")
EOF
    [[ " ${QLA:-probe check bench e2e} " == *" check "* ]] &&
      PYTHONPATH=$qla_path timeout 280 python3 -m q35lab check delta_rule 2>&1 | tail -n 16
    [[ " ${QLA:-probe check bench e2e} " == *" bench "* ]] &&
      PYTHONPATH=$qla_path timeout 420 python3 -m q35lab bench delta_rule --T 32768 2>&1 | tail -n 12
    [[ " ${QLA:-probe check bench e2e} " == *" e2e "* ]] && E2E_OUT=flash_qla.csv e2e 420 q35lab 32768 --size 9b --steps 3
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
done
[[ -f $csv ]] && python3 - "$csv" <<'EOF'
import sys, pandas as pd
rows = pd.read_csv(sys.argv[1])
cols = [c for c in ("variant", "size", "T", "batch", "status", "step_ms", "peak_gib", "floor_ms", "loss_first") if c in rows]
print(rows[cols].tail(12).to_string(index=False))
EOF

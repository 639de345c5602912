#!/usr/bin/env bash
# Fill the git-ignored wheel folders that a GPU machine without a package registry is handed
# (dev/gpu_run.sh installs each one it finds). Where what is handed over is capped (64 MiB a call on
# the machines the committed results came from), the wheels come in folders a call picks from:
#
#   .whl            the slim Triton 3.7.1 (fla's core on Hopper), fla, Liger, cut-cross-entropy  ~50 MB
#   .whl-peers      axolotl 0.21, its bitsandbytes slimmed to CUDA 13, and what axolotl's Liger
#                   integration imports (addict, pydantic and its dependencies)                  ~10 MB
#   .whl-notebooks  nbmake and a Jupyter kernel with their dependencies                           ~8 MB
#   .whl-unsloth    Unsloth without its Studio app, unsloth_zoo, trl, datasets and bitsandbytes      ~11 MB
#
#   bash dev/offline/device_wheels.sh       # on a machine with PyPI; ~7 min (the Triton's strip and xz
#                                           # on two cores, by the shared tool gpu-wheels.sh beside the checkout)
set -euo pipefail
cd "$(dirname "$0")/../.."
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
dl() { local dest=$1; shift; python3 -m pip download -q "${plat[@]}" -d "$dest" "$@" 2>&1 | grep -v '^WARNING' || true; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# .whl: the shared tool also downloads nbmake and ipykernel there; they move to .whl-notebooks
[[ -s .whl/triton-3.7.1-slim.tar.xz ]] || bash ../shared/tools/gpu-wheels.sh --triton
mkdir -p .whl-notebooks
for wheel in .whl/*.whl; do
  case $(basename "$wheel") in
    liger_kernel-*|flash_linear_attention-*|fla_core-*|cut_cross_entropy-*) ;;
    *) mv "$wheel" .whl-notebooks/ ;;
  esac
done
[[ -n $(ls .whl-notebooks) ]] || { dl .whl-notebooks nbmake==1.5.5 ipykernel; }

# .whl-peers: pydantic 2.14 wants a newer typing_extensions than the image's: it travels too
mkdir -p .whl-peers
dl .whl-peers --no-deps axolotl==0.21.0 addict pydantic pydantic-core annotated-types typing-inspection typing-extensions
dl "$tmp" --no-deps bitsandbytes==0.50.2
python3 dev/offline/slim_bitsandbytes.py "$tmp"/bitsandbytes-*.whl .whl-peers/

# .whl-unsloth (dev/offline/slim_unsloth.py says what is dropped)
mkdir -p .whl-unsloth
dl "$tmp/u" --no-deps unsloth unsloth_zoo
python3 dev/offline/slim_unsloth.py "$tmp"/u/unsloth-*.whl .whl-unsloth/
cp "$tmp"/u/unsloth_zoo-*.whl .whl-unsloth/
# what `import unsloth` imports that the device image lacks (it has pyarrow, xxhash, sentencepiece, torchvision)
dl .whl-unsloth --no-deps "trl<=1.15.0" "datasets<5" "dill<0.4.2" "multiprocess<0.70.20"
cp .whl-peers/bitsandbytes-*.whl .whl-unsloth/  # its get_peft_model asks for it, also without 4-bit weights

du -sh .whl .whl-peers .whl-notebooks .whl-unsloth

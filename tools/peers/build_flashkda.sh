#!/usr/bin/env bash
# Build FlashKDA (the KDA prefill peer of benchmarks/kda_prefill.py) from .peers/flashkda.tar.xz for sm_90a only,
# on the GPU machine with the image's python3 (torch, nvcc). Prints the PYTHONPATH entry that imports flash_kda.
# Usage: bash tools/peers/build_flashkda.sh [ARCHIVE] [BUILD_DIR]
set -euo pipefail
archive=$(realpath "${1:-.peers/flashkda.tar.xz}")
dir=${2:-/tmp/peers/flashkda}
[[ -f $archive ]] || { echo "build_flashkda: no archive $archive (make it with tools/peers/pack.py)" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir" && tar xJf "$archive" -C "$dir"
# Its setup.py runs `git submodule update` and `git rev-parse`; the archive already holds CUTLASS, so a git that
# fails is all it needs.
mkdir -p "$dir/.bin" && printf '#!/bin/sh\nexit 1\n' > "$dir/.bin/git" && chmod +x "$dir/.bin/git"
cd "$dir"
PATH="$dir/.bin:$PATH" TORCH_CUDA_ARCH_LIST=9.0a FLASH_KDA_CUDA_ARCHS=90a MAX_JOBS=${MAX_JOBS:-16} \
  python3 setup.py build_ext --inplace > build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
echo "$dir"

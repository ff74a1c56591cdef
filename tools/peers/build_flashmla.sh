#!/usr/bin/env bash
# Build FlashMLA's sm90a dense decode from the packed peer source (tools/peers/pack.py) for mla_decode.py.
#
# Usage: bash tools/peers/build_flashmla.sh [ARCHIVE] [BUILD_DIR]
#   ARCHIVE    default .peers/flashmla.tar.xz of this repository;  BUILD_DIR  default /tmp/peers/flashmla (replaced)
# Needs torch with CUDA, nvcc and ninja (PYTHON picks the interpreter, default python3). The last line of
# stdout is the directory to put on PYTHONPATH (it holds the importable `flash_mla`); the compiler's output
# goes to BUILD_DIR/build.log. A build dir already built from the same inputs is reused.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
archive=${1:-$here/../../.peers/flashmla.tar.xz}
build=${2:-/tmp/peers/flashmla}
python=${PYTHON:-python3}
die() { echo "build_flashmla: $*" >&2; exit 1; }
# torch takes CUDA_HOME from `which nvcc` otherwise: wrong where that is a wrapper script outside the toolkit.
if [[ -z ${CUDA_HOME:-} && -x /usr/local/cuda/bin/nvcc ]]; then export CUDA_HOME=/usr/local/cuda; fi

[[ -f $archive ]] || die "no archive at $archive (pack it: python3 tools/peers/pack.py flashmla --repo ... ...)"
archive=$(readlink -f "$archive")
inputs=("$archive" "$here/flashmla_setup.py" "$here/flashmla_binding.cpp")
stamp=$(cat "${inputs[@]}" | sha256sum | cut -c1-16)
check_import() { (cd "$build" && "$python" -c 'import torch, flash_mla; assert flash_mla.cuda.dense_decode_fwd'); }

if [[ -f $build/.stamp && $(<"$build/.stamp") == "$stamp" ]] && check_import 2>/dev/null; then
  echo "build_flashmla: $build is already built from these inputs; PYTHONPATH entry:" >&2
  echo "$build"
  exit 0
fi
"$python" -c 'import torch.utils.cpp_extension as e; assert e.CUDA_HOME, "no CUDA toolkit"' \
  || die "$python cannot build CUDA extensions (torch with CUDA and nvcc needed)"
rm -rf "$build" && mkdir -p "$build"
tar -xJf "$archive" -C "$build" || die "cannot extract $archive"
cp "$here/flashmla_setup.py" "$here/flashmla_binding.cpp" "$build/"
echo "build_flashmla: compiling in $build (a few minutes; log: $build/build.log)" >&2
start=$SECONDS
if ! (cd "$build" && MAX_JOBS=${MAX_JOBS:-16} "$python" flashmla_setup.py build_ext --inplace >build.log 2>&1); then
  grep -E -m 20 'error|Error' "$build/build.log" >&2 || tail -n 30 "$build/build.log" >&2
  die "build failed after $((SECONDS - start)) s; full log: $build/build.log"
fi
check_import || die "built, but 'import flash_mla' fails (run from $build to see why)"
echo "$stamp" >"$build/.stamp"
echo "build_flashmla: built in $((SECONDS - start)) s; PYTHONPATH entry:" >&2
echo "$build"

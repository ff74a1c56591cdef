"""Build FlashMLA's sm90a dense (bf16) decode alone, as ``flash_mla.cuda``, for benchmarks/mla_decode.py.

Copied by tools/peers/build_flashmla.sh into the root of the extracted FlashMLA tree (9241ae3) with
flashmla_binding.cpp, and run there: ``MAX_JOBS=16 python3 flashmla_setup.py build_ext --inplace``. Afterwards
that root, on PYTHONPATH, gives ``import flash_mla`` with FlashMLA's own Python wrapper
(``get_mla_metadata``, ``flash_mla_with_kvcache``) over the dense path.

FlashMLA's setup.py compiles every kernel it has (sm90 sparse and fp8, sm100; far longer) and runs git. Here
only what ``dense_decode_fwd`` reaches is compiled: the scheduling-metadata and combine kernels, the bf16
instantiation of the sm90 dense split-KV kernel and our binding. The nvcc flags are FlashMLA's own, less those
that only print (``ptxas -v``, ``--source-in-ptx``) and the other architectures, so its kernels compile to the
same code as in its own build.
"""

import os
import pathlib

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

ROOT = pathlib.Path(__file__).resolve().parent
SOURCES = (
    "flashmla_binding.cpp",
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
)
# fp16 is not benchmarked: the flag removes its instantiations and dense_decode.h's calls to them.
DEFINES = ["-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16"]
NVCC_FLAGS = [
    "-O3", "-std=c++20", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "--ptxas-options=--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage", "-lineinfo",
    "-gencode", "arch=compute_90a,code=sm_90a",
]


def include_dirs() -> list[str]:
  dirs = [ROOT / "csrc", ROOT / "csrc/kerutils/include", ROOT / "csrc/sm90", ROOT / "csrc/cutlass/include",
          ROOT / "csrc/cutlass/tools/util/include"]
  # CUDA 13 moved libcu++ (<cuda/std/...>, which CUTLASS's host headers include) under include/cccl: nvcc finds it
  # by itself, the host compiler of the binding does not.
  if CUDA_HOME and os.path.isdir(cccl := os.path.join(CUDA_HOME, "include", "cccl")):
    dirs.append(cccl)
  return [str(d) for d in dirs]


def host_fallback_flags() -> list[str]:
  """``-idirafter`` the headers of torch's CUDA wheels (``nvidia/*/include``) where the toolkit lacks the
  cuSPARSE/cuBLAS headers that ATen/cuda/CUDAContext.h includes (a minimal toolkit): searched after every
  other directory, they only fill that gap. Host compiler only; the kernels never include them."""
  if os.path.isfile(os.path.join(CUDA_HOME, "include", "cusparse.h")):
    return []
  try:
    import nvidia
  except ImportError:
    return []
  dirs = sorted(d for p in nvidia.__path__ for d in pathlib.Path(p).glob("*/include"))
  return [f for d in dirs for f in ("-idirafter", str(d))]


def main() -> None:
  if CUDA_HOME is None:
    raise SystemExit("flashmla_setup: torch finds no CUDA toolkit (set CUDA_HOME)")
  os.chdir(ROOT)  # the sources are relative to the FlashMLA root, as setuptools wants them
  cxx_flags = ["-O3", "-std=c++20", "-Wno-deprecated-declarations"] + DEFINES + host_fallback_flags()
  ext = CUDAExtension(name="flash_mla.cuda", sources=list(SOURCES), include_dirs=include_dirs(),
                      extra_compile_args={"cxx": cxx_flags, "nvcc": NVCC_FLAGS + DEFINES})
  setup(name="flash_mla", version="1.0.0+9241ae3.dense.sm90a", packages=["flash_mla"], ext_modules=[ext],
        cmdclass={"build_ext": BuildExtension})


if __name__ == "__main__":
  main()

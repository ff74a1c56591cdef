"""Compile the product's calls for the H200 (sm_90a) on a machine without a GPU, and report what the GPU would run.

``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` stops at StableHLO. This goes on through XLA's GPU
compiler, Mosaic GPU's lowering to PTX and ptxas, against a compile-only CUDA device that jax builds from
``tools/h200_target_config.txtpb`` (a deviceless topology). For each case it reports every Mosaic GPU kernel as
ptxas sees it (registers, spilled bytes: spills are what sank the persistent KDA prep and are invisible to
interpret mode) and the XLA kernels that the call launches around them (each costs about a microsecond on the
GPU's stream).

It needs the CUDA PJRT plugin of the pinned jaxlib on ``sys.path`` and ptxas (CUDA 13) on ``PATH``. ``make aot``
installs the plugin's two wheels into ``.aot/``, outside the virtual environment, so that no other process of the
test suite sees a CUDA plugin:

  make aot && PYTHONPATH=.aot:. .venv/bin/python tools/sm90_compile.py [--cases NAME ...] [--json FILE] [--sass DIR]

``--sass DIR`` also writes each case's ptxas report and SASS to ``DIR/<case>.txt`` (where the spills sit): Mosaic
GPU runs nvdisasm from the CUDA root that the plugin finds when it loads, so the script points ``CUDA_ROOT`` at one
first (``.aot/cuda``: the machine's CUDA with the nvdisasm that ``make aot`` installs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
AOT = ROOT / ".aot"
SYSTEM_CUDA = pathlib.Path(os.environ.get("CUDA_ROOT", "/usr/local/cuda"))


def cuda_root_with_nvdisasm() -> pathlib.Path:
  """``.aot/cuda``: the machine's CUDA root (``CUDA_ROOT`` or /usr/local/cuda) entry by entry, plus the nvdisasm of
  ``make aot`` in its ``bin`` (the machine's CUDA has none)."""
  nvdisasm = next(AOT.glob("nvidia/cu*/bin/nvdisasm"), None)
  if nvdisasm is None or not (SYSTEM_CUDA / "bin" / "ptxas").exists():
    raise RuntimeError(f"--sass needs nvdisasm in {AOT} (make aot) and ptxas in {SYSTEM_CUDA}/bin")
  root = AOT / "cuda"
  if SYSTEM_CUDA.resolve() == root.resolve():
    raise RuntimeError(f"CUDA_ROOT must be the machine's CUDA, not {root}")
  shutil.rmtree(root, ignore_errors=True)
  (root / "bin").mkdir(parents=True)
  for entry in SYSTEM_CUDA.iterdir():
    if entry.name != "bin":
      (root / entry.name).symlink_to(entry.resolve())
  for tool in (SYSTEM_CUDA / "bin").iterdir():
    (root / "bin" / tool.name).symlink_to(tool.resolve())
  nvdisasm.chmod(0o755)
  (root / "bin" / "nvdisasm").symlink_to(nvdisasm.resolve())
  return root


if __name__ == "__main__":  # before jax and the plugin read them
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin is compiled against, never initialised
  if "--sass" in sys.argv:  # Mosaic GPU runs nvdisasm from the CUDA root the plugin finds when it loads
    os.environ["CUDA_ROOT"] = str(cuda_root_with_nvdisasm())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

TARGET_CONFIG = ROOT / "tools" / "h200_target_config.txtpb"
# XLA's kernels in the optimized HLO's entry computation: fusions, custom calls (Mosaic GPU's are
# ``mosaic_gpu``), and the few ops XLA emits as kernels of their own.
_KERNEL_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? (fusion|custom-call|sort|scatter|gather|copy)\(")
_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
# nvdisasm's text: an instruction (``/*0a10*/  @!P1 BRA `(.L_x_4) ;``), a label, a branch's target.
_SASS_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_TARGET = re.compile(r"\bBRA `\((\.L_x_\d+)\)")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One Mosaic GPU kernel as ptxas compiled it."""
  name: str
  arch: str
  registers: int
  spill_stores: int
  spill_loads: int
  stack_bytes: int


@dataclasses.dataclass(frozen=True)
class Report:
  """A compiled call: its Mosaic GPU kernels (in compile order) and the ops of its entry computation that run
  as kernels (``name: kind``), Mosaic GPU's custom calls among them."""
  case: str
  kernels: tuple[Kernel, ...]
  xla_kernels: tuple[str, ...]

  def xla_only(self) -> tuple[str, ...]:
    """The entry's kernels other than the Mosaic GPU custom calls (and other than a copy of a donated buffer's
    input, which a caller that donates does not run)."""
    return tuple(k for k in self.xla_kernels if not k.endswith(": custom-call") and not k.endswith(": copy"))


def compile_only_device() -> jax.Device:
  """The H200 as a compile-only device (no GPU needed; the CUDA plugin must be importable)."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc("", "cuda", topology="1x1x1", target_config=TARGET_CONFIG.read_text())
  return topo.devices[0]


@contextlib.contextmanager
def _captured_fds():
  """Collects what the process writes to file descriptors 1 and 2 (ptxas's report comes from the plugin's C++
  code, not through Python's streams); yields a list that holds the text afterwards."""
  out: list[str] = []
  sys.stdout.flush()
  sys.stderr.flush()
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    saved = [os.dup(1), os.dup(2)]
    try:
      os.dup2(tmp.fileno(), 1)
      os.dup2(tmp.fileno(), 2)
      yield out
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
      tmp.seek(0)
      out.append(tmp.read().decode(errors="replace"))


def parse_ptxas(text: str) -> tuple[Kernel, ...]:
  """The kernels of ptxas's ``-v`` report, in order."""
  kernels, current = [], None
  for line in text.splitlines():
    if m := _PTXAS_FUNC.search(line):
      current = {"name": m.group(1), "arch": m.group(2)}
    elif current is not None and (m := _PTXAS_SPILL.search(line)):
      current.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    elif current is not None and (m := _PTXAS_REGS.search(line)):
      kernels.append(Kernel(registers=int(m.group(1)), **current))
      current = None
  return tuple(kernels)


def sass_loops(sass: str) -> list[tuple[str, ...]]:
  """The loops of ``--sass`` output, shortest first: for each branch back to a label of its own function, the
  instructions from that label to the branch (a loop's body with its inner loops; a wait's retry block placed after
  the function's body gives one that reaches back from there)."""
  instructions: list[str] = []
  labels: dict[str, int] = {}
  loops = []
  for line in sass.splitlines():
    if line.startswith(".text."):  # a function's labels are its own
      labels = {}
    if m := _SASS_LABEL.match(line):
      labels[m.group(1)] = len(instructions)
    elif m := _SASS_INSTR.match(line):
      instructions.append(m.group(1))
      if (target := _SASS_TARGET.search(m.group(1))) and target.group(1) in labels:
        loops.append(tuple(instructions[labels[target.group(1)]:]))
  return sorted(loops, key=len)


def opcode(instruction: str) -> str:
  """``LDL.LU`` of ``@!P1 LDL.LU R2, [R1+0x4]``."""
  words = instruction.split()
  return words[1] if words[0].startswith("@") else words[0]


def entry_kernels(hlo_text: str) -> tuple[str, ...]:
  """``name: kind`` of each op of the optimized HLO's entry computation that XLA launches as a kernel."""
  entry = hlo_text[hlo_text.index("\nENTRY "):]
  return tuple(f"{m.group(1)}: {m.group(2)}" for line in entry.splitlines() if (m := _KERNEL_OP.match(line)))


def compile_report(case: str, fn: Callable, *args: jax.ShapeDtypeStruct, log_to: pathlib.Path | None = None
                   ) -> Report:
  """Compiles ``jax.jit(fn)(*args)`` (shapes only) for the H200 and reports its kernels (``log_to``: also write the
  compile's output there, with SASS if ``MOSAIC_GPU_DUMP_SASS`` is set). Run with ``JAX_PLATFORMS=cpu`` (the
  script sets it): the CUDA plugin is compiled against, never initialised."""
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # read by Mosaic GPU's compiler in the plugin, per kernel
  sharding = jax.sharding.SingleDeviceSharding(compile_only_device())
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  with _captured_fds() as log:
    compiled = jax.jit(fn).trace(*specs).lower().compile()
  if log_to is not None:
    log_to.write_text(log[0])
  kernels = parse_ptxas(log[0])
  if not kernels:
    raise RuntimeError(f"{case}: no ptxas report in the compile's output (is ptxas on PATH?):\n{log[0][-2000:]}")
  return Report(case, kernels, entry_kernels(compiled.as_text()))


def _s(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype)


def _kda_prefill_case(N: int, L: int, H: int, *, ckpt_per_seq: int = 0, state_dtype=jnp.float32):
  from pallas_kernels import KdaConfig, kda_prefill
  T, K = N * L, 128
  M = N * ckpt_per_seq
  cfg = KdaConfig(lower_bound=-5.0, state_dtype=state_dtype, impl="pallas")
  bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
  ck = (_s((N + 1,), i32), _s((M,), i32), _s((M,), i32)) if ckpt_per_seq else ()

  def call(q, k, v, g, b, a, d, cu, pool, si, hi, *ck_args):
    ci, co, cs = ck_args if ck_args else (None, None, None)
    return kda_prefill(q, k, v, g, b, A_log=a, dt_bias=d, cu_seqlens=cu, state_pool=pool, state_indices=si,
                       has_initial_state=hi, checkpoint_indptr=ci, checkpoint_offsets=co, checkpoint_slots=cs,
                       config=cfg)

  return call, (_s((T, H, K), bf), _s((T, H, K), bf), _s((T, H, K), bf), _s((T, H, K), bf), _s((T, H), bf),
                _s((H,), f32), _s((H, K), f32), _s((N + 1,), i32), _s((N + M, H, K, K), state_dtype),
                _s((N,), i32), _s((N,), jnp.bool_)) + ck


def _kda_decode_case(N: int, H: int):
  from pallas_kernels import KdaConfig, kda_decode
  K, bf, f32 = 128, jnp.bfloat16, jnp.float32
  cfg = KdaConfig(lower_bound=-5.0, impl="pallas")

  def call(q, k, v, g, b, a, d, pool, si):
    return kda_decode(q, k, v, g, b, A_log=a, dt_bias=d, state_pool=pool, state_indices=si, config=cfg)

  return call, (_s((N, H, K), bf), _s((N, H, K), bf), _s((N, H, K), bf), _s((N, H, K), bf), _s((N, H), bf),
                _s((H,), f32), _s((H, K), f32), _s((N, H, K, K), f32), _s((N,), jnp.int32))


def _mla_decode_case(B: int, Hq: int, context: int, cache_dtype, tuning=None):
  from pallas_kernels import MlaDecodeConfig, mla_decode
  from pallas_kernels.mla import cache_format
  from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM
  pages = context // PAGE_SIZE
  cfg = MlaDecodeConfig(scale=192 ** -0.5, impl="pallas", tuning=tuning)
  width = cache_format.row_width(LATENT_DIM + ROPE_DIM, cache_dtype)

  def call(q, kv, table, lens):
    return mla_decode(q, kv, table, lens, config=cfg)

  return call, (_s((B, Hq, LATENT_DIM + ROPE_DIM), jnp.bfloat16), _s((B * pages, PAGE_SIZE, width), cache_dtype),
                _s((B, pages), jnp.int32), _s((B,), jnp.int32))


def _short_conv_case(T: int, D: int, W: int, N: int):
  from pallas_kernels import ShortConvConfig, short_conv_prefill
  cfg = ShortConvConfig(impl="pallas")

  def call(x, w, cu, pool, si, hi):
    return short_conv_prefill(x, w, cu_seqlens=cu, conv_pool=pool, state_indices=si, has_initial_state=hi,
                              config=cfg)

  return call, (_s((T, D), jnp.bfloat16), _s((D, W), jnp.bfloat16), _s((N + 1,), jnp.int32),
                _s((N, W - 1, D), jnp.bfloat16), _s((N,), jnp.int32), _s((N,), jnp.bool_))


def _mla_prefill_case(T: int, H: int):
  from pallas_kernels import MlaPrefillConfig, mla_prefill_attention
  cfg = MlaPrefillConfig(scale=192 ** -0.5, impl="pallas")

  def call(q, kn, kr, v, cu):
    return mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, config=cfg)

  bf = jnp.bfloat16
  return call, (_s((T, H, 192), bf), _s((T, H, 128), bf), _s((T, 64), bf), _s((T, H, 128), bf),
                _s((2,), jnp.int32))


def _mla_tuning(**fields):
  from pallas_kernels.mla import MlaDecodeTuning
  return MlaDecodeTuning(**fields)


# The benchmarks' shapes (K = V = 128 for KDA, K3's MLA dims, B = 32 at 32K for the decode).
CASES: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "kda-prefill-8x1024-h96": lambda: _kda_prefill_case(8, 1024, 96),
    "kda-prefill-8x1024-h96-ckpt4": lambda: _kda_prefill_case(8, 1024, 96, ckpt_per_seq=4),
    "kda-prefill-8x1024-h96-bf16-state": lambda: _kda_prefill_case(8, 1024, 96, state_dtype=jnp.bfloat16),
    "kda-prefill-8192-h11": lambda: _kda_prefill_case(1, 8192, 11),
    "kda-prefill-8192-h96": lambda: _kda_prefill_case(1, 8192, 96),
    "kda-prefill-32768-h32": lambda: _kda_prefill_case(1, 32768, 32),
    "kda-decode-64-h96": lambda: _kda_decode_case(64, 96),
    "mla-decode-hq16-bf16": lambda: _mla_decode_case(32, 16, 32768, jnp.bfloat16),
    "mla-decode-hq128-bf16": lambda: _mla_decode_case(32, 128, 32768, jnp.bfloat16),
    "mla-decode-hq16-fp8": lambda: _mla_decode_case(32, 16, 32768, jnp.float8_e4m3fn,
                                                    _mla_tuning(fp8_in_registers=False)),
    "mla-decode-hq16-fp8-regs": lambda: _mla_decode_case(32, 16, 32768, jnp.float8_e4m3fn,
                                                         _mla_tuning(fp8_in_registers=True)),
    "mla-decode-hq128-fp8": lambda: _mla_decode_case(32, 128, 32768, jnp.float8_e4m3fn),
    "short-conv-prefill": lambda: _short_conv_case(8192, 4096, 4, 8),
    "mla-prefill-8192-h16": lambda: _mla_prefill_case(8192, 16),
}


def run(names, sass_dir: pathlib.Path | None = None) -> list[Report]:
  if sass_dir is not None:
    sass_dir.mkdir(parents=True, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
  reports = []
  for name in names:
    fn, args = CASES[name]()
    reports.append(compile_report(name, fn, *args, log_to=sass_dir / f"{name}.txt" if sass_dir else None))
  return reports


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
  parser.add_argument("--json", type=pathlib.Path, help="write the reports here as JSON")
  parser.add_argument("--sass", type=pathlib.Path, metavar="DIR", help="write each case's ptxas report and SASS here")
  args = parser.parse_args(argv)
  reports = run(args.cases, args.sass)
  for r in reports:
    print(f"{r.case}: {len(r.xla_only())} XLA kernels beside the Mosaic GPU ones ({', '.join(r.xla_only())})")
    for k in r.kernels:
      print(f"  {k.name} ({k.arch}): {k.registers} registers, {k.spill_stores} B spill stores, "
            f"{k.spill_loads} B spill loads")
  if args.json:
    args.json.write_text(json.dumps([dict(dataclasses.asdict(r), xla_only=r.xla_only()) for r in reports], indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

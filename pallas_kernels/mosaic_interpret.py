"""Mosaic GPU interpret mode for the kernels and their tests; the only importer of its JAX API (private-looking
and liable to move between JAX versions).

Interpret mode simulates SMEM, TMA, barriers and wgmma on the CPU and records races; it needs every wgmma
operand in SMEM and no ``emit_pipeline``, and it fails under ``shard_map`` over several devices: it keeps one
table of SMEM and barriers for the whole process, and a kernel's end-of-kernel check that no barrier is left
sees the barriers of a kernel another device is still interpreting.
"""

import contextlib
from collections.abc import Iterator

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu


@contextlib.contextmanager
def interpret_mode(enabled: bool = True, *, detect_races: bool = True) -> Iterator[None]:
  """Run ``plgpu.kernel`` calls traced inside this context in interpret mode (no-op when not enabled).

  ``detect_races``: accesses of the warpgroup threads and the TMA engine to the same SMEM that no barrier orders
  are recorded (``races_found``; the tests fail on one), which catches a missing wait that the sequential
  simulation would otherwise hide. The detector also treats each ``RefUnion`` group as one buffer: reading
  through one group after a write through another is reported even where their bytes do not overlap.
  """
  if not enabled:
    yield
    return
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=detect_races)):
    yield


def races_found() -> bool:
  """Whether an interpreted kernel since the last ``reset_state`` had a data race (each printed when found)."""
  races = gpu_callbacks._races  # None until a kernel is interpreted after a reset
  return races is not None and races.races_found


def reset_state() -> None:
  """Drops the interpreter's process-wide state (simulated memory, race detection).

  The interpreter cleans up after a kernel, also a failed one, but not after an interrupted run or two
  devices interpreting at once; without a reset, every later interpreted kernel fails on the leftovers.
  """
  interpret_pallas_call.reset_gpu_interpret_mode_state()

"""Mosaic GPU interpret mode for the kernels and their tests; the only importer of its JAX API (private-looking
and liable to move between JAX versions).

Interpret mode simulates SMEM, TMA, barriers and wgmma on the CPU and catches races; it needs every wgmma
operand in SMEM and no ``emit_pipeline``, and it fails under ``shard_map`` over several devices: it keeps one
table of SMEM and barriers for the whole process, and a kernel's end-of-kernel check that no barrier is left
sees the barriers of a kernel another device is still interpreting.
"""

import contextlib
from collections.abc import Iterator

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
  """Run ``plgpu.kernel`` calls traced inside this context in interpret mode (no-op when not enabled)."""
  if not enabled:
    yield
    return
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    yield


def reset_state() -> None:
  """Drops the interpreter's process-wide state (simulated memory, race detection).

  The interpreter cleans up after a kernel, also a failed one, but not after an interrupted run or two
  devices interpreting at once; without a reset, every later interpreted kernel fails on the leftovers.
  """
  interpret_pallas_call.reset_gpu_interpret_mode_state()

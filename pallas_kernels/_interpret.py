"""The only importer of Mosaic GPU interpret mode (a private-looking API that may move between JAX versions).

Interpret mode simulates SMEM, TMA, barriers and wgmma on the CPU and catches races; it needs every wgmma
operand in SMEM and no ``emit_pipeline``, and it fails under ``shard_map`` over several devices.
"""

import contextlib
from collections.abc import Iterator

from jax.experimental.pallas import mosaic_gpu as plgpu


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
  """Run ``plgpu.kernel`` calls traced inside this context in interpret mode (no-op when not enabled)."""
  if not enabled:
    yield
    return
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    yield

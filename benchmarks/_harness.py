"""What every benchmark shares: the H200's measured ceilings, CUPTI kernel timings, L2-busting rotations.

The ceilings are those measured on the H200 (benchmarks/RESULTS.md): a roofline fraction is a time against
``max(FLOPs / PEAK_BF16_FLOPS, bytes / COPY_BYTES_PER_S)``.
"""

import contextlib

import numpy as np

# bf16 tensor-core rate and device-to-device copy bandwidth (read + write) measured on the H200.
PEAK_BF16_FLOPS = 790e12
COPY_BYTES_PER_S = 4.27e12
# Larger than the H200's L2 (50 MB): a working set of three times this is never L2 resident.
L2_BYTES = 60e6


@contextlib.contextmanager
def cupti_kernels():
  """Collects ``(kernel name, ms)`` of every kernel that runs inside (JAX's CUPTI hook, also sees torch)."""
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
  ext = mosaic_gpu_lib._mosaic_gpu_ext
  records: list[tuple[str, float]] = []
  ext._cupti_init()
  try:
    yield records
  finally:
    records.extend(ext._cupti_get_timings(True))


def rotation_plan(state_bytes: int) -> tuple[int, int]:
  """``(rotations, iters)`` for a working set of ``state_bytes``: enough rotating copies that three times the
  L2 never holds the next step's states, and about 2 GB of state traffic timed (a multiple of the rotations)."""
  rot = int(min(64, max(1, np.ceil(3 * L2_BYTES / state_bytes))))
  return rot, int(min(400, max(20, 2e9 / (2 * state_bytes)))) // rot * rot or rot

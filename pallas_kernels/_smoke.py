"""A tiny Mosaic GPU kernel exercising the features every kernel here relies on: TMA and wgmma.

It proves that the toolchain works end to end (interpret mode on CPU in CI, the CUDA lowering on CPU, and
the compiled kernel on a Hopper GPU) before anything larger is debugged.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import util

TILE = 64  # one wgmma tile: M = N = K = 64 (one warpgroup, 128-byte swizzle for bf16)


def _smoke_body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, out_smem, barrier):
  plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier.at[0])
  plgpu.copy_gmem_to_smem(b_gmem, b_smem, barrier.at[1])
  plgpu.barrier_wait(barrier.at[0])
  plgpu.barrier_wait(barrier.at[1])

  def matmul(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  out_smem[...] = pl.run_scoped(matmul, plgpu.ACC((TILE, TILE), jnp.float32))
  # The generic-proxy SMEM writes must be visible to the TMA engine before it reads them.
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_gmem)
  plgpu.wait_smem_to_gmem(0)

@jax.jit
def smoke_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` with f32 accumulation, as one Mosaic GPU program (TMA loads, one wgmma, TMA store).

  Args:
    a: ``[64, 64]`` bf16.
    b: ``[64, 64]`` bf16.

  Returns:
    ``[64, 64]`` f32.
  """
  for name, x in (("a", a), ("b", b)):
    util.check_shape(name, x, (TILE, TILE))
    util.check_dtype(name, x, (jnp.bfloat16,))
  kernel = plgpu.kernel(
      _smoke_body,
      out_type=jax.ShapeDtypeStruct((TILE, TILE), jnp.float32),
      scratch_types=(
          plgpu.SMEM((TILE, TILE), jnp.bfloat16, transforms=util.smem_transforms(jnp.bfloat16, TILE)),
          plgpu.SMEM((TILE, TILE), jnp.bfloat16, transforms=util.smem_transforms(jnp.bfloat16, TILE)),
          plgpu.SMEM((TILE, TILE), jnp.float32),
          plgpu.Barrier(num_barriers=2),
      ),
      compiler_params=util.compiler_params(),
  )
  return kernel(a, b)

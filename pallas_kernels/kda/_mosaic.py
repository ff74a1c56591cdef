"""Mosaic GPU building blocks shared by the two KDA prefill stages (``prefill_prep``, ``prefill_state``):
the WGMMA register layouts, bf16 operand buffers in SMEM and vector broadcasts."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import util

WG = plgpu.Layout.WGMMA
ROWV = WG.reduce(1)  # one value per row, broadcast along columns
COLV = WG.reduce(0)  # one value per column, broadcast along rows
f32, bf16 = jnp.float32, jnp.bfloat16


def tiled(shape: tuple[int, ...], dtype=bf16) -> plgpu.SMEM:
  """SMEM buffer in the wgmma operand form (``util.smem_transforms``: 8-row tiles with the widest swizzle of a
  row; 8 x 64 tiles and a 128-byte swizzle for the kernels' bf16 rows of 64 or 128 elements)."""
  return plgpu.SMEM(shape, dtype, transforms=util.smem_transforms(dtype, shape[-1]))


def bcast_rows(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """[M] per-row vector -> [M, N]."""
  return lax.broadcast_in_dim(vec, shape, [0])


def bcast_cols(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """[N] per-column vector -> [M, N]."""
  return lax.broadcast_in_dim(vec, shape, [1])


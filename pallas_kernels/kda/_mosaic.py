"""Mosaic GPU building blocks shared by the two KDA prefill stages (``prefill_prep``, ``prefill_state``):
the WGMMA register layouts, bf16 operand buffers in SMEM, vector broadcasts and accumulators started from
values."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
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


def accumulate(products, *inits: jax.Array, from_inits: bool) -> tuple[jax.Array, ...]:
  """``inits`` (f32 arrays in the WGMMA layout) plus what ``products(*acc_refs)`` issues into one accumulator
  each (wgmma), as values.

  ``from_inits``: the accumulators start at ``inits`` (``plgpu.ACC.init``), so the products need no second set
  of registers and no adds after them. Interpret mode cannot start an accumulator from registers: with False
  they start at zero and ``inits`` are added afterwards (the same sums, rounded in another order).
  """
  if from_inits:
    return tuple(pl.run_state(lambda refs: products(*refs))(tuple(plgpu.ACC.init(x) for x in inits)))

  def body(*refs):
    products(*refs)
    return tuple(r[...] for r in refs)

  outs = pl.run_scoped(body, *(plgpu.ACC(x.shape, f32) for x in inits))
  return tuple(x + y for x, y in zip(inits, outs))

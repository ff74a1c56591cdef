"""Rows of the paged latent cache, in 16/32-bit floats or in fp8 (e4m3) with per-token scales.

A 16/32-bit cache row is ``[c (Dc) | k_pe (Dr)]`` in the cache dtype. An fp8 row (``float8_e4m3fn``) keeps the
same ``Dc + Dr`` values divided by a scale, then the scales themselves:

    [ c / s_c (Dc x e4m3) | k_pe / s_pe (Dr x e4m3) | s_c (f32, 4 bytes) | s_pe (f32, 4 bytes) | 56 zero bytes ]

so its width is ``Dc + Dr + 64`` e4m3 elements (``row_width``): 640 for K3's 576. Why per token and in the row:

* A token's scales are fixed when its row is written (``s = amax / 448`` over its latent part and over its rope
  part), so nothing is calibrated and no write ever rescales older rows; a per-tensor scale would need a
  calibration, and a value past it would overflow e4m3 (which has no infinity) to NaN.
* The latent (an RMSNorm output) and the rope part are projected apart and need not share a magnitude, hence
  two scales. Within a part, e4m3's range (2^-9 to 448) covers what one scale leaves, so finer groups buy
  little.
* Kept in the row, the scales travel with it: every path that moves cache rows (the paged and DCP writes and
  reads, page sharing between requests) moves them unchanged, and a kernel reads them with the row's values.
  The 64-byte tail keeps rows a multiple of 64 bytes: a kernel's TMA copies them in 64-byte swizzled tiles
  (16-byte tiles, all that 592-byte rows allow, load no faster than a bf16 row of twice the bytes). It costs 10%
  of the row.

Reading a row back gives ``value * scale`` rounded to bf16 (``dequantize_rows``): the values that the XLA path,
the model's prefill read-back and the MLA decode kernel's 64-row tiles read. The narrow kernel (at most 16
heads) multiplies the unscaled values in f16 and applies the scales to the logits and to P, so it attends to the
exact ``value * scale``. That bf16 rounding (2^-9 relative) is small next to e4m3's own (2^-4). A part with a
non-finite value has a non-finite scale and reads back all NaN (or inf), so a NaN written still reaches the
heads that attend to it; an all-zero part gets scale 1 (not 0, which would read back 0 / 0).
"""

import jax
import jax.numpy as jnp
from jax import lax

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
TAIL = 64  # e4m3 elements (bytes) after the values: two f32 scales and 56 zero bytes
CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, FP8)


def is_fp8(dtype) -> bool:
  return jnp.dtype(dtype) == jnp.dtype(FP8)


def row_width(dim: int, dtype) -> int:
  """Elements of a cache row holding ``dim`` values (``Dc + Dr``) in ``dtype``."""
  return dim + TAIL if is_fp8(dtype) else dim


def part_scale(x: jax.Array) -> jax.Array:
  """The e4m3 scale of each row of ``x`` (its last axis, kept): ``amax_scale(row_amax(x))``."""
  return amax_scale(row_amax(x))


def row_amax(x: jax.Array) -> jax.Array:
  """``max |x|`` over the last axis of ``x`` (kept), NaN for a row with a NaN. One reduction, whose reducer carries a
  NaN through a sum: XLA's CPU max reduction can skip a NaN (a vectorised max that keeps its other operand), and a
  second reduction looking for NaNs costs the GPU a kernel more (its select cannot fuse into both consumers)."""
  amax = lax.reduce(jnp.abs(x), jnp.array(0, x.dtype),
                    lambda a, b: jnp.where(jnp.isnan(a) | jnp.isnan(b), a + b, jnp.maximum(a, b)), (x.ndim - 1,))
  return amax[..., None]


def amax_scale(amax: jax.Array) -> jax.Array:
  """The e4m3 scale of a row of largest magnitude ``amax``: ``amax / 448``, 1 for an all-zero row, NaN for a row
  with a NaN and inf for one with an inf (either reads back non-finite). Elementwise, so it also runs in a kernel
  on a vector of row maxima."""
  return jnp.where(amax == 0, 1.0, amax / FP8_MAX)


def quantize_rows(rows: jax.Array, dtype, latent_dim: int) -> jax.Array:
  """Cache rows in ``dtype`` from latent rows ``[..., Dc + Dr]`` (any float dtype).

  Returns ``rows.astype(dtype)`` for a 16/32-bit ``dtype``; for fp8, ``[..., Dc + Dr + 64]`` e4m3 rows as in the
  module docstring (scales from the f32 values, each part scaled to at most 448 in magnitude).
  """
  if not is_fp8(dtype):
    return rows.astype(dtype)
  x = rows.astype(jnp.float32)
  parts = (x[..., :latent_dim], x[..., latent_dim:])
  scales = [part_scale(p) for p in parts]
  # The clip only catches the rounding of amax / 448 (x / s may land a hair above 448); it keeps NaN.
  values = [jnp.clip(p / s, -FP8_MAX, FP8_MAX).astype(FP8) for p, s in zip(parts, scales)]
  bits = jax.lax.bitcast_convert_type(jnp.concatenate(scales, axis=-1), jnp.uint8)  # [..., 2, 4]
  tail = jnp.concatenate([bits.reshape(bits.shape[:-2] + (8,)), jnp.zeros(bits.shape[:-2] + (TAIL - 8,),
                                                                            jnp.uint8)], axis=-1)
  return jnp.concatenate(values + [jax.lax.bitcast_convert_type(tail, FP8)], axis=-1)


def dequantize_rows(rows: jax.Array, latent_dim: int) -> jax.Array:
  """Latent rows ``[..., Dc + Dr]`` of cache rows: the rows themselves for a 16/32-bit cache, ``value * scale``
  (in f32, then rounded to bf16) for an fp8 cache (``[..., Dc + Dr + 64]``)."""
  if not is_fp8(rows.dtype):
    return rows
  dim = rows.shape[-1] - TAIL
  tail = jax.lax.bitcast_convert_type(rows[..., dim:dim + 8], jnp.uint8)
  scales = jax.lax.bitcast_convert_type(tail.reshape(tail.shape[:-1] + (2, 4)), jnp.float32)  # [..., 2]
  x = rows[..., :dim].astype(jnp.float32)
  return jnp.concatenate([x[..., :latent_dim] * scales[..., :1], x[..., latent_dim:] * scales[..., 1:]],
                         axis=-1).astype(jnp.bfloat16)

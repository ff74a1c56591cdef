"""RMSNorm, computed in f32 whatever the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import nn_util


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """``x * rsqrt(mean(x^2) + eps)`` over the last axis, in f32 (no weight)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """``weight * x * rsqrt(mean(x^2) + eps)`` over the last axis; f32 inside, output in ``dtype``."""

  def __init__(self, dim: int, *, eps: float, name: str | None, dtype, param_dtype, rngs: nnx.Rngs):
    self.eps = float(eps)
    self.dtype = jnp.dtype(dtype)
    self.weight = nn_util.param(rngs, nn_util.norm_weight, (dim,), param_dtype, (name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [..., dim]`` (any float dtype) -> ``[..., dim]`` in ``dtype``."""
    return (rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)).astype(self.dtype)

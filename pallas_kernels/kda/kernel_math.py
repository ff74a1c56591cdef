"""Elementwise math shared by the KDA Mosaic GPU kernels (prefill prep and decode), written with the ops
Mosaic GPU lowers (no ``log1p``). Constants come from the reference, the source of truth."""

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.reference import GATE_FLOOR, L2NORM_EPS, SOFTPLUS_THRESHOLD
from pallas_kernels.util import LOG2E

__all__ = ["GATE_FLOOR", "L2NORM_EPS", "gate", "reciprocal"]


def reciprocal(y: jax.Array) -> jax.Array:
  """``1 / y`` for ``y > 0`` (inf gives 0, NaN gives NaN) as ``rsqrt(y)²``, for kernels compiled with
  ``approx_math``. Mosaic GPU lowers ``/`` to IEEE division (``div.rn.f32``: about ten instructions around a
  branch to a slow path, which also keeps the compiler from interleaving neighbouring elements) whatever
  ``approx_math`` says; ``rsqrt.approx`` squared is two instructions, relative error about 2^-22."""
  r = lax.rsqrt(y)
  return r * r


def gate(x: jax.Array, a: jax.Array, lower_bound: float | None, *, scale: float = 1.0,
         approx: bool = False) -> jax.Array:
  """``scale`` times the KDA gate on ``x = g_raw + dt_bias`` (f32), ``a = exp(A_log[h])``, natural log:
  ``-a softplus(x)``, or ``lower_bound * sigmoid(a x)`` with a lower bound (``reference.kda_gate``).

  ``scale`` (a Python float) folds into the gate's constant factor. ``approx``: for a kernel compiled with
  ``approx_math``, the lower-bound gate's sigmoid as one ``exp2`` (``log2 e`` folded into ``a``) and a
  ``reciprocal`` instead of a division.
  """
  if lower_bound is not None:
    if approx:
      return (lower_bound * scale) * reciprocal(1.0 + jnp.exp2(x * (-LOG2E * a)))
    return (lower_bound * scale) / (1.0 + jnp.exp(-a * x))
  # log(1 + e^x) instead of log1p: Mosaic GPU has no log1p; the absolute error stays ~1e-7.
  softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log(1.0 + jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
  return (-scale * a) * softplus

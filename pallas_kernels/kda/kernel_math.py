"""Elementwise math shared by the KDA Mosaic GPU kernels (prefill prep and decode), written with the ops
Mosaic GPU lowers (no ``log1p``). Constants come from the reference, the source of truth."""

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.reference import GATE_FLOOR, L2NORM_EPS, SOFTPLUS_THRESHOLD
from pallas_kernels.util import LOG2E

__all__ = ["GATE_FLOOR", "L2NORM_EPS", "bounded_gate_log2", "gate", "reciprocal"]


def reciprocal(y: jax.Array) -> jax.Array:
  """``1 / y`` for ``y > 0`` (inf gives 0, NaN gives NaN) as ``rsqrt(y)²``, for kernels compiled with
  ``approx_math``: Mosaic GPU lowers ``/`` to ``div.full.f32`` (a reciprocal with range checks and fixups) whatever
  ``approx_math`` says, while ``rsqrt.approx`` squared is two instructions, relative error about 2^-22."""
  r = lax.rsqrt(y)
  return r * r


def gate(x: jax.Array, a: jax.Array, lower_bound: float | None, *, scale: float = 1.0) -> jax.Array:
  """``scale`` times the KDA gate on ``x = g_raw + dt_bias`` (f32), ``a = exp(A_log[h])``, natural log:
  ``-a softplus(x)``, or ``lower_bound * sigmoid(a x)`` with a lower bound (``reference.kda_gate``). ``scale``
  (a Python float) folds into the gate's constant factor."""
  if lower_bound is not None:
    return (lower_bound * scale) / (1.0 + jnp.exp(-a * x))
  # log(1 + e^x) instead of log1p: Mosaic GPU has no log1p; the absolute error stays ~1e-7.
  softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log(1.0 + jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
  return (-scale * a) * softplus


def bounded_gate_log2(g_raw: jax.Array, dt_bias: jax.Array, a: jax.Array, lower_bound: float) -> jax.Array:
  """``gate(g_raw + dt_bias, a, lower_bound, scale=log2 e)`` for kernels compiled with ``approx_math``, in the
  fewest instructions per element: the exponent as one FMA (``dt_bias`` broadcastable to ``g_raw`` and scaled
  once), one ``exp2`` and a ``reciprocal`` instead of a division."""
  c = -LOG2E * a
  return (lower_bound * LOG2E) * reciprocal(1.0 + jnp.exp2(g_raw * c + dt_bias * c))

"""Elementwise math shared by the KDA Mosaic GPU kernels (prefill prep and decode), written with the ops
Mosaic GPU lowers (no ``log1p``). Constants come from the reference, the source of truth."""

import jax
import jax.numpy as jnp

from pallas_kernels.kda.reference import GATE_FLOOR, L2NORM_EPS, SOFTPLUS_THRESHOLD

__all__ = ["GATE_FLOOR", "L2NORM_EPS", "gate"]


def gate(x: jax.Array, a: jax.Array, lower_bound: float | None) -> jax.Array:
  """The KDA gate on ``x = g_raw + dt_bias`` (f32), ``a = exp(A_log[h])``, natural log: ``-a softplus(x)``, or
  ``lower_bound * sigmoid(a x)`` with a lower bound (``reference.kda_gate``)."""
  if lower_bound is not None:
    return lower_bound / (1.0 + jnp.exp(-a * x))
  # log(1 + e^x) instead of log1p: Mosaic GPU has no log1p; the absolute error stays ~1e-7.
  softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log(1.0 + jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
  return -a * softplus

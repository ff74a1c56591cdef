"""Static configuration of the KDA ops (prefill and decode)."""

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import util


def _to_float(name: str, value) -> float:
  """``float(value)``, or a ValueError naming the field (float() itself names only the value)."""
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a float or None, got {value!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KdaConfig:
  """One frozen, hashable config for ``kda_prefill`` and ``kda_decode``.

  Attributes:
    lower_bound: None selects the Kimi-Linear softplus gate ``g = -exp(A_log) * softplus(f + dt_bias)``;
      a float in [-5, 0) selects the Kimi-K3 lower-bound gate ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))``.
    scale: query scale, a finite float > 0; None means ``K ** -0.5``.
    chunk_size: tokens per chunk of the chunked algorithm (64; checkpoint offsets are multiples of it).
    state_dtype: storage dtype of the state pool and the checkpoints (f32 or bf16). Arithmetic is f32.
    impl: "xla" (pure-JAX reference), "pallas" (Mosaic GPU kernel, Hopper) or "interpret" (the same
      kernel in Mosaic GPU interpret mode on CPU). Default: "pallas" on a Hopper GPU, else "xla".
  """

  lower_bound: float | None = None
  scale: float | None = None
  chunk_size: int = 64
  state_dtype: jnp.dtype = jnp.float32
  impl: str = dataclasses.field(default_factory=util.default_impl)

  def __post_init__(self):
    object.__setattr__(self, "state_dtype",
                       util.canonical_dtype("state_dtype", self.state_dtype, (jnp.float32, jnp.bfloat16)))
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.lower_bound is not None:
      lb = _to_float("lower_bound", self.lower_bound)
      if not -5.0 <= lb < 0.0:  # also false for NaN
        raise ValueError(f"lower_bound must be in [-5, 0) or None, got {self.lower_bound}")
      object.__setattr__(self, "lower_bound", lb)
    if self.scale is not None:
      scale = _to_float("scale", self.scale)
      if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be a finite float > 0 or None, got {self.scale}")
      object.__setattr__(self, "scale", scale)
    if self.chunk_size != 64:
      raise NotImplementedError(f"chunk_size must be 64 (16-token sub-blocks), got {self.chunk_size}")

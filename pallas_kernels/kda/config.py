"""Static configuration of the KDA ops (prefill and decode): ``KdaConfig`` and its kernel ``KdaTuning``."""

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import util

# Tokens per chunk of the chunked prefill (four 16-token sub-blocks), the only size the kernels take.
CHUNK_SIZE = 64
# How the decode kernel moves state, inputs and ``o``: TMA through SMEM, or plain global loads and stores
# on blocks of 16, 64 or 128 V rows (see ``decode_kernel``).
DECODE_STATE_IO = ("tma", "direct16", "direct64", "direct128")


def _to_float(name: str, value) -> float:
  """``float(value)``, or a ValueError naming the field (float() itself names only the value)."""
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a float or None, got {value!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KdaTuning:
  """Performance knobs of the KDA kernels; every choice gives the same results. None means "the heuristic"
  (``default_tuning``). Ignored by ``impl="xla"``.

  Attributes:
    decode_state_io: how the decode kernel moves state, inputs and ``o``, one of ``DECODE_STATE_IO``:
      "direct16" / "direct64" / "direct128" (plain global loads and stores into registers on blocks of that
      many V rows; need ``K % 32 == 0``, ``K <= 256`` and ``V`` a multiple of the rows) or "tma" (TMA through
      SMEM on 64-row blocks, any ``K % 8 == 0``).
    prefill_v_blocks: value blocks of 64 columns per program of the prefill's state pass (a warpgroup each),
      1 or 2. Two share one load of the chunk inputs that do not depend on V (fewer bytes per block, more
      SMEM, half the programs); need ``V`` a multiple of 128. With segments it sizes the second state pass;
      the first takes ``prefill_state.choose_v_blocks`` over its ``V + K`` rows.
    prefill_segments: runs of whole chunks per sequence that the prefill's state pass carries in parallel
      (>= 1): with more than one, a first pass computes each run's state transition, a combine gives each run
      its starting state and a second pass writes ``o`` (README.md, "Segments").
  """

  decode_state_io: str | None = None
  prefill_v_blocks: int | None = None
  prefill_segments: int | None = None

  def __post_init__(self):
    if self.decode_state_io is not None and self.decode_state_io not in DECODE_STATE_IO:
      raise ValueError(f"decode_state_io must be None or one of {DECODE_STATE_IO}, got {self.decode_state_io!r}")
    if self.prefill_v_blocks is not None and (isinstance(self.prefill_v_blocks, bool)
                                              or self.prefill_v_blocks not in (1, 2)):
      raise ValueError(f"prefill_v_blocks must be None, 1 or 2, got {self.prefill_v_blocks!r}")
    if self.prefill_segments is not None and (not isinstance(self.prefill_segments, int)
                                              or isinstance(self.prefill_segments, bool)
                                              or self.prefill_segments < 1):
      raise ValueError(f"prefill_segments must be None or an int >= 1, got {self.prefill_segments!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KdaConfig:
  """One frozen, hashable config for ``kda_prefill`` and ``kda_decode``.

  Attributes:
    lower_bound: None selects the Kimi-Linear softplus gate ``g = -exp(A_log) * softplus(f + dt_bias)``;
      a float in [-5, 0) selects the Kimi-K3 lower-bound gate ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))``.
    scale: query scale, a finite float > 0; None means ``K ** -0.5``.
    chunk_size: tokens per chunk of the chunked algorithm (``CHUNK_SIZE``; checkpoint offsets are multiples
      of it).
    state_dtype: storage dtype of the state pool and the checkpoints (f32 or bf16). Arithmetic is f32.
    impl: "xla" (pure-JAX reference), "pallas" (Mosaic GPU kernel, Hopper) or "interpret" (the same
      kernel in Mosaic GPU interpret mode on CPU). Default: "pallas" on a Hopper GPU, else "xla".
    tuning: ``KdaTuning`` of the kernels, or None for the heuristic in every field.
  """

  lower_bound: float | None = None
  scale: float | None = None
  chunk_size: int = CHUNK_SIZE
  state_dtype: jnp.dtype = jnp.float32
  impl: str = dataclasses.field(default_factory=util.default_impl)
  tuning: KdaTuning | None = None

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
    if self.chunk_size != CHUNK_SIZE:
      raise NotImplementedError(f"chunk_size must be {CHUNK_SIZE} (16-token sub-blocks), got {self.chunk_size}")
    if self.tuning is not None and not isinstance(self.tuning, KdaTuning):
      raise ValueError(f"tuning must be a KdaTuning or None, got {self.tuning!r}")

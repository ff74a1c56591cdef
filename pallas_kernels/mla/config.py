"""Static configuration of the split-K MLA decode, and the shape constants its kernel is specialised to."""

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import util

LATENT_DIM = 512  # Dc: kv_lora_rank; V is the first Dc cache columns.
ROPE_DIM = 64  # Dr
PAGE_SIZE = 64  # tokens per page of the paged latent cache
HEAD_TILE = 64  # query-head rows per kernel program: one wgmma M tile


def positive_float(name: str, value) -> float:
  """``float(value)`` if it is finite and > 0, else a ValueError naming the field (float() names only the value)."""
  try:
    x = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a finite float > 0, got {value!r}") from None
  if not (math.isfinite(x) and x > 0.0):
    raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
  return x


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaDecodeTuning:
  """Performance knobs of ``mla_decode``: any value gives the same result up to the rounding of the partials.

  Attributes:
    num_splits: splits S of the KV length (clamped so that no split is empty by shape); None takes
      ``mla.api.default_tuning``'s.
    narrow: the kernels only. True: the transposed kernel for few heads (``S^T = kv @ q^T``, the heads are the
      MMA's N), whose matrix work scales with Hq rounded up to 8 instead of a 64-row tile; Hq <= 32 and a bf16
      cache. False: the 64-row head tiles. None takes ``mla.api.default_tuning``'s (narrow wherever it applies).
    balanced: the kernels only. True: ``num_splits`` is a budget per sequence on average, spread over the
      sequences by the pages they hold (``mla.reference.balanced_split_width``; a long one takes up to twice the
      budget), so that a batch of short or mixed contexts spreads over the SMs; a batch of full sequences gets
      the equal splits. None or False: ``num_splits`` equal splits of the block table's columns for every
      sequence (the default until both layouts are timed on the GPU: ``benchmarks/mla_decode.py --layouts``).
    fp8_in_registers: the narrow kernel over an fp8 cache only. True: the pages stay fp8 in shared memory, QK
      runs on their e4m3 values against q split into two e4m3 parts, and ``P @ V`` converts V to f16 in
      registers, so no f16 copy of a page is written or read. False: each page is converted into an f16 ring
      first. None takes ``mla.api.default_tuning``'s: True wherever the narrow kernel reads an fp8 cache
      (``benchmarks/mla_decode.py --fp8-paths`` times both).
  """

  num_splits: int | None = None
  narrow: bool | None = None
  balanced: bool | None = None
  fp8_in_registers: bool | None = None

  def __post_init__(self):
    if self.num_splits is not None and (isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"num_splits must be an int >= 1 or None, got {self.num_splits!r}")
    for name in ("narrow", "balanced", "fp8_in_registers"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool or None, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaDecodeConfig:
  """One frozen, hashable config for ``mla_decode``.

  Attributes:
    scale: softmax scale on ``q_abs . kv``, a finite float > 0. Required: absorbed queries are ``Dc + Dr`` wide
      whatever the model's head dims, so the usual ``(Dn + Dr) ** -0.5`` (``192 ** -0.5`` for K3) cannot be
      derived from them, and ``576 ** -0.5`` would be silently wrong.
    partial_dtype: storage dtype of the per-split normalised partial outputs (bf16 default, f32 opt-in).
      The per-split LSE is always f32; the cache dtype never changes.
    impl: "xla", "pallas" or "interpret" (see ``KdaConfig``).
    tuning: ``MlaDecodeTuning``; None takes ``mla.api.default_tuning``'s for the call's shapes.
  """

  scale: float
  partial_dtype: jnp.dtype = jnp.bfloat16
  impl: str = dataclasses.field(default_factory=util.default_impl)
  tuning: MlaDecodeTuning | None = None

  def __post_init__(self):
    object.__setattr__(self, "scale", positive_float("scale", self.scale))
    object.__setattr__(self, "partial_dtype",
                       util.canonical_dtype("partial_dtype", self.partial_dtype, (jnp.float32, jnp.bfloat16)))
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.tuning is not None and not isinstance(self.tuning, MlaDecodeTuning):
      raise ValueError(f"tuning must be an MlaDecodeTuning or None, got {self.tuning!r}")

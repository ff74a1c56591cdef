"""Static configuration of the split-K MLA decode."""

import dataclasses

import jax.numpy as jnp

from pallas_kernels import util

LATENT_DIM = 512  # Dc: kv_lora_rank; V is the first Dc cache columns.
ROPE_DIM = 64  # Dr
PAGE_SIZE = 64  # tokens per page of the paged latent cache


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaDecodeConfig:
  """One frozen, hashable config for ``mla_decode``.

  Attributes:
    num_splits: splits S of the KV length; None picks them with the heuristic of ``mla.api.choose_num_splits``.
    partial_dtype: storage dtype of the per-split normalised partial outputs (bf16 default, f32 opt-in).
      The per-split LSE is always f32; the cache dtype never changes.
    impl: "xla", "pallas" or "interpret" (see ``KdaConfig``).
  """

  num_splits: int | None = None
  partial_dtype: jnp.dtype = jnp.bfloat16
  impl: str = dataclasses.field(default_factory=util.default_impl)

  def __post_init__(self):
    object.__setattr__(self, "partial_dtype",
                       util.canonical_dtype("partial_dtype", self.partial_dtype, (jnp.float32, jnp.bfloat16)))
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
      raise ValueError(f"num_splits must be an int >= 1 or None, got {self.num_splits!r}")

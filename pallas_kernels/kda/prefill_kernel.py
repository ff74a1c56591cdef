"""KDA chunked prefill as a Pallas Mosaic GPU kernel (Hopper). Filled in by [4/9]."""

import jax

from pallas_kernels.kda.config import KdaConfig


def kda_prefill_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array,
                       A_log: jax.Array, dt_bias: jax.Array, cu_seqlens: jax.Array, state_pool: jax.Array,
                       state_indices: jax.Array, has_initial_state: jax.Array, checkpoint_indptr: jax.Array,
                       checkpoint_offsets: jax.Array, checkpoint_slots: jax.Array, *, config: KdaConfig,
                       interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``kda_prefill``: inputs already validated by the public API (same shapes)."""
  raise NotImplementedError("kda_prefill with impl='pallas'/'interpret' lands with [4/9]")

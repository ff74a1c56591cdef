"""KDA recurrent decode as a Pallas Mosaic GPU kernel (Hopper). Filled in by [6/9]."""

import jax

from pallas_kernels.kda.config import KdaConfig


def kda_decode_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array,
                      A_log: jax.Array, dt_bias: jax.Array, state_pool: jax.Array, state_indices: jax.Array,
                      num_accepted: jax.Array | None, *, config: KdaConfig,
                      interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``kda_decode``: inputs already validated by the public API (same shapes)."""
  raise NotImplementedError("kda_decode with impl='pallas'/'interpret' lands with [6/9]")

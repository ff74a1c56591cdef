"""Split-K absorbed MLA decode as a Pallas Mosaic GPU kernel (Hopper). Filled in by [5/9]."""

import jax
import jax.numpy as jnp


def mla_decode_partials_mosaic(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                               seq_lens: jax.Array, *, scale: float, num_splits: int,
                               partial_dtype: jnp.dtype, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``mla_decode``: the split partials, as ``reference.mla_decode_partials_reference``."""
  raise NotImplementedError("mla_decode with impl='pallas'/'interpret' lands with [5/9]")

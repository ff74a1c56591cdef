"""Public MLA entry points: split-K absorbed decode over a paged latent cache, and the LSE merge."""

import jax
import jax.numpy as jnp

from pallas_kernels.mla.config import MlaDecodeConfig


def mla_decode(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *,
               scale: float, config: MlaDecodeConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """Absorbed MLA decode, split along the KV length.

  Args:
    q_abs: ``[B, Hq, Dc + Dr]`` (576 = 512 latent + 64 rope), absorbed queries.
    kv_cache: ``[pages, 64, Dc + Dr]`` bf16 paged latent cache; V is its first ``Dc`` columns.
    block_table: ``[B, max_pages]`` int32 page ids of each sequence.
    seq_lens: ``[B]`` int32 tokens per sequence (0 allowed).
    scale: softmax scale (required).
    config: ``MlaDecodeConfig``.

  Returns:
    ``o [B, Hq, Dc]`` in q's dtype and ``lse [B, Hq]`` f32 (natural log); an empty sequence gives
    ``o = 0``, ``lse = -inf``.
  """
  raise NotImplementedError("mla_decode: filled in by [1/9]")


def merge_partials(o_parts: jax.Array, lse_parts: jax.Array, *, out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Sanitized log-sum-exp merge of ``S`` normalised partials.

  Args:
    o_parts: ``[S, ..., Dc]`` normalised partial outputs (any float dtype).
    lse_parts: ``[S, ...]`` f32 natural-log LSE; an empty part is ``(0, -inf)``.
    out_dtype: dtype of the merged output.

  Returns:
    ``o [..., Dc]`` in ``out_dtype`` and ``lse [...]`` f32; an all-empty row gives ``(0, -inf)``.
  """
  raise NotImplementedError("merge_partials: filled in by [1/9]")

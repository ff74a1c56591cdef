"""The mesh-aware ops: the only place layers get their KDA, short-convolution and MLA ops from.

Each is the ``pallas_kernels`` op when no mesh of more than one device is set (``jax.set_mesh``), and on
one its sharded form: the KDA, convolution and MLA prefill attention ops run per device on their heads
(``jax.shard_map``: heads are independent, states never move), the MLA cache is read and written in the
decode-context-parallel layout of ``k3jax.dcp`` (tokens split over devices). The names say "mesh" so that they
never shadow the ``pallas_kernels`` ops they wrap.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3jax import dcp, sharding
from pallas_kernels.kda import api as kda_ops
from pallas_kernels.short_conv import api as short_conv_ops
from pallas_kernels.mla import MlaDecodeConfig, mla_decode
from pallas_kernels.mla_prefill import MlaPrefillConfig, mla_prefill_attention


def _split_at(x: jax.Array, axis: int) -> tuple[str | None, ...]:
  names = [None] * x.ndim
  names[axis] = "kda_heads"
  return tuple(names)


def _per_device(op: Callable, arrays: dict, out_names, **static):
  """``op(**arrays, **static)``: per device on the ambient mesh (``arrays``: name -> (array, names)).

  None arrays are passed through as None; without a mesh ``op`` runs as is.
  """
  mesh = sharding.ambient_mesh()
  if mesh is None:
    return op(**{k: a for k, (a, _) in arrays.items()}, **static)
  keys = [k for k, (a, _) in arrays.items() if a is not None]
  local = lambda *xs: op(**dict(zip(keys, xs)), **static)
  return sharding.shard_kernel(local, [arrays[k][1] for k in keys], out_names, mesh)(*(arrays[k][0] for k in keys))


def mesh_kda_prefill(q, k, v, g_raw, beta_raw, *, A_log, dt_bias, cu_seqlens, state_pool, state_indices,
                has_initial_state, checkpoint_indptr=None, checkpoint_offsets=None, checkpoint_slots=None,
                config=None):
  """``pallas_kernels.kda_prefill`` split over KDA heads on the ambient mesh; the same signature and result.

  Heads are independent, so each device runs the op on its heads and its share of the state pool; the
  state is never gathered.
  """
  heads = _split_at(q, -2)
  return _per_device(kda_ops.kda_prefill, dict(
      q=(q, heads), k=(k, heads), v=(v, heads), g_raw=(g_raw, heads), beta_raw=(beta_raw, _split_at(beta_raw, -1)),
      A_log=(A_log, ("kda_heads",)), dt_bias=(dt_bias, ("kda_heads", None)), cu_seqlens=(cu_seqlens, None),
      state_pool=(state_pool, sharding.KDA_POOL_NAMES), state_indices=(state_indices, None),
      has_initial_state=(has_initial_state, None), checkpoint_indptr=(checkpoint_indptr, None),
      checkpoint_offsets=(checkpoint_offsets, None), checkpoint_slots=(checkpoint_slots, None)),
      (heads, sharding.KDA_POOL_NAMES), config=config)


def mesh_kda_decode(q, k, v, g_raw, beta_raw, *, A_log, dt_bias, state_pool, state_indices, num_accepted=None,
               config=None):
  """``pallas_kernels.kda_decode`` split over KDA heads on the ambient mesh; the same signature and result."""
  heads = _split_at(q, -2)
  return _per_device(kda_ops.kda_decode, dict(
      q=(q, heads), k=(k, heads), v=(v, heads), g_raw=(g_raw, heads), beta_raw=(beta_raw, _split_at(beta_raw, -1)),
      A_log=(A_log, ("kda_heads",)), dt_bias=(dt_bias, ("kda_heads", None)),
      state_pool=(state_pool, sharding.KDA_POOL_NAMES), state_indices=(state_indices, None),
      num_accepted=(num_accepted, None)), (heads, sharding.KDA_POOL_NAMES), config=config)


def mesh_short_conv_prefill(x, weight, *, cu_seqlens, conv_pool, state_indices, has_initial_state,
                       checkpoint_indptr=None, checkpoint_offsets=None, checkpoint_slots=None, config=None):
  """``pallas_kernels.short_conv_prefill`` split over the (head-major) channels on the ambient mesh."""
  channels = _split_at(x, -1)
  return _per_device(short_conv_ops.short_conv_prefill, dict(
      x=(x, channels), weight=(weight, ("kda_heads", None)), cu_seqlens=(cu_seqlens, None),
      conv_pool=(conv_pool, sharding.CONV_POOL_NAMES), state_indices=(state_indices, None),
      has_initial_state=(has_initial_state, None), checkpoint_indptr=(checkpoint_indptr, None),
      checkpoint_offsets=(checkpoint_offsets, None), checkpoint_slots=(checkpoint_slots, None)),
      (channels, sharding.CONV_POOL_NAMES), config=config)


def mesh_short_conv_update(x, weight, *, conv_pool, state_indices, num_accepted=None, config=None):
  """``pallas_kernels.short_conv_update`` split over the (head-major) channels on the ambient mesh."""
  channels = _split_at(x, -1)
  return _per_device(short_conv_ops.short_conv_update, dict(
      x=(x, channels), weight=(weight, ("kda_heads", None)), conv_pool=(conv_pool, sharding.CONV_POOL_NAMES),
      state_indices=(state_indices, None), num_accepted=(num_accepted, None)),
      (channels, sharding.CONV_POOL_NAMES), config=config)


def mesh_mla_prefill_attention(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array, *,
                               cu_seqlens: jax.Array, cu_seqlens_k: jax.Array | None = None,
                               config: MlaPrefillConfig) -> tuple[jax.Array, jax.Array]:
  """``pallas_kernels.mla_prefill_attention`` split over the MLA query heads on the ambient mesh; the same
  signature and result. Heads are independent; the rope key (shared by all heads) and the boundaries go whole
  to every device."""
  heads = (None, "heads", None)
  return _per_device(mla_prefill_attention, dict(
      q=(q, heads), k_nope=(k_nope, heads), k_rope=(k_rope, None), v=(v, heads), cu_seqlens=(cu_seqlens, None),
      cu_seqlens_k=(cu_seqlens_k, None)), (heads, (None, "heads")), config=config)


def mesh_mla_decode(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *,
                    config: MlaDecodeConfig) -> tuple[jax.Array, jax.Array]:
  """``pallas_kernels.mla_decode`` on the ambient mesh (``jax.set_mesh``): the DCP decode (``k3jax.dcp``).

  Without a mesh of more than one device it is ``pallas_kernels.mla_decode`` itself (the DCP layout of one
  device is the plain paged layout).
  """
  mesh = sharding.ambient_mesh()
  if mesh is None:
    return mla_decode(q_abs, kv_cache, block_table, seq_lens, config=config)
  return dcp.dcp_mla_decode(q_abs, kv_cache, block_table, seq_lens, mesh=mesh, config=config)


def mesh_read_rows(kv_cache: jax.Array, block_table: jax.Array, seq: jax.Array, pos: jax.Array) -> jax.Array:
  """Cache read for model code: ``[M, R + dr]`` rows of token ``pos[i]`` of sequence ``seq[i]`` (-1: zeros).

  On the ambient mesh this is ``k3jax.dcp.dcp_read`` (gathered from the owner devices); without one a gather.
  """
  mesh = sharding.ambient_mesh()
  seq, pos = seq.astype(jnp.int32), pos.astype(jnp.int32)
  if mesh is None:
    return dcp.read_local(kv_cache, block_table, seq, pos, n=1, rank=0)
  return dcp.dcp_read(kv_cache, block_table, seq, pos, mesh=mesh)


def mesh_write_rows(kv_cache: jax.Array, rows: jax.Array, block_table: jax.Array, seq: jax.Array,
               pos: jax.Array) -> jax.Array:
  """Cache write for model code: row ``i`` goes to token ``pos[i]`` of sequence ``seq[i]`` (-1: skipped).

  On the ambient mesh this is ``k3jax.dcp.dcp_write`` (owner device only); without one the plain paged write.
  """
  mesh = sharding.ambient_mesh()
  seq, pos = seq.astype(jnp.int32), pos.astype(jnp.int32)
  if mesh is None:
    return dcp.write_local(kv_cache, block_table, seq, pos, rows, n=1, rank=0)
  return dcp.dcp_write(kv_cache, block_table, seq, pos, rows, mesh=mesh)

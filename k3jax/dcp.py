"""Decode context parallelism (DCP) for MLA: the latent cache split along tokens over the model axis.

Layout (interleave 1: vLLM's default, sglang's "rank r owns position p when p mod N = r"):

- Token ``t`` of a sequence lives on device ``t mod N`` at local position ``c = t // N``.
- Each device owns a local page pool. The global cache ``[N * P, 64, Dc + Dr]`` is split along pages
  (logical name ``"kv_tokens"``): device ``d`` holds global pages ``[d P, (d + 1) P)`` as its local pages
  ``0 .. P - 1``.
- One block table ``[B, max_pages]`` of local page ids serves every device (as in vLLM): local position
  ``c`` of sequence ``b`` is row ``c % 64`` of local page ``block_table[b, c // 64]`` on its owner. The
  local lengths of a sequence differ by at most one token between devices, so one allocator for all
  devices wastes at most one page per sequence and device, and block tables are never exchanged.
- A sequence of global length ``L`` holds ``L_d = (L - d + N - 1) // N`` tokens on device ``d`` (0 when
  ``L <= d``: an empty local shard, whose partial is the identity ``(0, -inf)``).

With ``N = 1`` this is exactly the single-device paged layout of ``pallas_kernels.mla``.

Decode: the head-sharded absorbed queries are all-gathered over heads,
every device attends with all heads over its local tokens, the ``(o, lse)`` partials go back to the
devices owning the heads in one all-to-all (``o`` in ``partial_dtype``, the f32 LSE bit-packed into the
same buffer), and ``merge_partials`` combines them in f32. The latent cache never moves.
"""

import functools

import jax
import jax.numpy as jnp

from k3jax import sharding
from pallas_kernels import util
from pallas_kernels import mla as mla_ops
from pallas_kernels.mla import MlaDecodeConfig, cache_format, merge_partials
from pallas_kernels.mla import reference as mla_reference
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE

Q_NAMES = ("batch", "heads", "kv_latent")
LSE_NAMES = ("batch", "heads")
CACHE_NAMES = sharding.MLA_CACHE_NAMES


def local_lens(seq_lens: jax.Array, rank, n: int) -> jax.Array:
  """Tokens of each sequence held by device ``rank`` of ``n``: ``ceil((L - rank) / n)``, 0 when ``L <= rank``."""
  return (seq_lens - rank + n - 1) // n


def pages_per_device(seq_len: int, n: int, page_size: int = PAGE_SIZE) -> int:
  """Local pages a sequence of ``seq_len`` tokens needs on its fullest device (device 0)."""
  return util.cdiv(util.cdiv(seq_len, n), page_size)


def capacity(max_pages: int, n: int | None = None, page_size: int = PAGE_SIZE) -> int:
  """Tokens a sequence can hold in a DCP cache of ``max_pages`` table columns: ``n * max_pages * page_size``.

  Args:
    max_pages: block-table columns (local pages per sequence and device).
    n: devices; None means the ambient mesh's (``jax.set_mesh``; 1 without one: the plain paged cache).
    page_size: rows per page.
  """
  if n is None:
    mesh = sharding.ambient_mesh()
    n = 1 if mesh is None else sharding.mesh_size(mesh)
  return n * max_pages * page_size


def _pack(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
  """``[..., Dc]`` partials and their f32 ``[...]`` LSE as one ``[..., Dc + w]`` buffer of ``dtype``.

  The LSE travels bit-exact (bitcast, ``w = 4 / itemsize``), so one collective moves both.
  """
  bits = jax.lax.bitcast_convert_type(lse, dtype)
  if bits.ndim == lse.ndim:
    bits = bits[..., None]
  return jnp.concatenate([o.astype(dtype), bits], axis=-1)


def _unpack(buf: jax.Array, dc: int) -> tuple[jax.Array, jax.Array]:
  bits = buf[..., dc:]
  if bits.shape[-1] == 1:
    bits = bits[..., 0]
  return buf[..., :dc], jax.lax.bitcast_convert_type(bits, jnp.float32)


def _decode_local(q, kv, block_table, seq_lens, *, config):
  n = jax.lax.axis_size(sharding.MODEL)
  rank = jax.lax.axis_index(sharding.MODEL)
  q_all = jax.lax.all_gather(q, sharding.MODEL, axis=1, tiled=True)
  # The local output is a partial merged again below: it stays in partial_dtype, not q's (maybe bf16) dtype.
  o, lse = mla_ops.mla_decode(q_all, kv, block_table, local_lens(seq_lens, rank, n), config=config,
                              out_dtype=config.partial_dtype)
  buf = _pack(o, lse, config.partial_dtype)
  batch, heads, width = buf.shape
  # Destination-major: block j of the heads goes to device j, which owns those heads.
  buf = buf.reshape(batch, n, heads // n, width).transpose(1, 0, 2, 3)
  recv = jax.lax.all_to_all(buf, sharding.MODEL, 0, 0, tiled=True)
  o_parts, lse_parts = _unpack(recv, o.shape[-1])
  return merge_partials(o_parts, lse_parts, out_dtype=q.dtype)


def dcp_mla_decode(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *,
                   mesh: jax.sharding.Mesh, config: MlaDecodeConfig) -> tuple[jax.Array, jax.Array]:
  """Absorbed MLA decode over a DCP latent cache (layout in the module docstring).

  Args:
    q_abs: ``[B, Hq, Dc + Dr]`` absorbed queries, split over heads (``Hq`` a multiple of the mesh size;
      pad heads with ``padding.PaddingPlan``).
    kv_cache: ``[N * P, 64, Dc + Dr]`` DCP latent cache, split over pages.
    block_table: ``[B, max_pages]`` int32 local page ids, the same on every device.
    seq_lens: ``[B]`` int32 global tokens per sequence, in ``[0, N * max_pages * 64]``.
    mesh: the mesh (``sharding.make_mesh``).
    config: ``MlaDecodeConfig`` of the per-device decode (its ``scale`` is the softmax scale on
      ``q_abs . kv``); its ``partial_dtype`` is also the dtype of the partial outputs on the wire (the LSE is
      always f32).

  Returns:
    ``o [B, Hq, Dc]`` in q's dtype and ``lse [B, Hq]`` f32, both split over heads; an empty sequence
    gives ``(0, -inf)``.

  Raises:
    ValueError: a ``config`` that is no ``MlaDecodeConfig``, malformed shapes or dtypes, ``Hq`` or the pages
      not a multiple of the mesh size, or (when concrete) lengths or used page ids out of range.
  """
  if not isinstance(config, MlaDecodeConfig):
    raise ValueError(f"config must be an MlaDecodeConfig, got {config!r}")
  n = sharding.mesh_size(mesh)
  if q_abs.ndim != 3 or kv_cache.ndim != 3:
    raise ValueError(f"q_abs must be (B, Hq, Dc + Dr) and kv_cache (pages, 64, Dc + Dr), got "
                     f"{tuple(q_abs.shape)} and {tuple(kv_cache.shape)}")
  sharding.check_divisible("q_abs", q_abs.shape, Q_NAMES, mesh)
  sharding.check_divisible("kv_cache", kv_cache.shape, CACHE_NAMES, mesh)
  local_cache = jax.ShapeDtypeStruct((kv_cache.shape[0] // n,) + kv_cache.shape[1:], kv_cache.dtype)
  lens = util.concrete(seq_lens)
  # Device 0 holds the most tokens of every sequence: checking its lengths and pages checks all devices.
  mla_reference.validate_decode_inputs(q_abs, local_cache, block_table,
                                       seq_lens if lens is None else local_lens(lens, 0, n),
                                       scale=config.scale, latent_dim=LATENT_DIM)
  return _dcp_mla_decode(q_abs, kv_cache, block_table, seq_lens.astype(jnp.int32), mesh=mesh, config=config)


@functools.partial(jax.jit, static_argnames=("mesh", "config"))
def _dcp_mla_decode(q_abs, kv_cache, block_table, seq_lens, *, mesh, config):
  local = functools.partial(_decode_local, config=config)
  fn = sharding.shard_kernel(local, (Q_NAMES, CACHE_NAMES, None, None), (Q_NAMES, LSE_NAMES), mesh)
  return fn(q_abs, kv_cache, block_table, seq_lens)


def _local_place(kv, block_table, seq_ids, positions, *, n, rank):
  """``(page, row, mine)`` of each token on device ``rank`` of ``n``: ``mine`` where the device owns it."""
  page_rows = kv.shape[1]
  local = positions // n
  col = jnp.clip(local // page_rows, 0, block_table.shape[1] - 1)
  page = block_table[jnp.clip(seq_ids, 0, block_table.shape[0] - 1), col]
  mine = (seq_ids >= 0) & (positions >= 0) & (positions % n == rank) & (page >= 0)
  return page, local % page_rows, mine


def check_row_dtype(kv_cache: jax.Array, kv_new: jax.Array) -> None:
  """Raises ``ValueError`` unless ``kv_new`` can be cast into ``kv_cache``'s rows: fp8 rows exactly for an fp8
  cache (a float row cast to fp8 would lose its scales; ``cache_format.quantize_rows`` makes the rows)."""
  util.check_dtype("kv_new", kv_new, cache_format.CACHE_DTYPES)
  if cache_format.is_fp8(kv_new.dtype) != cache_format.is_fp8(kv_cache.dtype):
    raise ValueError(f"kv_new must be fp8 rows (cache_format.quantize_rows) exactly when kv_cache is fp8, got "
                     f"kv_new {jnp.dtype(kv_new.dtype).name} and kv_cache {jnp.dtype(kv_cache.dtype).name}")


def write_local(kv, block_table, seq_ids, positions, kv_new, *, n, rank):
  check_row_dtype(kv, kv_new)
  page, row, mine = _local_place(kv, block_table, seq_ids, positions, n=n, rank=rank)
  # Tokens owned elsewhere get an out-of-range page and are dropped by the scatter.
  return kv.at[jnp.where(mine, page, kv.shape[0]), row].set(kv_new.astype(kv.dtype), mode="drop")


def read_local(kv, block_table, seq_ids, positions, *, n, rank):
  """The rows of the tokens device ``rank`` owns, zeros for the others (``write_local``'s gather)."""
  page, row, mine = _local_place(kv, block_table, seq_ids, positions, n=n, rank=rank)
  return jnp.where(mine[:, None], kv[jnp.clip(page, 0, kv.shape[0] - 1), row], 0)


def _read_on_mesh(kv, block_table, seq_ids, positions):
  local = read_local(kv, block_table, seq_ids, positions, n=jax.lax.axis_size(sharding.MODEL),
                     rank=jax.lax.axis_index(sharding.MODEL))
  # Exactly one device holds each token: the sum over devices adds zeros to it (exact, NaN kept).
  return jax.lax.psum(local, sharding.MODEL)


def dcp_read(kv_cache: jax.Array, block_table: jax.Array, seq_ids: jax.Array, positions: jax.Array, *,
             mesh: jax.sharding.Mesh) -> jax.Array:
  """The cached latent rows of tokens, gathered from their owner devices: ``[T, Dc + Dr]`` in the cache dtype,
  replicated; zeros for a skipped token (``seq_ids`` or ``positions`` -1, or a -1 page). Arguments as
  ``dcp_write``'s (one all-reduce of ``T`` rows)."""
  fn = sharding.shard_kernel(_read_on_mesh, (CACHE_NAMES, None, None, None), None, mesh)
  return fn(kv_cache, block_table, seq_ids.astype(jnp.int32), positions.astype(jnp.int32))


def _write_on_mesh(kv, block_table, seq_ids, positions, kv_new):
  return write_local(kv, block_table, seq_ids, positions, kv_new, n=jax.lax.axis_size(sharding.MODEL),
                      rank=jax.lax.axis_index(sharding.MODEL))


def dcp_write(kv_cache: jax.Array, block_table: jax.Array, seq_ids: jax.Array, positions: jax.Array,
              kv_new: jax.Array, *, mesh: jax.sharding.Mesh) -> jax.Array:
  """Writes the latents of tokens into the DCP cache, each on its owner device only (no communication).

  Args:
    kv_cache: ``[N * P, 64, Dc + Dr]`` DCP latent cache, split over pages (donate it under jit).
    block_table: ``[B, max_pages]`` int32 local page ids, the same on every device.
    seq_ids: ``[T]`` int32 sequence (block-table row) of each token; -1 skips the token.
    positions: ``[T]`` int32 global position of each token in its sequence; -1 skips the token.
    kv_new: ``[T, Dc + Dr]`` latents (``[c_kv | k_pe]``), cast to the cache dtype; for an fp8 cache, its rows
      ``[T, Dc + Dr + 64]`` from ``cache_format.quantize_rows``.
    mesh: the mesh.

  Returns:
    The cache with the tokens written (same shape, dtype and sharding); every other row is unchanged.
    Two tokens written to the same place leave one of them.

  Raises:
    ValueError: malformed shapes or dtypes, or (when concrete) a token past the block table's capacity.
  """
  util.check_dtype("block_table", block_table, (jnp.int32,))
  util.check_dtype("seq_ids", seq_ids, (jnp.int32,))
  util.check_dtype("positions", positions, (jnp.int32,))
  check_row_dtype(kv_cache, kv_new)
  if kv_cache.ndim != 3 or block_table.ndim != 2 or seq_ids.ndim != 1:
    raise ValueError(f"kv_cache must be (pages, page_size, D), block_table (B, max_pages) and seq_ids (T,), "
                     f"got {tuple(kv_cache.shape)}, {tuple(block_table.shape)} and {tuple(seq_ids.shape)}")
  util.check_shape("positions", positions, seq_ids.shape)
  util.check_shape("kv_new", kv_new, (seq_ids.shape[0], kv_cache.shape[2]))
  sharding.check_divisible("kv_cache", kv_cache.shape, CACHE_NAMES, mesh)
  n = sharding.mesh_size(mesh)
  ids, pos = util.concrete(seq_ids), util.concrete(positions)
  if ids is not None and pos is not None:
    limit = capacity(block_table.shape[1], n, kv_cache.shape[1])
    used = (ids >= 0) & (pos >= 0)
    if (ids[used] >= block_table.shape[0]).any() or (pos[used] >= limit).any():
      raise ValueError(f"seq_ids must lie in [-1, {block_table.shape[0]}) and positions in [-1, {limit}) "
                       f"(N * max_pages * page_size), got max {ids.max()} and {pos.max()}")
  return _dcp_write(kv_cache, block_table, seq_ids, positions, kv_new, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("mesh",))
def _dcp_write(kv_cache, block_table, seq_ids, positions, kv_new, *, mesh):
  fn = sharding.shard_kernel(_write_on_mesh, (CACHE_NAMES, None, None, None, None), CACHE_NAMES, mesh)
  return fn(kv_cache, block_table, seq_ids, positions, kv_new)


def dcp_append_token(kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array, kv_new: jax.Array, *,
                     mesh: jax.sharding.Mesh) -> jax.Array:
  """Writes one new token per sequence at position ``seq_lens[b]``, on its owner device only.

  Args:
    kv_cache, block_table, mesh: as in ``dcp_write``.
    seq_lens: ``[B]`` int32 tokens already cached (the new token's position); -1 skips the row.
    kv_new: ``[B, Dc + Dr]`` latents of the new tokens.

  Returns:
    The updated cache; the caller then increments ``seq_lens``.
  """
  util.check_shape("seq_lens", seq_lens, (block_table.shape[0],))
  seq_ids = jnp.arange(block_table.shape[0], dtype=jnp.int32)
  return dcp_write(kv_cache, block_table, seq_ids, seq_lens, kv_new, mesh=mesh)

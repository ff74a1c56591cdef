"""Pure-JAX references of absorbed MLA decode over a paged latent cache, and its split-K partials.

Layout everywhere: ``kv_cache [pages, page_size, Dc + Dr]``; a row is ``[c_kv (Dc) | k_pe (Dr)]`` and V is
its first ``Dc`` columns. Token ``t`` of sequence ``b`` is row ``t % page_size`` of page
``block_table[b, t // page_size]``; tokens ``t >= seq_lens[b]`` do not exist (their rows and the unused
pages may hold anything, NaN included, and are never read into the result). Logits are
``scale * q_abs . kv`` in f32; the LSE is a natural log and an empty sequence gives ``(o = 0, lse = -inf)``.
"""

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import util
from pallas_kernels.mla import cache_format
from pallas_kernels.mla.config import LATENT_DIM

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_decode_inputs(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array,
                           *, scale: float, latent_dim: int, page_size: int | None = None) -> None:
  """Raises ``ValueError`` naming the argument for any malformed decode input.

  Shapes and dtypes are always checked; the value ranges (``seq_lens`` in ``[0, max_pages * page_size]``,
  the page ids of used pages in ``[0, pages)``) only when both arrays are concrete (not traced).

  Args:
    q_abs, kv_cache, block_table, seq_lens, scale: as in ``mla_decode_reference``.
    latent_dim: ``Dc``; the last dim ``Dc + Dr`` of q and the cache must exceed it.
    page_size: required cache page size, or None for any.
  """
  if not isinstance(scale, numbers.Real) or not np.isfinite(scale) or scale <= 0:
    raise ValueError(f"scale must be a finite positive real number, got {scale!r}")
  util.check_dtype("q_abs", q_abs, util.FLOAT_DTYPES)
  util.check_dtype("kv_cache", kv_cache, cache_format.CACHE_DTYPES)
  util.check_dtype("block_table", block_table, (jnp.int32,))
  util.check_dtype("seq_lens", seq_lens, util.INT_DTYPES)
  if q_abs.ndim != 3:
    raise ValueError(f"q_abs must have shape (B, Hq, Dc + Dr), got {tuple(q_abs.shape)}")
  batch, _, dim = q_abs.shape
  if dim <= latent_dim:
    raise ValueError(f"q_abs last dim must be Dc + Dr with Dc = {latent_dim} and Dr >= 1, got {dim}")
  util.check_shape("kv_cache", kv_cache, (None, page_size, cache_format.row_width(dim, kv_cache.dtype)))
  util.check_shape("block_table", block_table, (batch, None))
  util.check_shape("seq_lens", seq_lens, (batch,))
  num_pages, page_rows = kv_cache.shape[:2]
  max_pages = block_table.shape[1]
  if batch < 1 or max_pages < 1 or num_pages < 1 or page_rows < 1:
    raise ValueError(f"B, max_pages, pages and page_size must be >= 1, got B={batch}, max_pages={max_pages}, "
                     f"kv_cache shape {tuple(kv_cache.shape)}")
  lens, table = util.concrete(seq_lens), util.concrete(block_table)
  if lens is None or table is None:
    return
  capacity = max_pages * page_rows
  if lens.min() < 0 or lens.max() > capacity:
    raise ValueError(f"seq_lens must lie in [0, max_pages * page_size] = [0, {capacity}], "
                     f"got min {lens.min()} and max {lens.max()}")
  used = np.arange(max_pages)[None, :] * page_rows < lens[:, None]
  bad = used & ((table < 0) | (table >= num_pages))
  if bad.any():
    b, p = np.argwhere(bad)[0]
    raise ValueError(f"block_table[{b}, {p}] = {table[b, p]} is a used page and must lie in [0, {num_pages})")


def _gather_pages(kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array,
                  latent_dim: int) -> tuple[jax.Array, jax.Array]:
  """Tokens of the pages of ``block_table`` and which of them exist (``seq_lens`` counts from its first page).

  Returns:
    ``kv [B, P * page_size, D]`` in the cache dtype (bf16 ``value * scale`` for an fp8 cache) and ``valid
    [B, P * page_size]`` bool. The ids of unused pages are replaced by 0 first, so arbitrary padding ids in
    the table are never dereferenced.
  """
  page_size = kv_cache.shape[1]
  pages = block_table.shape[1]
  token = jnp.arange(pages)[:, None] * page_size + jnp.arange(page_size)
  valid = token.reshape(-1)[None, :] < seq_lens[:, None]
  page_used = valid.reshape(-1, pages, page_size)[:, :, 0]
  kv = kv_cache[jnp.where(page_used, block_table, 0)]
  kv = cache_format.dequantize_rows(kv, latent_dim)
  return kv.reshape(kv.shape[0], pages * page_size, kv.shape[-1]), valid


def _attend(q_abs: jax.Array, kv: jax.Array, valid: jax.Array, *, scale: float,
            latent_dim: int) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of all heads over the valid tokens of ``kv``, in f32.

  Args:
    q_abs: ``[B, Hq, D]``. kv: ``[B, T, D]``. valid: ``[B, T]`` bool.

  Returns:
    ``o [B, Hq, Dc]`` f32 normalised and ``lse [B, Hq]`` f32 natural log; ``(0, -inf)`` where no token
    is valid. Invalid tokens enter neither the logits nor V (``where``, not a multiply, since their rows
    may be NaN). A NaN or inf in q or in a valid token's row gives a non-finite ``o`` and, where it reaches
    the logits, a NaN ``lse``: never the ``(0, -inf)`` of an empty row, which ``merge_partials`` drops.
  """
  dtype = jnp.promote_types(q_abs.dtype, kv.dtype)
  s = jnp.einsum("bhd,btd->bht", q_abs.astype(dtype), kv.astype(dtype), precision=_HIGHEST,
                 preferred_element_type=jnp.float32) * scale
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  # Only an all -inf row needs a finite shift: a NaN max, or a +inf one (exp(inf - inf)), must give NaN.
  m = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1)
  v = jnp.where(valid[:, :, None], kv[:, :, :latent_dim].astype(jnp.float32), 0.0)
  # l > 0 unless no token is valid (empty: 0 / 1 = 0 and lse -inf) or every valid logit is -inf, which
  # only infinite inputs give and where the softmax is 0 / 0 = NaN. A NaN l stays NaN in o and lse.
  empty = ~valid.any(axis=-1)[:, None]
  l = jnp.where(empty, 1.0, jnp.where(l == 0, jnp.nan, l))
  o = jnp.einsum("bht,btc->bhc", p, v, precision=_HIGHEST) / l[:, :, None]
  lse = jnp.where(empty, -jnp.inf, m[:, :, 0] + jnp.log(l))
  return o, lse


def mla_decode_reference(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *,
                         scale: float, latent_dim: int = LATENT_DIM) -> tuple[jax.Array, jax.Array]:
  """Unsplit absorbed MLA decode: gather every page of each sequence and attend in f32.

  Args:
    q_abs: ``[B, Hq, Dc + Dr]`` absorbed queries (f32/bf16/f16).
    kv_cache: ``[pages, page_size, Dc + Dr]`` paged latent cache (any page size here; the public op needs 64),
      f32/bf16/f16, or ``[pages, page_size, Dc + Dr + 64]`` ``float8_e4m3fn`` rows with their scales
      (``cache_format``).
    block_table: ``[B, max_pages]`` int32 page ids; entries past a sequence's last page are ignored.
    seq_lens: ``[B]`` int32 tokens per sequence, in ``[0, max_pages * page_size]``.
    scale: softmax scale on the logits ``q_abs . kv``.
    latent_dim: ``Dc``, the number of leading cache columns that form V.

  Returns:
    ``o [B, Hq, Dc]`` in q's dtype (rounded once from f32) and ``lse [B, Hq]`` f32 natural log;
    an empty sequence gives ``o = 0``, ``lse = -inf``.
  """
  validate_decode_inputs(q_abs, kv_cache, block_table, seq_lens, scale=scale, latent_dim=latent_dim)
  return _unsplit_reference(q_abs, kv_cache, block_table, seq_lens, scale=float(scale), latent_dim=latent_dim)


@functools.partial(jax.jit, static_argnames=("scale", "latent_dim"))
def _unsplit_reference(q_abs, kv_cache, block_table, seq_lens, *, scale, latent_dim):
  kv, valid = _gather_pages(kv_cache, block_table, seq_lens, latent_dim)
  o, lse = _attend(q_abs, kv, valid, scale=scale, latent_dim=latent_dim)
  return o.astype(q_abs.dtype), lse


MIN_PAGES_PER_SPLIT = 16  # below ~1024 tokens a split's partial (o, lse) traffic rivals its KV bytes.


def pages_per_split(max_pages: int, num_splits: int) -> int:
  """Pages of each equal split: split ``j`` covers pages ``[j * pps, (j + 1) * pps)`` of every sequence."""
  return util.cdiv(max_pages, num_splits)


def balanced_split_width(page_total, seq_pages, *, max_pages: int, budget: int, batch: int, num_splits: int):
  """Pages of each of a sequence's ``num_splits`` splits when the splits are balanced: split ``j`` covers its
  pages ``[j w, (j + 1) w)``. Integers or int32 arrays (the kernel calls it on its scalars).

  A budget of ``budget * batch`` programs is spread over the sequences by the pages they hold: a program takes
  ``W = max(ceil(page_total / (budget batch)), min(MIN_PAGES_PER_SPLIT, ceil(max_pages / budget)))`` pages (the
  batch holds ``page_total``), and a sequence of ``seq_pages`` takes ``ceil(seq_pages / W)`` programs, widened to
  ``ceil(seq_pages / num_splits)`` pages each where it would need more than its splits. Equal splits of the block
  table's columns leave a batch of short or mixed contexts waiting on its longest sequence's few splits; a batch
  of full sequences gets ``w = ceil(max_pages / budget)`` here, the equal splits.
  """
  programs = budget * batch
  width = jnp.maximum((page_total + programs - 1) // programs,
                      min(MIN_PAGES_PER_SPLIT, pages_per_split(max_pages, budget)))
  return jnp.maximum(width, (seq_pages + num_splits - 1) // num_splits)


def mla_decode_partials_reference(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                                  seq_lens: jax.Array, *, scale: float, num_splits: int,
                                  partial_dtype: jnp.dtype,
                                  latent_dim: int = LATENT_DIM) -> tuple[jax.Array, jax.Array]:
  """Split-K partials: each split of ``pages_per_split`` pages attends on its own, in f32.

  Inputs are those of ``mla_decode_reference`` (validated by the caller). Splits wholly past a sequence's
  end, or past ``max_pages``, are empty.

  Returns:
    ``o_parts [S, B, Hq, Dc]`` normalised, stored in ``partial_dtype``, and ``lse_parts [S, B, Hq]`` f32
    natural log; an empty split is ``(0, -inf)``. ``merge_partials`` combines them.
  """
  batch, max_pages = block_table.shape
  pps = pages_per_split(max_pages, num_splits)
  tables = jnp.pad(block_table, ((0, 0), (0, num_splits * pps - max_pages))).reshape(batch, num_splits, pps)
  first_tokens = jnp.arange(num_splits) * (pps * kv_cache.shape[1])

  def one_split(table, first_token):
    kv, valid = _gather_pages(kv_cache, table, seq_lens - first_token, latent_dim)
    return _attend(q_abs, kv, valid, scale=scale, latent_dim=latent_dim)

  o_parts, lse_parts = jax.vmap(one_split, in_axes=(1, 0))(tables, first_tokens)
  return o_parts.astype(partial_dtype), lse_parts

"""Shared MLA test inputs and the independent float64 NumPy oracle, with the oracle's own hand check.

The other tests/test_mla_*.py import ``make_inputs``, ``oracle``, ``merge_oracle`` and ``rel_l2`` from here.
"""

import jax.numpy as jnp
import numpy as np

LATENT, ROPE, PAGE = 512, 64, 64
SCALE = 192 ** -0.5  # K3 / Kimi-Linear: (qk_nope + qk_rope) ** -0.5
PAD_IDS = (2147480000, -1)  # FlashMLA's huge padding id, and -1: both must be ignored past a sequence's end


def make_inputs(seed: int, lens, *, num_heads: int, max_pages: int, num_pages: int | None = None,
                q_std: float = 1.0, q_dtype=jnp.float32, latent: int = LATENT, rope: int = ROPE,
                page: int = PAGE, first_page: int = 0):
  """Random decode inputs with NaN in every cache row that is not a token, scattered page ids.

  The latent rows are N(0, 1) (c_kv is RMS-normalised, k_pe of unit scale); q_abs is N(0, q_std) so the
  logits have std ``SCALE * sqrt(576) * q_std`` (1.7 at q_std = 1: moderately peaky). Used pages get
  distinct ids drawn from ``[first_page, num_pages)`` in random order; unused table slots hold padding ids.

  Returns:
    ``q [B, Hq, D]`` (q_dtype), ``cache [num_pages, page, D]`` bf16, ``table [B, max_pages]`` int32,
    ``lens [B]`` int32, all jnp arrays.
  """
  rng = np.random.default_rng(seed)
  lens = np.asarray(lens, np.int32)
  dim = latent + rope
  need = -(-lens // page)
  num_pages = num_pages or max(int(need.sum()), 1) + 3
  ids = first_page + rng.permutation(num_pages - first_page)[: int(need.sum())]
  table = np.array(PAD_IDS, np.int32)[rng.integers(0, 2, (len(lens), max_pages))]
  used = np.full((int(need.sum()), page, dim), np.nan, np.float32)
  start = 0
  for b, length in enumerate(lens):
    table[b, :need[b]] = ids[start:start + need[b]]
    rows = used[start:start + need[b]].reshape(-1, dim)
    rows[:length] = rng.standard_normal((length, dim))
    start += need[b]
  q = rng.standard_normal((len(lens), num_heads, dim)) * q_std
  # Only the used pages are built on the host: the cache itself may be gigabytes (page ids above 65535).
  cache = jnp.full((num_pages, page, dim), jnp.nan, jnp.bfloat16).at[ids].set(jnp.asarray(used, jnp.bfloat16))
  return jnp.asarray(q, q_dtype), cache, jnp.asarray(table), jnp.asarray(lens)


def oracle(q, cache, table, lens, *, scale: float, latent: int = LATENT):
  """float64 attention of every sequence over its own tokens, gathered page by page in NumPy.

  Returns:
    ``o [B, Hq, Dc]`` f64 and ``lse [B, Hq]`` f64 natural log; an empty sequence gives ``(0, -inf)``.
  """
  q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
  cache = np.asarray(jnp.asarray(cache, jnp.float32), np.float64)
  table, lens = np.asarray(table), np.asarray(lens)
  page = cache.shape[1]
  o = np.zeros(q.shape[:2] + (latent,))
  lse = np.full(q.shape[:2], -np.inf)
  for b, length in enumerate(lens):
    if length == 0:
      continue
    rows = np.concatenate([cache[p] for p in table[b, : -(-length // page)]])[:length]
    s = scale * q[b] @ rows.T
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    o[b] = p @ rows[:, :latent] / p.sum(axis=1, keepdims=True)
    lse[b] = m[:, 0] + np.log(p.sum(axis=1))
  return o, lse


def merge_oracle(o_parts, lse_parts):
  """float64 log-sum-exp merge: an empty part (LSE -inf) adds nothing whatever its o, a NaN LSE gives NaN.

  Returns:
    ``o [..., Dc]`` f64 and ``lse [...]`` f64 of the ``[S, ..., Dc]`` parts and their ``[S, ...]`` LSE.
  """
  o_parts = np.asarray(jnp.asarray(o_parts, jnp.float32), np.float64)
  lse_parts = np.asarray(lse_parts, np.float64)
  with np.errstate(invalid="ignore"):
    lse = np.logaddexp.reduce(lse_parts, axis=0)
    w = np.where(np.isneginf(lse_parts), 0.0, np.exp(lse_parts - lse))
    return np.sum(np.where(w[..., None] == 0, 0.0, w[..., None] * o_parts), axis=0), lse


def rel_l2(x, ref) -> float:
  """Relative L2 error of ``x`` against ``ref`` (NaN anywhere gives NaN, which fails every ``<``)."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def hand_case():
  """Two tokens, Dc = Dr = 1, page size 2, two heads; the expected values are worked out by hand.

  Sequence 0 (page 2): tokens ``[v, k_pe] = [2, 0]`` and ``[4, ln 3]``. Head 0 has ``q = [0, 1]``: logits
  ``0, ln 3``, weights 1/4 and 3/4, so ``o = 2/4 + 12/4 = 3.5`` and ``lse = ln(1 + 3) = ln 4``. Head 1 has
  ``q = [1, 0]``: logits 2 and 4, so ``o = (2 e^2 + 4 e^4) / (e^2 + e^4)`` and ``lse = 4 + ln(1 + e^-2)``.
  Sequence 1 (page 0, one token ``[2, 0]``; its second row is NaN): one weight of 1, so ``o = 2`` and
  ``lse`` is the logit, 0 for head 0 and 2 for head 1. Sequence 2 is empty: ``(0, -inf)``. Page 1 is unused
  (NaN), and the padding ids of the table must never be read.

  Returns:
    ``(q, cache, table, lens)`` as jnp f32/int32 arrays, and ``(o [3, 2, 1], lse [3, 2])`` expected in f64.
  """
  nan = np.nan
  cache = np.array([[[2, 0], [nan, nan]], [[nan, nan], [nan, nan]], [[2, 0], [4, np.log(3)]]], np.float32)
  q = np.array([[[0, 1], [1, 0]]] * 3, np.float32)
  table = np.array([[2, PAD_IDS[0]], [0, PAD_IDS[1]], [PAD_IDS[0], PAD_IDS[1]]], np.int32)
  lens = np.array([2, 1, 0], np.int32)
  e2, e4 = np.exp(2.0), np.exp(4.0)
  o = np.array([[[3.5], [(2 * e2 + 4 * e4) / (e2 + e4)]], [[2.0], [2.0]], [[0.0], [0.0]]])
  lse = np.array([[np.log(4.0), 4 + np.log1p(np.exp(-2.0))], [0.0, 2.0], [-np.inf, -np.inf]])
  return tuple(jnp.asarray(x) for x in (q, cache, table, lens)), (o, lse)


def test_oracle_hand_case():
  (q, cache, table, lens), (o_want, lse_want) = hand_case()
  o, lse = oracle(q, cache, table, lens, scale=1.0, latent=1)
  # rtol 1e-7: the inputs (ln 3) are stored in f32, the oracle itself is f64.
  np.testing.assert_allclose(o, o_want, rtol=1e-7)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
  np.testing.assert_allclose(lse, lse_want, rtol=1e-7)


def test_make_inputs_poisons_every_non_token_row():
  q, cache, table, lens = make_inputs(0, [0, 1, 63, 64, 65], num_heads=2, max_pages=3)
  cache, table = np.asarray(jnp.asarray(cache, jnp.float32)), np.asarray(table)
  token_rows = 0
  for b, length in enumerate(np.asarray(lens)):
    pages = table[b, : -(-length // PAGE)]
    rows = cache[pages].reshape(-1, LATENT + ROPE)
    assert np.isfinite(rows[:length]).all() and np.isnan(rows[length:]).all()
    assert np.isin(table[b, len(pages):], PAD_IDS).all()
    token_rows += length
  assert np.isfinite(cache).all(axis=-1).sum() == token_rows
  assert q.shape == (5, 2, LATENT + ROPE) and table.dtype == np.int32

"""The MLA float64 oracles and input factories of ``pallas_kernels.testing``, checked on their own: the hand case,
and the poison of every cache row that is not a token."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import testing
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM


def test_oracle_hand_case():
  (q, cache, table, lens), (o_want, lse_want) = testing.mla_hand_case()
  o, lse = testing.mla_decode_oracle(q, cache, table, lens, scale=1.0, latent=1)
  # rtol 1e-7: the inputs (ln 3) are stored in f32, the oracle itself is f64.
  np.testing.assert_allclose(o, o_want, rtol=1e-7)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
  np.testing.assert_allclose(lse, lse_want, rtol=1e-7)


def test_make_inputs_poisons_every_non_token_row():
  q, cache, table, lens = testing.mla_paged_inputs(0, [0, 1, 63, 64, 65], num_heads=2, max_pages=3)
  cache, table = np.asarray(jnp.asarray(cache, jnp.float32)), np.asarray(table)
  token_rows = 0
  for b, length in enumerate(np.asarray(lens)):
    pages = table[b, : -(-length // PAGE_SIZE)]
    rows = cache[pages].reshape(-1, LATENT_DIM + ROPE_DIM)
    assert np.isfinite(rows[:length]).all() and np.isnan(rows[length:]).all()
    assert np.isin(table[b, len(pages):], testing.MLA_PAD_IDS).all()
    token_rows += length
  assert np.isfinite(cache).all(axis=-1).sum() == token_rows
  assert q.shape == (5, 2, LATENT_DIM + ROPE_DIM) and table.dtype == np.int32


def test_token_and_paged_oracles_agree_on_the_paged_layout():
  rng = np.random.default_rng(1)
  lens = [0, 5, 130]
  tokens = rng.standard_normal((3, 130, 2 + 3))
  q = rng.standard_normal((3, 2, 2 + 3))
  table = rng.permutation(9).reshape(3, 3).astype(np.int32)
  cache = testing.mla_paged_cache(tokens, lens, table, 9)
  want = testing.mla_attention_oracle(q, tokens, lens, scale=0.5, latent=2)
  got = testing.mla_decode_oracle(q, cache, table, lens, scale=0.5, latent=2)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)

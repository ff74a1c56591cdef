"""Each NNX module against an independent float64 NumPy version of the HF math (``layer_oracles``)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.cache import SlotAllocator, init_cache
from k3jax.layers.attn_res import AttnResSite
from k3jax.layers.kda import KdaLayer
from k3jax.layers.mla import MlaLayer
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norms import RMSNorm
from pallas_kernels.short_conv import api as short_conv_api
from layer_oracles import (assert_close, np_attn_res, np_kda, np_mla, np_mlp, np_moe, np_rms, npf, rand_x,
                           run_module, tiny)

# ---------------------------------------------------------------------------------------------- tests
def test_rmsnorm_is_f32_inside():
  norm = RMSNorm(64, eps=1e-5, name="embed", dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 64)) * 300.0, jnp.bfloat16)
  y = norm(x)
  assert y.dtype == jnp.bfloat16 and y.shape == (5, 64)
  # The only rounding is the final cast to bf16: the bf16 input squared would overflow nothing here, but a
  # bf16 mean of squares would be off by ~1e-2 relative.
  expected = np_rms(npf(x), npf(norm.weight), 1e-5)
  assert_close(y, expected, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("name", ["tiny", "tiny_linear"])
def test_dense_mlp(name):
  cfg = tiny(name)
  m = MLP(cfg, cfg.intermediate_size, rngs=nnx.Rngs(1))
  x = rand_x(cfg, 7)
  y = run_module(m, lambda m, x: m(x), x)
  assert y.shape == (7, cfg.hidden_size) and y.dtype == jnp.float32
  assert_close(y, np_mlp(cfg, m, npf(x)))


@pytest.mark.parametrize("name", ["tiny", "tiny_linear"])
def test_moe(name):
  cfg = tiny(name)
  m = MoE(cfg, rngs=nnx.Rngs(2))
  x = rand_x(cfg, 11, seed=3)
  y = run_module(m, lambda m, x: m(x), x)
  assert y.shape == (11, cfg.hidden_size) and y.dtype == jnp.float32
  assert_close(y, np_moe(cfg, m, npf(x)))
  # The correction bias picks experts but never weighs them: shifting it so the choice is unchanged
  # leaves the output unchanged.
  m.gate.e_score_correction_bias.set_value(m.gate.e_score_correction_bias[...] + 3.0)
  assert_close(run_module(m, lambda m, x: m(x), x), np.asarray(y), atol=1e-6, rtol=1e-6)


def test_attn_res_site():
  site = AttnResSite(64, eps=1e-5, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(4)
  blocks = [jnp.asarray(rng.standard_normal((6, 64)) * s, jnp.float32) for s in (1.0, 3.0)]
  prefix = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
  y = site(prefix, blocks)
  assert y.shape == (6, 64) and y.dtype == jnp.float32
  assert_close(y, np_attn_res(site, npf(prefix), [npf(b) for b in blocks], 1e-5), atol=1e-5, rtol=1e-5)
  assert site(prefix, []) is prefix


def _pool_row(pool, slot):
  return np.asarray(pool[slot], np.float64)


@pytest.mark.parametrize("name", ["tiny", "tiny_linear"])
def test_kda_layer_prefill_then_decode(name):
  cfg = tiny(name)
  m = KdaLayer(cfg, rngs=nnx.Rngs(5))
  cu = np.array([0, 5, 5, 12], np.int32)  # the middle sequence is empty
  x = rand_x(cfg, 12, seed=6)
  slots = jnp.asarray([3, -1, 0], jnp.int32)
  # Every slot starts as NaN: fresh sequences must not read theirs, and slots 1, 2, 4 must stay NaN.
  state = init_cache(cfg, 1, 64, num_slots=5, fill=np.nan).kda[0]
  y, new = run_module(m, lambda m, x, st, cu, sl: m.prefill(x, st, cu_seqlens=cu, state_indices=sl,
                                                           has_initial_state=jnp.zeros(3, bool)),
                      x, state, jnp.asarray(cu), slots)
  ref, finals = np_kda(cfg, m, npf(x), cu)
  assert y.shape == (12, cfg.hidden_size) and y.dtype == jnp.float32
  assert_close(y, ref)
  for pool in (new.recurrent, new.conv_q, new.conv_k, new.conv_v):
    assert pool.dtype == jnp.float32
    assert np.isnan(np.asarray(pool)[[1, 2, 4]]).all()
  for n, slot in ((0, 3), (2, 0)):
    S, hist = finals[n]
    assert_close(new.recurrent[slot], S.transpose(0, 2, 1), atol=1e-5)
    for c, pool in zip("qkv", (new.conv_q, new.conv_k, new.conv_v)):
      assert_close(pool[slot], hist[c], atol=1e-6)

  # One decode step for sequences 0 and 2 continues the recurrence from the prefilled slots.
  xd = rand_x(cfg, 2, seed=7)
  yd, after = run_module(m, lambda m, x, st, sl: m.decode(x, st, state_indices=sl), xd, new,
                         jnp.asarray([3, 0], jnp.int32))
  ref_d, finals_d = np_kda(cfg, m, npf(xd), np.array([0, 1, 2]), states=[finals[0], finals[2]])
  assert yd.shape == (2, cfg.hidden_size)
  assert_close(yd, ref_d)
  assert_close(after.recurrent[3], finals_d[0][0].transpose(0, 2, 1), atol=1e-5)
  assert_close(after.recurrent[0], finals_d[1][0].transpose(0, 2, 1), atol=1e-5)
  assert np.isnan(np.asarray(after.recurrent)[[1, 2, 4]]).all()


@pytest.mark.parametrize("name", ["tiny", "tiny_linear"])
def test_mla_layer_prefill_then_decode(name):
  cfg = tiny(name)
  m = MlaLayer(cfg, rngs=nnx.Rngs(8))
  cu = np.array([0, 70, 79], np.int32)  # sequence 0 spans two pages
  x = rand_x(cfg, 79, seed=9)
  seq = np.repeat(np.arange(2), np.diff(cu)).astype(np.int32)
  pos = (np.arange(79) - cu[seq]).astype(np.int32)
  # Pages handed out out of order, and a NaN-poisoned spare page that must stay untouched.
  pages = SlotAllocator(5)
  cache = init_cache(cfg, 2, 128, pages=pages, fill=np.nan)
  table = jnp.asarray([[3, 0], [4, 1]], jnp.int32)
  kv = cache.mla[0]
  def prefill(m, x, kv, s, p, prefix):
    return m.prefill(x, kv, seq=s, pos=p, block_table=table, prefix_lens=prefix)

  y, kv = run_module(m, prefill, x, kv, jnp.asarray(seq), jnp.asarray(pos), jnp.zeros(2, jnp.int32))
  ref, rows = np_mla(cfg, m, npf(x), cu)
  assert y.shape == (79, cfg.hidden_size) and y.dtype == jnp.float32 and kv.dtype == jnp.float32
  assert_close(y, ref)
  kvn = np.asarray(kv, np.float64)
  assert_close(kvn[3], rows[:64], atol=1e-5)
  assert_close(kvn[0, :6], rows[64:70], atol=1e-5)
  assert_close(kvn[4, :9], rows[70:79], atol=1e-5)
  assert np.isnan(kvn[2]).all() and np.isnan(kvn[0, 6:]).all()

  # Chunked prefill: 3 and 4 more tokens attend to the cached rows too (positions 70.. and 9..).
  xc = rand_x(cfg, 7, seed=11)
  seq_c = np.array([0, 0, 0, 1, 1, 1, 1], np.int32)
  pos_c = np.array([70, 71, 72, 9, 10, 11, 12], np.int32)
  yc, kv = run_module(m, prefill, xc, kv, jnp.asarray(seq_c), jnp.asarray(pos_c), jnp.asarray([70, 9], jnp.int32))
  seqs = [np.concatenate([npf(x)[:70], npf(xc)[:3]]), np.concatenate([npf(x)[70:], npf(xc)[3:]])]
  assert_close(yc[:3], np_mla(cfg, m, seqs[0], np.array([0, 73]))[0][70:])
  assert_close(yc[3:], np_mla(cfg, m, seqs[1], np.array([0, 13]))[0][9:])

  # Absorbed decode of one more token per sequence equals the non-absorbed oracle on L + 1 tokens.
  xd = rand_x(cfg, 2, seed=10)
  yd, kv = run_module(m, lambda m, x, kv, bt, sl: m.decode(x, kv, block_table=bt, seq_lens=sl),
                      xd, kv, table, jnp.asarray([73, 13], jnp.int32))
  for n in range(2):
    full = np.concatenate([seqs[n], npf(xd)[n:n + 1]])
    assert_close(yd[n], np_mla(cfg, m, full, np.array([0, len(full)]))[0][-1])
  assert np.isnan(np.asarray(kv)[2]).all()


def test_kda_layer_gives_its_impl_to_the_convolutions(monkeypatch):
  """The short convolutions run the config's impl like the KDA ops (a kernel-less shape on a GPU config
  with impl="xla" must not reach the conv kernel)."""
  seen = []
  for op in ("short_conv_prefill", "short_conv_update"):
    original = getattr(short_conv_api, op)
    monkeypatch.setattr(short_conv_api, op,
                        lambda *a, _op=original, **kw: seen.append(kw["config"].impl) or _op(*a, **kw))
  cfg = tiny()
  m = KdaLayer(cfg, rngs=nnx.Rngs(5))
  state = init_cache(cfg, 1, 64, num_slots=2).kda[0]
  slots = jnp.asarray([0, 1], jnp.int32)
  _, state = m.prefill(rand_x(cfg, 6), state, cu_seqlens=jnp.asarray([0, 2, 6], jnp.int32), state_indices=slots,
                       has_initial_state=jnp.zeros(2, bool))
  m.decode(rand_x(cfg, 2), state, state_indices=slots)
  assert seen == ["xla"] * 6

"""Each NNX module against an independent float64 NumPy version of the HF math written here.

The oracles (``np_*``) are also used by tests/test_model.py for the whole-model forward. Modules run in f32
(params, activations, caches); tolerances are a few f32 ulps scaled by the reduction lengths.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import config as cfg_lib
from k3jax.cache import SlotAllocator, init_cache
from k3jax.layers.attn_res import AttnResSite
from k3jax.layers.kda import KdaLayer
from k3jax.layers.mla import MlaLayer
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norms import RMSNorm
from pallas_kernels.kda import short_conv
from support import fast_jit

F32 = dict(dtype=jnp.float32, param_dtype=jnp.float32, cache_dtype=jnp.float32, conv_dtype=jnp.float32,
           state_dtype=jnp.float32, partial_dtype=jnp.float32, impl="xla")
# f32 activations against a float64 oracle: errors are a few ulps times the depth of the reductions.
ATOL, RTOL = 2e-4, 2e-4


def tiny(name="tiny", **kw):
  return cfg_lib.preset(name, **{**F32, **kw})


def run_module(module, fn, *args):
  """``fn(module, *args)`` under ``fast_jit``; the module's parameters and ``args`` are traced."""
  graph, state = nnx.split(module)
  return fast_jit(lambda state, *args: fn(nnx.merge(graph, state), *args))(state, *args)


def npf(x) -> np.ndarray:
  return np.asarray(x[...] if isinstance(x, nnx.Variable) else x, np.float64)


# ---------------------------------------------------------------------------------------------- oracles
def np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def np_silu(x):
  return x * np_sigmoid(x)


def np_rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_act(cfg, g, u):
  if cfg.hidden_act == "silu":
    return np_silu(g) * u
  b, bl = cfg.situ_beta, cfg.situ_linear_beta
  return b * np.tanh(g / b) * np_sigmoid(g) * bl * np.tanh(u / bl)


def np_lin(x, lin):
  """``x [M, ...]`` flattened to the kernel's input size -> ``[M, prod(out_shape)]`` (head-major)."""
  k = npf(lin.kernel)
  n_in = int(np.prod(k.shape[:lin.num_in]))
  return x.reshape(x.shape[0], n_in) @ k.reshape(n_in, -1)


def np_mlp(cfg, m, x):
  return np_lin(np_act(cfg, np_lin(x, m.gate_proj), np_lin(x, m.up_proj)), m.down_proj)


def np_moe(cfg, m, x):
  scores = np_sigmoid(x @ npf(m.gate.kernel))
  choice = scores + npf(m.gate.e_score_correction_bias)
  w1, w2, w3 = npf(m.experts.w1), npf(m.experts.w2), npf(m.experts.w3)
  xr = np_lin(x, m.routed_expert_down_proj) if cfg.routed_expert_hidden_size else x
  y = np.zeros_like(xr)
  for t in range(x.shape[0]):
    idx = np.argsort(-choice[t])[:cfg.num_experts_per_token]
    w = scores[t, idx]
    if cfg.moe_renormalize:
      w = w / (w.sum() + 1e-20)
    w = w * cfg.routed_scaling_factor
    for e, we in zip(idx, w):
      y[t] += we * (np_act(cfg, xr[t] @ w1[e], xr[t] @ w3[e]) @ w2[e])
  if cfg.routed_expert_hidden_size:
    if cfg.latent_moe_use_norm:
      y = np_rms(y, npf(m.routed_expert_norm.weight), cfg.rms_norm_eps)
    y = np_lin(y, m.routed_expert_up_proj)
  if cfg.num_shared_experts:
    y = y + np_mlp(cfg, m.shared_experts, x)
  return y


def np_conv(xl, w, hist):
  """Causal depthwise conv + SiLU of one sequence: ``xl [L, C]``, ``w [C, W]``, ``hist [W-1, C]``."""
  width = w.shape[1]
  full = np.concatenate([hist, xl], 0)
  y = np.stack([(full[t:t + width] * w.T).sum(0) for t in range(xl.shape[0])]) if len(xl) else xl
  return np_silu(y), full[-(width - 1):]


def np_kda(cfg, m, x, cu, states=None):
  """HF KDA over packed sequences; ``states[n] = (S [H, K, V], {q,k,v: conv history [W-1, P]})`` or None.

  Returns ``(out [T, D], final states)``."""
  h, kd, width = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
  lin = {n: np_lin(x, getattr(m, f"{n}_proj")) for n in "qkv"}
  taps = {n: npf(getattr(m, f"{n}_conv1d").weight).reshape(h * kd, width) for n in "qkv"}
  f = (np_lin(np_lin(x, m.f_a_proj), m.f_b_proj)).reshape(-1, h, kd) + npf(m.dt_bias)
  a = np.exp(npf(m.A_log))[None, :, None]
  if cfg.gate_lower_bound is None:
    g = -a * np.where(f > 20, f, np.log1p(np.exp(np.minimum(f, 20))))
  else:
    g = cfg.gate_lower_bound * np_sigmoid(a * f)
  beta = np_sigmoid(np_lin(x, m.b_proj))
  z = np_lin(x, m.g_proj) if cfg.use_full_rank_gate else np_lin(np_lin(x, m.g_a_proj), m.g_b_proj)
  o = np.zeros((x.shape[0], h, kd))
  finals = []
  for n in range(len(cu) - 1):
    s, e = cu[n], cu[n + 1]
    S, hist = (np.zeros((h, kd, kd)), {c: np.zeros((width - 1, h * kd)) for c in "qkv"}) \
        if states is None or states[n] is None else states[n]
    conv, new_hist = {}, {}
    for c in "qkv":
      conv[c], new_hist[c] = np_conv(lin[c][s:e], taps[c], hist[c])
    q, k, v = (conv[c].reshape(-1, h, kd) for c in "qkv")
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * kd ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    S = S.copy()
    for i in range(e - s):
      t = s + i
      S = S * np.exp(g[t])[:, :, None]
      u = beta[t][:, None] * (v[i] - np.einsum("hk,hkv->hv", k[i], S))
      S = S + np.einsum("hk,hv->hkv", k[i], u)
      o[t] = np.einsum("hk,hkv->hv", q[i], S)
    finals.append((S, new_hist))
  y = np_rms(o, npf(m.o_norm.weight), cfg.rms_norm_eps) * np_sigmoid(z.reshape(-1, h, kd))
  return np_lin(y.reshape(x.shape[0], -1), m.o_proj), finals


def np_mla(cfg, m, x, cu):
  """HF NoPE MLA over packed fresh sequences; returns ``(out [T, D], latent rows [T, R + dr])``."""
  hh, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
  if cfg.q_lora_rank is None:
    q = np_lin(x, m.q_proj)
  else:
    q = np_lin(np_rms(np_lin(x, m.q_a_proj), npf(m.q_a_layernorm.weight), 1e-6), m.q_b_proj)
  q = q.reshape(x.shape[0], hh, -1)
  a = np_lin(x, m.kv_a_proj_with_mqa)
  c = np_rms(a[:, :r], npf(m.kv_a_layernorm.weight), 1e-6)
  k = np.concatenate([np.einsum("tr,rhd->thd", c, npf(m.kv_b_proj.w_uk)),
                      np.broadcast_to(a[:, None, r:], (x.shape[0], hh, cfg.qk_rope_head_dim))], -1)
  v = np.einsum("tr,rhd->thd", c, npf(m.kv_b_proj.w_uv))
  o = np.zeros((x.shape[0], hh, dv))
  for n in range(len(cu) - 1):
    s, e = cu[n], cu[n + 1]
    sc = np.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * (dn + cfg.qk_rope_head_dim) ** -0.5
    sc = np.where(np.tril(np.ones((e - s, e - s), bool))[None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o[s:e] = np.einsum("hqk,khd->qhd", p, v[s:e])
  if cfg.mla_use_output_gate:
    o = o * np_sigmoid(np_lin(x, m.g_proj).reshape(o.shape))
  return np_lin(o.reshape(x.shape[0], -1), m.o_proj), np.concatenate([c, a[:, r:]], -1)


def np_attn_res(site, prefix, blocks, eps):
  if not blocks:
    return prefix
  v = np.stack([*blocks, prefix], 1)
  k = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)
  sc = (k * (npf(site.norm) * npf(site.proj)[:, 0])).sum(-1)
  p = np.exp(sc - sc.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("tb,tbd->td", p, v)


# ---------------------------------------------------------------------------------------------- helpers
def rand_x(cfg, t, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((t, cfg.hidden_size)), jnp.float32)


def assert_close(actual, expected, atol=ATOL, rtol=RTOL):
  actual = np.asarray(actual, np.float64)
  assert not np.isnan(actual).any()
  np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)


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
    original = getattr(short_conv, op)
    monkeypatch.setattr(short_conv, op, lambda *a, _op=original, **kw: seen.append(kw["impl"]) or _op(*a, **kw))
  cfg = tiny()
  m = KdaLayer(cfg, rngs=nnx.Rngs(5))
  state = init_cache(cfg, 1, 64, num_slots=2).kda[0]
  slots = jnp.asarray([0, 1], jnp.int32)
  _, state = m.prefill(rand_x(cfg, 6), state, cu_seqlens=jnp.asarray([0, 2, 6], jnp.int32), state_indices=slots,
                       has_initial_state=jnp.zeros(2, bool))
  m.decode(rand_x(cfg, 2), state, state_indices=slots)
  assert seen == ["xla"] * 6

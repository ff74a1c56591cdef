"""Float64 NumPy versions of the HF math of every NNX module, and the shared setup of the layer/model tests.

``tests/test_layers.py`` checks each module against these oracles and ``tests/test_model.py`` the whole-model
forward. Modules run in f32 (params, activations, caches, ``F32``); tolerances are a few f32 ulps scaled by the
reduction lengths.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as cfg_lib
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

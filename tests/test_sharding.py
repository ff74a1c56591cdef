"""k3jax.sharding on 9 CPU devices: mesh, logical names, shard_map wrapping, exact padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from support import device_mesh, needs_devices

from k3jax import nn_util, padding, sharding
from k3jax.config import preset

M = sharding.MODEL
HIGHEST = jax.lax.Precision.HIGHEST


def test_make_mesh():
  needs_devices(9)
  mesh = sharding.make_mesh()
  assert mesh.axis_names == (M,) and mesh.devices.size == len(jax.devices()) == 9
  assert mesh.axis_types == (AxisType.Auto,)
  for n in (1, 2, 4, 8, 9):
    assert sharding.mesh_size(sharding.make_mesh(n)) == n
  for bad in (0, 10, 2.0):
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 9\]"):
      sharding.make_mesh(bad)


def test_spec_and_divisibility():
  assert sharding.spec("batch", "heads", None) == P(None, M, None)
  assert sharding.spec("vocab", "embed") == P(M, None)
  with pytest.raises(ValueError, match="unknown logical axis name 'hidden'"):
    sharding.spec("hidden")
  with pytest.raises(ValueError, match="more than one dim on the same mesh axis"):
    sharding.spec("heads", "mlp")
  mesh = device_mesh(9)
  sharding.check_divisible("w", (7168, 99 * 128), ("embed", "heads"), mesh)
  with pytest.raises(ValueError, match=r"w: dim 1 \('heads'\) .* has size 12288, not a multiple of the 9"):
    sharding.check_divisible("w", (7168, 96 * 128), ("embed", "heads"), mesh)
  with pytest.raises(ValueError, match="2 logical names"):
    sharding.check_divisible("w", (4,), ("embed", "heads"), mesh)
  with pytest.raises(ValueError, match="dim 0 \\('vocab'\\)"):
    sharding.named_sharding(mesh, "vocab", "embed", shape=(163840, 16))
  assert sharding.named_sharding(mesh, "vocab", "embed", shape=(163845, 16)).spec == P(M, None)


def test_every_model_axis_name_has_a_rule():
  assert nn_util.LOGICAL_AXES <= set(sharding.LOGICAL_RULES)


def test_constrain():
  x = jnp.arange(18.0 * 4).reshape(18, 4)
  assert sharding.constrain(x, "heads", None) is x  # no mesh set: a no-op, names still checked
  with pytest.raises(ValueError, match="unknown logical axis name"):
    sharding.constrain(x, "head", None)
  mesh = device_mesh(9)
  with jax.set_mesh(mesh):
    y = jax.jit(lambda x: sharding.constrain(x * 2, "heads", None))(x)
    assert y.sharding.is_equivalent_to(sharding.named_sharding(mesh, "heads", None), 2)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
    with pytest.raises(ValueError, match="constrain\\(x\\): dim 0"):
      jax.jit(lambda x: sharding.constrain(x, "heads", None))(x[:10])


def test_shard_kernel():
  mesh = device_mesh(9)

  def per_device(x, w):  # [T, H_local, K] x [K] -> its heads, plus a per-device count
    return x * w, jnp.full((1,), x.shape[1], jnp.int32)

  fn = sharding.shard_kernel(per_device, [("tokens", "heads", None), None], [("tokens", "heads", None), ("heads",)],
                             mesh)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 18, 4)), jnp.float32)
  w = jnp.arange(4.0)
  y, count = fn(x, w)
  assert y.sharding.is_equivalent_to(sharding.named_sharding(mesh, "tokens", "heads", None), 3)
  assert y.shape == (3, 18, 4) and y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * np.arange(4, dtype=np.float32))
  np.testing.assert_array_equal(np.asarray(count), np.full(9, 2))  # each device saw 2 of the 18 heads
  with pytest.raises(ValueError, match="argument 0: dim 1"):
    fn(x[:, :10], w)
  with pytest.raises(ValueError, match="1 arguments for 2 in_names"):
    fn(x)


@pytest.mark.parametrize("n, m, want", [(96, 9, 99), (896, 9, 900), (163840, 9, 163845), (33792, 9, 33795),
                                        (3072, 9, 3078), (96, 8, 96), (5, 1, 5), (0, 9, 0)])
def test_pad_to_multiple(n, m, want):
  assert padding.pad_to_multiple(n, m) == want


def test_padding_plan_and_pad_param():
  cfg = preset("kimi_linear_48b", impl="xla")
  plan = padding.PaddingPlan.for_config(cfg, 9)
  # One shared expert: its width is moe_intermediate_size itself, so that pads to a multiple of 9 too.
  assert plan.applied == {"num_attention_heads": (32, 36), "kda_num_heads": (32, 36), "num_experts": (256, 261),
                          "vocab_size": (163840, 163845), "moe_intermediate_size": (1024, 1026)}
  assert plan.real("vocab_size") == 163840 and plan.padded("intermediate_size") == 9216
  padded = plan.config(cfg)
  assert (padded.num_attention_heads, padded.num_experts, padded.hidden_size) == (36, 261, cfg.hidden_size)
  assert padding.PaddingPlan.for_config(cfg, 2).applied == {}
  assert padding.PaddingPlan.for_config(cfg, 1).applied == {}
  w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
  np.testing.assert_array_equal(padding.pad_param("kernel", w, (2, 5)), [[0, 1, 2, 0, 0], [3, 4, 5, 0, 0]])
  bias = padding.pad_param("e_score_correction_bias", np.zeros(7, np.float32), (9,))
  assert bias.dtype == np.float32 and np.isneginf(bias[7:]).all() and (bias[:7] == 0).all()
  assert padding.pad_param("kernel", w, (2, 3)) is w  # nothing grows: no copy of a large checkpoint block
  empty = padding.pad_param("e_score_correction_bias", np.zeros(0, np.float32), (2,))  # a block of padding only
  assert np.isneginf(empty).all() and empty.shape == (2,)
  # JAX arrays, traced ones too, are padded as JAX arrays (no host round trip; usable inside jax.jit).
  on_device = jax.jit(lambda b: padding.pad_param("e_score_correction_bias", b, (9,)))(jnp.ones(7, jnp.bfloat16))
  assert isinstance(on_device, jax.Array) and on_device.dtype == jnp.bfloat16 and on_device.shape == (9,)
  np.testing.assert_array_equal(np.asarray(on_device, np.float32), [1] * 7 + [-np.inf] * 2)
  with pytest.raises(ValueError, match=r"kernel: cannot pad shape \(2, 3\) to \(2, 2\)"):
    padding.pad_param("kernel", w, (2, 2))
  with pytest.raises(ValueError, match="tp must be an int >= 1"):
    padding.PaddingPlan.for_config(cfg, 0)
  with pytest.raises(ValueError, match="field must be one of"):
    plan.padded("hidden_size")
  with pytest.raises(ValueError, match="made for other sizes"):
    plan.config(padded)
  with pytest.raises(ValueError, match="pad_to_multiple needs"):
    padding.pad_to_multiple(3, 0)


def attention_np(x, wq, wk, wv, wo, heads):
  """Float64 causal multi-head attention: x [T, D], w* [D, H * d], wo [H * d, D]."""
  t = x.shape[0]
  split = lambda a: a.reshape(t, heads, -1).transpose(1, 0, 2)
  q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
  s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]) + np.triu(np.full((t, t), -np.inf), 1)
  p = np.exp(s - s.max(-1, keepdims=True))
  o = (p / p.sum(-1, keepdims=True)) @ v
  return o.transpose(1, 0, 2).reshape(t, -1) @ wo


def attention_jnp(x, wq, wk, wv, wo, heads):
  """The same layer in f32 JAX, each head's contribution to the output returned separately: [H, T, D]."""
  t = x.shape[0]
  split = lambda a: sharding.constrain(jnp.dot(x, a, precision=HIGHEST).reshape(t, heads, -1), "tokens", "heads",
                                       None)
  q, k, v = split(wq), split(wk), split(wv)
  s = jnp.einsum("thd,shd->hts", q, k, precision=HIGHEST) / jnp.sqrt(q.shape[-1])
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  o = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v, precision=HIGHEST)
  return jnp.einsum("thd,hde->hte", o, wo.reshape(heads, -1, wo.shape[-1]), precision=HIGHEST)


def test_padded_heads_contribute_exactly_zero_sharded():
  rng = np.random.default_rng(1)
  heads, d, dm, t = 4, 8, 16, 5
  x = rng.standard_normal((t, dm)) / 4
  ws = [rng.standard_normal((dm, heads * d)) / 4 for _ in range(3)] + [rng.standard_normal((heads * d, dm)) / 4]
  mesh = device_mesh(9)
  # Head-major fused [D, H * d] / [H * d, D] weights: padding the end of the axis appends whole zero heads.
  padded = [jnp.asarray(padding.pad_param("kernel", w.astype(np.float32), (dm, 9 * d))) for w in ws[:3]]
  padded.append(jnp.asarray(padding.pad_param("kernel", ws[3].astype(np.float32), (9 * d, dm))))
  names = [("embed", "heads")] * 3 + [("heads", "embed")]
  placed = [jax.device_put(w, sharding.named_sharding(mesh, *n, shape=w.shape)) for w, n in zip(padded, names)]
  with jax.set_mesh(mesh):
    parts = jax.jit(attention_jnp, static_argnums=5)(jnp.asarray(x, jnp.float32), *placed, 9)
  assert parts.shape == (9, t, dm) and parts.dtype == jnp.float32
  parts = np.asarray(parts)
  assert (parts[heads:] == 0).all()  # exactly: zero q/k/v columns give v = 0, and o_proj rows are zero
  # f32 with HIGHEST matmuls of O(1) values over <= 32 terms against float64: a few f32 ulps.
  np.testing.assert_allclose(parts.sum(0), attention_np(x, *ws, heads), rtol=0, atol=2e-6)
  with pytest.raises(ValueError, match="dim 1 \\('heads'\\)"):
    sharding.named_sharding(mesh, "embed", "heads", shape=ws[0].shape)  # unpadded: refused, not replicated


def moe_jnp(x, router, bias, w1, w3, w2, top_k):
  """Sigmoid router (bias for selection only), renormalised top-k, SiLU-gated experts, gathered per token."""
  scores = jax.nn.sigmoid(jnp.dot(x, router, precision=HIGHEST))
  _, idx = jax.lax.top_k(scores + bias, top_k)
  w = jnp.take_along_axis(scores, idx, axis=-1)
  w = w / w.sum(-1, keepdims=True)
  h = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, w1[idx], precision=HIGHEST))
  h = h * jnp.einsum("td,tkdf->tkf", x, w3[idx], precision=HIGHEST)
  return jnp.einsum("tk,tkf,tkfd->td", w, h, w2[idx], precision=HIGHEST), idx


def moe_np(x, router, bias, w1, w3, w2, top_k):
  scores = 1 / (1 + np.exp(-x @ router))
  idx = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :top_k]
  w = np.take_along_axis(scores, idx, -1)
  w /= w.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j, e in enumerate(idx[t]):
      g = x[t] @ w1[e]
      out[t] += w[t, j] * ((g / (1 + np.exp(-g))) * (x[t] @ w3[e])) @ w2[e]
  return out, idx


def test_padded_experts_are_never_selected():
  rng = np.random.default_rng(2)
  experts, top_k, dm, f, t = 7, 3, 8, 6, 32
  x = rng.standard_normal((t, dm))
  router = rng.standard_normal((dm, experts))
  # Bias from training: negative enough that padded zero-logit experts (score 0.5) would win without -inf.
  bias = rng.uniform(-1.0, -0.5, experts)
  w1, w3 = (rng.standard_normal((experts, dm, f)) / 3 for _ in range(2))
  w2 = rng.standard_normal((experts, f, dm)) / 3
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  pad = lambda name, a: f32(padding.pad_param(name, a.astype(np.float32), (9,) + a.shape[1:]))
  padded = (f32(padding.pad_param("kernel", router.astype(np.float32), (dm, 9))),
            pad("e_score_correction_bias", bias), pad("w1", w1), pad("w3", w3), pad("w2", w2))
  out, idx = jax.jit(moe_jnp, static_argnums=6)(f32(x), *padded, top_k)
  assert out.shape == (t, dm) and out.dtype == jnp.float32 and idx.shape == (t, top_k)
  ref, ref_idx = moe_np(x, router, bias, w1, w3, w2, top_k)
  assert (np.asarray(idx) < experts).all()
  _, idx_zero_bias = moe_jnp(f32(x), padded[0], pad("kernel", bias), *padded[2:], top_k)
  assert (np.asarray(idx_zero_bias) >= experts).any()  # so the -inf bias is what keeps the dummies out
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(ref_idx, -1))
  # f32 vs float64 over sums of <= 8 terms of O(1) values.
  np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=1e-5)


def test_padded_ffn_and_vocab_contribute_exactly_zero():
  rng = np.random.default_rng(3)
  dm, f, vocab = 8, 6, 11
  xs = rng.standard_normal((4, dm))
  wg_, wu_ = (rng.standard_normal((dm, f)) / np.sqrt(dm) for _ in range(2))
  wd_ = rng.standard_normal((f, dm)) / np.sqrt(f)
  x, wg, wu, wd = (jnp.asarray(a, jnp.float32) for a in (xs, wg_, wu_, wd_))
  head = jnp.asarray(rng.standard_normal((dm, vocab)), jnp.float32)
  pad = lambda w, shape: jnp.asarray(padding.pad_param("kernel", w, shape))
  g, u = (jnp.dot(x, pad(w, (dm, 9)), precision=HIGHEST) for w in (wg, wu))
  hidden = jax.nn.silu(g) * u
  assert hidden.shape == (4, 9) and (np.asarray(hidden[:, f:]) == 0).all()
  y = jnp.dot(hidden, pad(wd, (9, dm)), precision=HIGHEST)
  g_ = xs @ wg_
  ref = (g_ / (1 + np.exp(-g_)) * (xs @ wu_)) @ wd_
  # f32 vs float64, sums of <= 9 terms of O(1) values.
  np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=2e-6)
  logits = jnp.dot(x, pad(head, (dm, 18)), precision=HIGHEST)
  assert logits.shape == (4, 18) and (np.asarray(logits[:, vocab:]) == 0).all()
  # The real columns are the unpadded product, up to f32 rounding: a CPU may pick another dot kernel (another
  # summation order) for 18 columns than for 11, so they need not be bitwise equal.
  np.testing.assert_allclose(np.asarray(logits[:, :vocab]), np.asarray(jnp.dot(x, head, precision=HIGHEST)),
                             rtol=0, atol=1e-5)

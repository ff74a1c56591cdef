"""Dense gated MLP and the Kimi MoE block (sigmoid router, bias for selection only, latent experts).

Routed experts run as three grouped matmuls over the token copies sorted by expert
(``k3jax.sharding.routed_experts``: expert parallel on a mesh, all experts in place without one):
``jax.lax.ragged_dot``, the Hopper kernel ``ragged_dot_mgpu`` for large bf16 prefills under ``impl="pallas"``,
or each copy times its gathered expert for decodes over many experts (``k3jax.sharding.grouped_matmul_backend``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import nn_util, sharding
from k3jax.config import K3Config
from k3jax.layers.norms import RMSNorm


def gated_act(cfg: K3Config, gate: jax.Array, up: jax.Array) -> jax.Array:
  """``act(gate) * up'`` in f32: SwiGLU (``silu``) or K3's SiTU.

  SiTU: ``b tanh(g / b) sigmoid(g) * b_lin tanh(u / b_lin)`` with ``b = situ_beta``, ``b_lin = situ_linear_beta``.
  """
  g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
  if cfg.hidden_act == "silu":
    return jax.nn.silu(g) * u
  b, bl = cfg.situ_beta, cfg.situ_linear_beta
  return b * jnp.tanh(g / b) * jax.nn.sigmoid(g) * (bl * jnp.tanh(u / bl))


class MLP(nnx.Module):
  """``down_proj(act(gate_proj x) * up_proj x)`` (HF ``KimiMLP``; also the shared experts)."""

  def __init__(self, cfg: K3Config, width: int, *, rngs: nnx.Rngs):
    lin = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    d = cfg.hidden_size
    self.cfg = cfg
    self.gate_proj = nn_util.Linear((d,), (width,), ("embed", "mlp"), **lin)
    self.up_proj = nn_util.Linear((d,), (width,), ("embed", "mlp"), **lin)
    self.down_proj = nn_util.Linear((width,), (d,), ("mlp", "embed"), **lin)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [T, D]`` -> ``[T, D]`` in ``cfg.dtype``."""
    h = gated_act(self.cfg, self.gate_proj(x), self.up_proj(x)).astype(self.cfg.dtype)
    return self.down_proj(h)


class Router(nnx.Module):
  """HF ``KimiMoEGate``: f32 sigmoid scores; ``e_score_correction_bias`` only picks the experts."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e = cfg.num_experts
    self.kernel = nn_util.param(rngs, nn_util.fan_in_normal(cfg.hidden_size), (cfg.hidden_size, e),
                                jnp.float32, ("embed", "experts"))
    self.e_score_correction_bias = nn_util.param(rngs, nn_util.small_normal(0.1), (e,), jnp.float32,
                                                 ("experts",))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]`` -> ``(experts [T, k] int32, weights [T, k] f32)``."""
    cfg = self.cfg
    logits = jnp.dot(x.astype(jnp.float32), self.kernel[...], precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + self.e_score_correction_bias[...], cfg.num_experts_per_token)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
      w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


class Experts(nnx.Module):
  """Stacked routed experts ``w1`` (gate), ``w3`` (up) ``[E, De, I]`` and ``w2`` (down) ``[E, I, De]``."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e, de, i = cfg.num_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
    self.w1 = nn_util.param(rngs, nn_util.fan_in_normal(de), (e, de, i), cfg.param_dtype,
                            ("experts", "moe_embed", "moe_mlp"))
    self.w3 = nn_util.param(rngs, nn_util.fan_in_normal(de), (e, de, i), cfg.param_dtype,
                            ("experts", "moe_embed", "moe_mlp"))
    self.w2 = nn_util.param(rngs, nn_util.fan_in_normal(i), (e, i, de), cfg.param_dtype,
                            ("experts", "moe_mlp", "moe_embed"))

  def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum of the chosen experts per token.

    Args:
      x: ``[T, De]`` expert inputs. experts: ``[T, k]`` int32 ids. weights: ``[T, k]`` f32.

    Returns:
      ``[T, De]`` f32.
    """
    return sharding.routed_experts(x, experts, weights, self.w1[...], self.w3[...], self.w2[...],
                                   act=functools.partial(gated_act, self.cfg), dtype=self.cfg.dtype,
                                   impl=self.cfg.impl)


class MoE(nnx.Module):
  """HF ``KimiSparseMoeBlock`` (``block_sparse_moe``), with K3's optional latent routed path.

  ``y = up(norm(sum_e w_e expert_e(down(x)))) + shared(x)``; the router always scores the full-width x.
  """

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    lin = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.gate = Router(cfg, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.num_shared_experts:
      self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts, rngs=rngs)
    if cfg.routed_expert_hidden_size is not None:
      d, dl = cfg.hidden_size, cfg.routed_expert_hidden_size
      self.routed_expert_down_proj = nn_util.Linear((d,), (dl,), ("embed", "moe_embed"), **lin)
      self.routed_expert_up_proj = nn_util.Linear((dl,), (d,), ("moe_embed", "embed"), **lin)
      if cfg.latent_moe_use_norm:
        self.routed_expert_norm = RMSNorm(dl, eps=cfg.rms_norm_eps, name="moe_embed", dtype=cfg.dtype,
                                          param_dtype=cfg.param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [T, D]`` -> ``[T, D]`` in ``cfg.dtype``."""
    cfg = self.cfg
    experts, weights = self.gate(x)
    latent = cfg.routed_expert_hidden_size is not None
    routed_in = self.routed_expert_down_proj(x) if latent else x
    y = self.experts(routed_in, experts, weights)
    if latent:
      y = self.routed_expert_norm(y) if cfg.latent_moe_use_norm else y.astype(cfg.dtype)
      y = self.routed_expert_up_proj(y)
    y = y.astype(jnp.float32)
    if cfg.num_shared_experts:
      y = y + self.shared_experts(x).astype(jnp.float32)
    return y.astype(cfg.dtype)

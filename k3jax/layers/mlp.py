"""Dense gated MLP (also the shared experts of ``k3jax.layers.moe``) and its gated activation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import nn_util
from k3jax.config import K3Config


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

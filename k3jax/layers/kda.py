"""Kimi Delta Attention layer (HF ``KimiDeltaAttention``), over the KDA state pool.

Per token: ``q, k, v = silu(short_conv(x W_{q,k,v}))`` (L2 norm and the query scale happen in the op),
``g_raw = f_b(f_a x)`` (the op adds ``dt_bias`` and applies the softplus or lower-bound gate with ``A_log``),
``beta_raw = b_proj x`` (sigmoid in the op), ``o = KDA(q, k, v, g, beta; state)``, then
``o_proj(RMSNorm_V(o) * o_norm.weight * sigmoid(z))`` with ``z = g_b(g_a x)`` or, full rank, ``g_proj x``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import nn_util, ops
from k3jax.cache import Checkpoints, KdaState
from k3jax.config import K3Config
from k3jax.layers.norms import RMSNorm
# The mesh-aware drop-ins: split over heads on the ambient mesh, the plain ops without one.

_CONVS = (("q", "conv_q"), ("k", "conv_k"), ("v", "conv_v"))


def _a_log_init(key, shape, dtype):
  return jnp.log(nn_util.random_values(key, shape, jnp.float32, dist="uniform", a=1.0, b=16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype):
  log_dt = nn_util.random_values(key, shape, jnp.float32, dist="uniform", a=math.log(1e-3), b=math.log(1e-1))
  dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # softplus^-1(dt)


class ShortConv(nnx.Module):
  """Depthwise causal conv taps ``weight [H, K, W]`` (HF ``[H*K, 1, W]``), f32 like the Kimi checkpoints."""

  def __init__(self, heads: int, head_dim: int, width: int, *, rngs: nnx.Rngs):
    self.weight = nn_util.param(rngs, nn_util.fan_in_normal(width), (heads, head_dim, width), jnp.float32,
                                ("kda_heads", "kda_head_dim", "conv_width"))

  def taps(self) -> jax.Array:
    """``[H*K, W]``, the op's channel-major layout."""
    h, k, w = self.weight[...].shape
    return self.weight[...].reshape(h * k, w)


class KdaLayer(nnx.Module):
  """One KDA layer; parameters named as in the HF checkpoint (linear kernels ``[in, out]``, head-split)."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, k, w = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    lin = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    heads = ("kda_heads", "kda_head_dim")
    self.q_proj = nn_util.Linear((d,), (h, k), ("embed", *heads), **lin)
    self.k_proj = nn_util.Linear((d,), (h, k), ("embed", *heads), **lin)
    self.v_proj = nn_util.Linear((d,), (h, k), ("embed", *heads), **lin)
    self.q_conv1d = ShortConv(h, k, w, rngs=rngs)
    self.k_conv1d = ShortConv(h, k, w, rngs=rngs)
    self.v_conv1d = ShortConv(h, k, w, rngs=rngs)
    self.f_a_proj = nn_util.Linear((d,), (k,), ("embed", "kda_gate_rank"), **lin)
    self.f_b_proj = nn_util.Linear((k,), (h, k), ("kda_gate_rank", *heads), **lin)
    self.b_proj = nn_util.Linear((d,), (h,), ("embed", "kda_heads"), **lin)
    if cfg.use_full_rank_gate:
      self.g_proj = nn_util.Linear((d,), (h, k), ("embed", *heads), **lin)
    else:
      self.g_a_proj = nn_util.Linear((d,), (k,), ("embed", "kda_gate_rank"), **lin)
      self.g_b_proj = nn_util.Linear((k,), (h, k), ("kda_gate_rank", *heads), **lin)
    self.A_log = nn_util.param(rngs, _a_log_init, (h,), jnp.float32, ("kda_heads",))
    self.dt_bias = nn_util.param(rngs, _dt_bias_init, (h, k), jnp.float32, heads)
    self.o_norm = RMSNorm(k, eps=cfg.rms_norm_eps, name="kda_head_dim", dtype=jnp.float32,
                          param_dtype=jnp.float32, rngs=rngs)
    self.o_proj = nn_util.Linear((h, k), (d,), (*heads, "embed"), **lin)

  def _inputs(self, x: jax.Array) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """Pre-conv ``{q, k, v}`` ``[M, H*K]``, ``g_raw [M, H, K]`` f32 and ``beta_raw [M, H]`` f32."""
    pre = {n: getattr(self, f"{n}_proj")(x) for n in ("q", "k", "v")}
    pre = {n: a.reshape(a.shape[0], math.prod(a.shape[1:])) for n, a in pre.items()}  # -1 fails for 0 rows
    g_raw = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32)
    beta_raw = self.b_proj(x).astype(jnp.float32)
    return pre, g_raw, beta_raw

  def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
    """Gated head-wise RMSNorm of ``o [M, H, V]`` then ``o_proj``; ``[M, D]`` in ``cfg.dtype``."""
    z = self.g_proj(x) if self.cfg.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
    y = self.o_norm(o) * jax.nn.sigmoid(z.astype(jnp.float32))
    return self.o_proj(y.astype(self.cfg.dtype))

  def _heads(self, a: jax.Array) -> jax.Array:
    return a.reshape(a.shape[0], self.cfg.kda_num_heads, self.cfg.kda_head_dim)

  def prefill(self, x: jax.Array, state: KdaState, *, cu_seqlens: jax.Array, state_indices: jax.Array,
              has_initial_state: jax.Array, checkpoints: Checkpoints | None = None) -> tuple[jax.Array, KdaState]:
    """Packed varlen prefill.

    Args:
      x: ``[T, D]`` normalised hidden states of N packed sequences.
      state: this layer's pool (``KdaState``).
      cu_seqlens: ``[N + 1]`` int32. state_indices: ``[N]`` int32 pool slots. has_initial_state: ``[N]`` bool.
      checkpoints: the recurrent and conv states after these offsets also go to these slots (None: none).

    Returns:
      ``[T, D]`` in ``cfg.dtype`` and the updated state (only the named slots change).
    """
    pre, g_raw, beta_raw = self._inputs(x)
    ckpt = {} if checkpoints is None else dict(checkpoint_indptr=checkpoints.indptr,
                                               checkpoint_offsets=checkpoints.offsets,
                                               checkpoint_slots=checkpoints.slots)
    conv, pools = {}, {}
    for n, pool in _CONVS:
      conv[n], pools[pool] = ops.mesh_short_conv_prefill(
          pre[n], getattr(self, f"{n}_conv1d").taps(), cu_seqlens=cu_seqlens, conv_pool=getattr(state, pool),
          state_indices=state_indices, has_initial_state=has_initial_state,
          config=self.cfg.short_conv_op_config(), **ckpt)
    o, recurrent = ops.mesh_kda_prefill(
        self._heads(conv["q"]), self._heads(conv["k"]), self._heads(conv["v"]), g_raw, beta_raw,
        A_log=self.A_log[...], dt_bias=self.dt_bias[...], cu_seqlens=cu_seqlens, state_pool=state.recurrent,
        state_indices=state_indices, has_initial_state=has_initial_state, config=self.cfg.kda_op_config(), **ckpt)
    return self._output(x, o), KdaState(recurrent=recurrent, **pools)

  def decode(self, x: jax.Array, state: KdaState, *, state_indices: jax.Array,
             num_accepted: jax.Array | None = None) -> tuple[jax.Array, KdaState]:
    """One token per sequence, or the speculative verify form of the ops.

    Args:
      x: ``[N, D]`` (one token per sequence), or ``[N * (1 + S), D]`` sequence-major for the speculative form.
      state: this layer's pool (``KdaState``).
      state_indices: ``[N]`` int32 pool slots (read and written in place), or ``[N, 1 + S]``: the state is read
        from column ``num_accepted[n] - 1`` and the state after token t written to column t.
      num_accepted: ``[N]`` int32, with (and only with) the ``[N, 1 + S]`` form.

    Returns:
      ``x``'s shape in ``cfg.dtype`` and the updated state.
    """
    pre, g_raw, beta_raw = self._inputs(x)
    lead = state_indices.shape
    split = lambda a: a.reshape(*lead, *a.shape[1:])
    flat = lambda a: a.reshape(-1, *a.shape[len(lead):])
    conv, pools = {}, {}
    for n, pool in _CONVS:
      y, pools[pool] = ops.mesh_short_conv_update(
          split(pre[n]), getattr(self, f"{n}_conv1d").taps(), conv_pool=getattr(state, pool),
          state_indices=state_indices, num_accepted=num_accepted, config=self.cfg.short_conv_op_config())
      conv[n] = split(self._heads(flat(y)))
    o, recurrent = ops.mesh_kda_decode(
        conv["q"], conv["k"], conv["v"], split(g_raw), split(beta_raw), A_log=self.A_log[...],
        dt_bias=self.dt_bias[...], state_pool=state.recurrent, state_indices=state_indices,
        num_accepted=num_accepted, config=self.cfg.kda_op_config())
    return self._output(x, flat(o)), KdaState(recurrent=recurrent, **pools)

"""Block attention residuals (Kimi-K3 ``attn_res_block_size``).

The residual stream is a running ``prefix_sum`` plus a list of depth checkpoints. At each mix site a learned
one-dimensional query scores every candidate ``{checkpoints..., prefix_sum}`` (RMS-normalised, no scale)
against ``norm.weight * proj.weight``, and the softmax of the scores mixes the *raw* candidates, in f32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import nn_util
from k3jax.layers.norms import rms_normalize


class AttnResSite(nnx.Module):
  """The ``(proj [D, 1], norm [D])`` pair of one mix site (HF ``<site>_res_proj`` / ``<site>_res_norm``)."""

  def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
    self.eps = float(eps)
    self.proj = nn_util.param(rngs, nn_util.fan_in_normal(dim), (dim, 1), param_dtype, ("embed", None))
    self.norm = nn_util.param(rngs, nn_util.norm_weight, (dim,), param_dtype, ("embed",))

  def __call__(self, prefix_sum: jax.Array, blocks: Sequence[jax.Array]) -> jax.Array:
    """Mixes ``blocks`` (each ``[T, D]``) and ``prefix_sum [T, D]``; returns ``[T, D]`` in prefix_sum's dtype."""
    if not blocks:
      return prefix_sum
    v = jnp.stack([*blocks, prefix_sum], axis=1).astype(jnp.float32)  # [T, B + 1, D]
    w = self.norm[...].astype(jnp.float32) * self.proj[...][:, 0].astype(jnp.float32)
    scores = jnp.einsum("tbd,d->tb", rms_normalize(v, self.eps), w, precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tb,tbd->td", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.astype(prefix_sum.dtype)

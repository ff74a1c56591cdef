"""The one way parameters are created: every ``nnx.Param`` carries its logical axis names.

``k3jax.sharding`` maps logical names to mesh axes; modules never name mesh axes. It reads them from
``param(...).get_metadata()["logical_axes"]``, which every parameter carries.

Logical names (``None`` in a name tuple means "never sharded"):

* ``vocab`` vocabulary, ``embed`` hidden size D.
* ``mlp`` dense/shared FFN width; ``experts`` E; ``moe_embed`` routed-expert width (latent or D);
  ``moe_mlp`` routed-expert FFN width.
* ``kda_heads`` H, ``kda_head_dim`` K (= V), ``kda_gate_rank`` the rank of ``f_a``/``g_a`` (= K),
  ``conv_width`` W.
* ``heads`` MLA heads, ``qk_head_dim`` dn + dr, ``qk_nope_dim`` dn, ``v_head_dim`` dv,
  ``q_lora`` q LoRA rank, ``kv_lora`` R, ``kv_latent`` R + dr.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LOGICAL_AXES = frozenset({
    "vocab", "embed", "mlp", "experts", "moe_embed", "moe_mlp", "kda_heads", "kda_head_dim", "kda_gate_rank",
    "conv_width", "heads", "qk_head_dim", "qk_nope_dim", "v_head_dim", "q_lora", "kv_lora", "kv_latent",
})

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def param(rngs: nnx.Rngs, init: Init, shape: Sequence[int], dtype, names: Sequence[str | None]) -> nnx.Param:
  """Creates an ``nnx.Param`` of ``shape``/``dtype`` from ``init``, tagged with logical axis ``names``.

  Raises:
    ValueError: ``names`` does not have one entry per dimension or holds an unknown name.
  """
  shape, names = tuple(int(s) for s in shape), tuple(names)
  if len(names) != len(shape):
    raise ValueError(f"names must have one entry per dimension of shape {shape}, got {names}")
  unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
  if unknown:
    raise ValueError(f"names must be logical axes from {sorted(LOGICAL_AXES)} or None, got {unknown}")
  return nnx.Param(init(rngs.params(), shape, jnp.dtype(dtype)), logical_axes=names)


def logical_axes(module: nnx.Module) -> dict[str, tuple[str | None, ...]]:
  """``{"layers.0.self_attn.q_proj.kernel": ("embed", "kda_heads", "kda_head_dim"), ...}`` of a model."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    out[".".join(str(p) for p in path)] = var.get_metadata()["logical_axes"]
  return out


# ------------------------------------------------------------------------------------------- initialisers
# Random weights exist for tests and demos only (real ones come from checkpoints); they are drawn so that
# a forgotten multiplication cannot cancel out (norm weights 1 + N(0, 0.05), non-zero biases).
def random_values(key: jax.Array, shape: tuple[int, ...], dtype, *, dist: str, a: float, b: float) -> jax.Array:
  """``a + b * N(0, 1)`` (``dist="normal"``) or ``U(a, b)`` (``dist="uniform"``) of ``shape``, in ``dtype``.

  Eagerly the values are drawn on the host from a NumPy generator seeded by the key: eager ``jax.random``
  compiles one program per distinct shape, which made building even a tiny model take a minute on CPU.
  Under tracing (``nnx.eval_shape``, a jitted sharded init) ``jax.random`` is used.
  """
  if isinstance(key, jax.core.Tracer):
    if dist == "normal":
      x = a + b * jax.random.normal(key, shape, jnp.float32)
    else:
      x = jax.random.uniform(key, shape, jnp.float32, a, b)
    return x.astype(dtype)
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
  x = a + b * rng.standard_normal(shape) if dist == "normal" else rng.uniform(a, b, shape)
  return jnp.asarray(x.astype(np.float32), dtype)


def fan_in_normal(num_in: int) -> Init:
  return functools.partial(random_values, dist="normal", a=0.0, b=1.0 / math.sqrt(num_in))


def small_normal(std: float) -> Init:
  return functools.partial(random_values, dist="normal", a=0.0, b=std)


norm_weight: Init = functools.partial(random_values, dist="normal", a=1.0, b=0.05)


class Linear(nnx.Module):
  """``y = x @ kernel`` contracting the last ``len(in_shape)`` axes of x; kernel ``[*in_shape, *out_shape]``.

  The kernel is stored in ``param_dtype`` and the product runs in ``dtype`` (f32 accumulation).
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], names: Sequence[str | None], *,
               dtype, param_dtype, rngs: nnx.Rngs):
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    self.num_in = len(in_shape)
    self.dtype = jnp.dtype(dtype)
    self.kernel = param(rngs, fan_in_normal(math.prod(in_shape)), in_shape + out_shape, param_dtype, names)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [..., *in_shape]`` -> ``[..., *out_shape]`` in ``dtype``."""
    y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=self.num_in,
                      preferred_element_type=jnp.float32)
    return y.astype(self.dtype)

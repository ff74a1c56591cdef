"""Exact zero padding of a model for a mesh size: ``PaddingPlan`` and the padded parameters.

Split dims (heads, experts, FFN widths, vocabulary) must divide by the number of devices; a model whose sizes
do not (K3's 96 heads on 9 devices) is padded so that every padded unit contributes exactly zero (see
``PaddingPlan``). ``k3jax.sharding.shard_model`` applies the plan while placing a model on a mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def pad_to_multiple(n: int, m: int) -> int:
  """The smallest multiple of ``m`` that is ``>= n`` (``n >= 0``, ``m >= 1``)."""
  if not isinstance(n, int) or not isinstance(m, int) or n < 0 or m < 1:
    raise ValueError(f"pad_to_multiple needs ints n >= 0 and m >= 1, got n={n!r}, m={m!r}")
  return -(-n // m) * m


# ``K3Config`` fields that set the size of a split dim.
PADDED_FIELDS = ("num_attention_heads", "kda_num_heads", "num_experts", "vocab_size", "intermediate_size",
                 "moe_intermediate_size")
# Parameters whose padded entries are not zero: a -inf correction bias keeps dummy experts out of the top-k.
_PAD_FILL = {"e_score_correction_bias": -jnp.inf}


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
  """Real and padded sizes of the ``K3Config`` fields behind split dims, for ``tp`` devices.

  Each field is padded to a multiple of ``tp``, except ``moe_intermediate_size``: the shared experts
  (split, width ``num_shared_experts * moe_intermediate_size``) need the product to divide, so it is padded
  to a multiple of ``tp / gcd(tp, num_shared_experts)`` (the routed experts, whole per device, simply get
  the same zero columns). ``pad_model`` pads so that the padded units contribute exactly zero: zero
  projections into and out of padded heads (zero q/k/v keep a KDA state at zero, RMSNorm(0) = 0, and the
  output projection rows are zero), zero experts behind a ``-inf`` correction bias (never selected while
  ``top_k <= real experts``), zero FFN columns (``act(0) * 0 = 0``) and zero vocabulary rows whose logits
  the jitted step drops.

  Attributes:
    tp: devices on the model axis.
    dims: ``(field, real, padded)`` for every field of ``PADDED_FIELDS``.
  """

  tp: int
  dims: tuple[tuple[str, int, int], ...]

  @classmethod
  def for_config(cls, cfg, tp: int) -> "PaddingPlan":
    """The plan of ``cfg`` (a ``K3Config``) on ``tp`` devices.

    Raises:
      ValueError: ``tp`` is not an int >= 1.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
      raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    multiple = dict.fromkeys(PADDED_FIELDS, tp)
    multiple["moe_intermediate_size"] = tp // math.gcd(tp, cfg.num_shared_experts or tp)
    return cls(tp=tp, dims=tuple((f, getattr(cfg, f), pad_to_multiple(getattr(cfg, f), multiple[f]))
                                 for f in PADDED_FIELDS))

  def real(self, field: str) -> int:
    return self._entry(field)[1]

  def padded(self, field: str) -> int:
    return self._entry(field)[2]

  def _entry(self, field: str) -> tuple[str, int, int]:
    for entry in self.dims:
      if entry[0] == field:
        return entry
    raise ValueError(f"field must be one of {PADDED_FIELDS}, got {field!r}")

  @property
  def applied(self) -> dict[str, tuple[int, int]]:
    """``{field: (real, padded)}`` for the fields that actually grow."""
    return {f: (r, p) for f, r, p in self.dims if p != r}

  def config(self, cfg):
    """``cfg`` with the padded sizes.

    Raises:
      ValueError: ``cfg`` is not the config the plan was made for.
    """
    wrong = {f: getattr(cfg, f) for f, r, _ in self.dims if getattr(cfg, f) != r}
    if wrong:
      raise ValueError(f"the plan was made for other sizes: config has {wrong}, plan has {self.dims}")
    return cfg.replace(**{f: p for f, _, p in self.dims})


def pad_param(name: str, x, shape: Sequence[int]) -> np.ndarray | jax.Array:
  """Parameter ``name``'s value ``x`` padded at the end of each dim to ``shape``.

  The fill is zero, except ``-inf`` for ``e_score_correction_bias``: a dummy expert's selection score is
  then ``-inf`` and it never enters the top-k. A JAX array (also a traced one, inside ``jax.jit``) is padded
  where it lives; anything else on the host with NumPy.

  Returns:
    The padded array in ``x``'s dtype and array library (no copy when nothing grows).

  Raises:
    ValueError: ``shape`` has another rank or a smaller dim.
  """
  xp = jnp if isinstance(x, jax.Array) else np
  x = xp.asarray(x)
  if len(shape) != x.ndim or any(t < s for s, t in zip(x.shape, shape)):
    raise ValueError(f"{name}: cannot pad shape {x.shape} to {tuple(shape)}")
  if x.shape == tuple(shape):  # no copy: checkpoint blocks can be large
    return x
  widths = [(0, t - s) for s, t in zip(x.shape, shape)]
  return xp.pad(x, widths, constant_values=_PAD_FILL.get(name, 0))


def rebuild(model: nnx.Module, cfg) -> nnx.Module:
  """A copy of ``model`` built from ``cfg`` with the parameters of ``model``.

  Each parameter keeps its values in front and is padded at the end of every dim that ``cfg`` makes larger,
  with zeros (``-inf`` for ``e_score_correction_bias``). Changing only runtime fields (dtypes of caches and
  partials, ``impl``) copies the parameters unchanged.
  """
  graphdef, target = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0))))
  real = dict(nnx.to_flat_state(nnx.state(model)))
  for path, var in nnx.to_flat_state(target):
    var.set_value(jnp.asarray(pad_param(str(path[-1]), real[path].get_value(), var.shape)))
  return nnx.merge(graphdef, target)


def pad_model(model: nnx.Module, plan: PaddingPlan) -> nnx.Module:
  """``model`` padded by ``plan`` (``model`` itself when nothing grows); the same logits on the real vocab."""
  cfg = plan.config(model.cfg)
  return model if cfg == model.cfg else rebuild(model, cfg)

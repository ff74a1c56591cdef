"""The one module that knows mesh axes: mesh, logical names, specs, padding, and shard_map around kernels.

Design: one 1-D mesh axis ``"model"`` over N devices. Tensor parallelism (TP) and decode context
parallelism (DCP) share it, as vLLM's ``-tp N -dcp N``: query heads, KDA heads, routed experts, FFN widths
and the vocabulary are split N ways, and the tokens of the MLA latent cache are dealt round robin
(``k3jax.dcp``). Embeddings, latents and the batch stay whole on every device.

The axis type is ``Auto``. The model modules are written without sharding annotations; with ``Auto`` the
partitioner propagates the parameter shardings through them, while ``Explicit`` would need an
``out_sharding`` on every contraction over a split dim inside model code. Where a layout matters it is
pinned with ``constrain`` and with jit in/out shardings, and every Pallas call goes through
``shard_kernel`` because Pallas calls are never partitioned automatically.

Nothing is silently replicated: a dim named with a split logical name that does not divide by the mesh
size raises ``ValueError``; ``PaddingPlan`` pads such dims exactly (zero heads, never-selected experts,
zero FFN columns, masked vocab rows).
"""

from collections.abc import Callable, Sequence
import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MODEL = "model"
MESH_AXES = (MODEL,)

# Logical dim name -> mesh axis (None: whole on every device). One entry per name.
LOGICAL_RULES: dict[str, str | None] = {
    "heads": MODEL,  # MLA query heads, also fused [H * d] widths
    "kda_heads": MODEL,  # KDA heads: q/k/v/gate widths, conv channels, state pool, A_log, dt_bias
    "experts": MODEL,  # routed experts (and the router's expert dim)
    "ffn": MODEL,  # dense MLP and shared-expert intermediate widths
    "vocab": MODEL,  # embedding rows and LM-head columns
    "kv_tokens": MODEL,  # pages of the DCP latent cache: each device holds its own token shard
    "batch": None,
    "tokens": None,  # packed tokens T / sequence positions
    "embed": None,  # hidden size D
    "latent": None,  # MLA latents (q_lora, kv_lora, Dc + Dr) and the latent-MoE width
    "head_dim": None,
    "expert_ffn": None,  # intermediate width inside one routed expert (experts are split instead)
    "slots": None,  # KDA state-pool slots P
}


def mesh_size(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> int:
  """Devices along the model axis (1 for a mesh without it)."""
  return dict(mesh.shape).get(MODEL, 1)


def make_mesh(n: int | None = None, *, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A 1-D ``("model",)`` mesh with an ``Auto`` axis (see the module docstring for why Auto).

  Args:
    n: devices on the axis; None takes all of ``devices``.
    devices: devices to use; None means ``jax.devices()``. The first ``n`` are taken.

  Raises:
    ValueError: ``n`` is not a positive int or exceeds the available devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices) if n is None else n
  if not isinstance(n, int) or not 1 <= n <= len(devices):
    raise ValueError(f"n must be an int in [1, {len(devices)}] (the available devices), got {n!r}")
  return jax.make_mesh((n,), MESH_AXES, axis_types=(AxisType.Auto,), devices=devices[:n])


def spec(*names: str | None) -> P:
  """The PartitionSpec of an array whose dims carry these logical names (None: a whole dim).

  Raises:
    ValueError: an unknown name, or two names that map to the same mesh axis.
  """
  axes = []
  for name in names:
    if name is not None and name not in LOGICAL_RULES:
      raise ValueError(f"unknown logical axis name {name!r}; known: {sorted(LOGICAL_RULES)}")
    axes.append(None if name is None else LOGICAL_RULES[name])
  split = [a for a in axes if a is not None]
  if len(split) != len(set(split)):
    raise ValueError(f"logical names {names} put more than one dim on the same mesh axis")
  return P(*axes)


def check_divisible(what: str, shape: Sequence[int], names: Sequence[str | None], mesh) -> None:
  """Raises ``ValueError`` unless every split dim of ``shape`` divides by its mesh axis size.

  Args:
    what: the array's name, for the message.
    shape: its shape. names: one logical name (or None) per dim.
    mesh: a Mesh or AbstractMesh.
  """
  if len(shape) != len(names):
    raise ValueError(f"{what}: {len(names)} logical names {tuple(names)} for shape {tuple(shape)}")
  sizes = dict(mesh.shape)
  for dim, (size, axis) in enumerate(zip(shape, spec(*names))):
    if axis is not None and size % sizes.get(axis, 1):
      raise ValueError(f"{what}: dim {dim} ({names[dim]!r}) of shape {tuple(shape)} has size {size}, not a "
                       f"multiple of the {sizes[axis]} devices of mesh axis {axis!r}; pad it with PaddingPlan")


def named_sharding(mesh: jax.sharding.Mesh, *names: str | None,
                   shape: Sequence[int] | None = None) -> NamedSharding:
  """``NamedSharding(mesh, spec(*names))``, checked against ``shape`` when given."""
  if shape is not None:
    check_divisible("array", shape, names, mesh)
  return NamedSharding(mesh, spec(*names))


def tree_shardings(mesh: jax.sharding.Mesh, specs):
  """A pytree of PartitionSpecs (e.g. from ``spec``) to the matching pytree of NamedShardings."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def param(init: Callable, *names: str | None) -> Callable:
  """An nnx initializer that carries the mesh-axis sharding of ``names`` (``nnx.with_partitioning``).

  Mesh axis names, not logical ones, go into the metadata, so nothing depends on Flax's logical-rule
  machinery or on its metadata key names.
  """
  return nnx.with_partitioning(init, tuple(spec(*names)))


def constrain(x: jax.Array, *names: str | None, mesh=None) -> jax.Array:
  """Pins the layout of an intermediate to ``names``; a no-op without a mesh, so model code calls it always.

  Args:
    x: any array. names: one logical name (or None) per dim of ``x``.
    mesh: the mesh; None means the one set by ``jax.set_mesh`` (none set: return ``x`` unchanged).

  Raises:
    ValueError: a split dim of ``x`` does not divide by the mesh size.
  """
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    spec(*names)
    return x
  check_divisible("constrain(x)", x.shape, names, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(*names)))


def shard_kernel(fn: Callable, in_names: Sequence[Sequence[str | None] | None],
                 out_names, mesh: jax.sharding.Mesh) -> Callable:
  """``jax.shard_map`` of ``fn`` (e.g. a Pallas call), with specs from logical names.

  Args:
    fn: called per device on the local blocks, positional arguments only.
    in_names: per positional argument, a tuple of logical names (one per dim) or None (whole everywhere).
    out_names: the same for the outputs: one tuple, or a tuple/list of them matching ``fn``'s outputs.
    mesh: the mesh.

  Returns:
    The wrapped function; it raises ``ValueError`` when an input's split dim does not divide by the mesh.
  """
  to_spec = lambda names: P() if names is None else spec(*names)
  in_specs = tuple(to_spec(n) for n in in_names)
  single_out = out_names is None or all(n is None or isinstance(n, str) for n in out_names)
  out_specs = to_spec(out_names) if single_out else tuple(to_spec(n) for n in out_names)
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

  def wrapped(*args):
    if len(args) != len(in_names):
      raise ValueError(f"shard_kernel({getattr(fn, '__name__', fn)}): {len(args)} arguments for "
                       f"{len(in_names)} in_names")
    for i, (x, names) in enumerate(zip(args, in_names)):
      if names is not None:
        check_divisible(f"argument {i}", x.shape, names, mesh)
    return mapped(*args)

  return wrapped


def pad_to_multiple(n: int, m: int) -> int:
  """The smallest multiple of ``m`` that is ``>= n`` (``n >= 0``, ``m >= 1``)."""
  if not isinstance(n, int) or not isinstance(m, int) or n < 0 or m < 1:
    raise ValueError(f"pad_to_multiple needs ints n >= 0 and m >= 1, got n={n!r}, m={m!r}")
  return -(-n // m) * m


def pad_units(x: jax.Array, axis: int, units: int, new_units: int, fill: float = 0.0) -> jax.Array:
  """Appends ``new_units - units`` blocks filled with ``fill`` to an axis made of ``units`` equal blocks.

  A fused head axis ``[H * d]`` (head-major) has ``units = H`` blocks of ``d``; a plain axis has blocks of 1.

  Raises:
    ValueError: the axis size is not a multiple of ``units``, or ``new_units < units``.
  """
  size = x.shape[axis]
  if units < 1 or size % units:
    raise ValueError(f"pad_units: axis {axis} of shape {tuple(x.shape)} is not made of {units} equal blocks")
  if new_units < units:
    raise ValueError(f"pad_units: new_units must be >= units = {units}, got {new_units}")
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, (new_units - units) * (size // units))
  return jnp.pad(x, widths, constant_values=jnp.asarray(fill, x.dtype))


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
  """Real and padded sizes of the dims split over the model axis, for a given number of devices.

  Padding is exact when the padded units are built as follows (``k3jax`` model loaders do this):
  heads and KDA heads get zero projection columns and zero output-projection rows; experts get zero
  weights, a zero router row and a ``-inf`` ``e_score_correction_bias`` (never selected while
  ``top_k <= real experts``); FFN widths get zero up/gate columns and zero down rows; vocabulary rows are
  zero in the embedding and their logits are masked to ``-inf``.

  Attributes:
    tp: devices on the model axis.
    dims: ``(name, real, padded)`` per padded logical name.
  """

  tp: int
  dims: tuple[tuple[str, int, int], ...]

  @classmethod
  def make(cls, tp: int, **real: int) -> "PaddingPlan":
    """A plan padding each named dim (``heads=96, experts=896, ...``) to a multiple of ``tp``.

    Raises:
      ValueError: ``tp`` < 1, a size < 1, an unknown name, or a name that is not split (nothing to pad).
    """
    if not isinstance(tp, int) or tp < 1:
      raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    dims = []
    for name, size in real.items():
      spec(name)
      if LOGICAL_RULES[name] is None:
        raise ValueError(f"{name!r} is not split over the mesh, so it is never padded")
      if not isinstance(size, int) or size < 1:
        raise ValueError(f"{name} must be an int >= 1, got {size!r}")
      dims.append((name, size, pad_to_multiple(size, tp)))
    return cls(tp=tp, dims=tuple(dims))

  def _entry(self, name: str) -> tuple[str, int, int]:
    for entry in self.dims:
      if entry[0] == name:
        return entry
    raise ValueError(f"the padding plan has no dim {name!r}; it has {[d[0] for d in self.dims]}")

  def real(self, name: str) -> int:
    return self._entry(name)[1]

  def padded(self, name: str) -> int:
    return self._entry(name)[2]

  @property
  def applied(self) -> dict[str, tuple[int, int]]:
    """``{name: (real, padded)}`` for the dims that actually grow."""
    return {n: (r, p) for n, r, p in self.dims if p != r}

  def pad(self, x: jax.Array, name: str, axis: int, fill: float = 0.0) -> jax.Array:
    """Pads ``axis`` of ``x`` (``real(name)`` equal blocks) to ``padded(name)`` blocks of ``fill``."""
    return pad_units(x, axis, self.real(name), self.padded(name), fill)

  def unpad(self, x: jax.Array, name: str, axis: int) -> jax.Array:
    """Drops the padded blocks of ``axis`` (``padded(name)`` equal blocks) again."""
    padded, size = self.padded(name), x.shape[axis]
    if size % padded:
      raise ValueError(f"unpad: axis {axis} of shape {tuple(x.shape)} is not made of {padded} equal blocks")
    return jax.lax.slice_in_dim(x, 0, self.real(name) * (size // padded), axis=axis)


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = \(?([a-z0-9]+)\[([0-9,]*)\][^\n]*? "
                         r"(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-start)?\(",
                         re.MULTILINE)


def collectives(hlo_text: str) -> list[tuple[str, str, tuple[int, ...]]]:
  """``(op, dtype, per-device result shape)`` of every collective in compiled HLO text (first tuple element).

  For inspecting what a sharded step communicates (tests and the demo), e.g.
  ``collectives(jax.jit(f).lower(*args).compile().as_text())``.
  """
  return [(op, dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims, op in _COLLECTIVE.findall(hlo_text)]

"""The one module that knows mesh axes: the mesh, logical names -> mesh axes, parameter and cache specs.

``shard_model`` pads a model (``k3jax.padding``) and places it; ``k3jax.steps`` builds the sharded cache and
the jitted step on the mesh (its module docstring shows the whole sequence).

Design: one 1-D mesh axis ``"model"`` over N devices. Tensor parallelism (TP) and decode context
parallelism (DCP) share it, as vLLM's ``-tp N -dcp N``:

- MLA: ``q_b_proj`` / ``kv_b_proj`` / ``g_proj`` split by heads (column parallel), ``o_proj`` by heads (row
  parallel, one all-reduce); the latent projections stay whole. The latent cache is split along tokens
  (``k3jax.dcp``): queries are all-gathered over heads and the ``(o, lse)`` partials come back in one
  all-to-all in ``partial_dtype``.
- KDA: every per-head tensor (projections, conv taps, ``A_log``, ``dt_bias``, the state pool and the conv
  pool) is split by heads; the ops run per device (``kda_prefill`` ... drop-ins), states never move.
- MoE: expert parallel. Router and experts are split by experts (``k3jax.layers.moe.routed_experts``: each
  device runs its experts, one psum of ``[T, De]``); shared experts and the dense MLP are split by FFN
  width.
- Vocabulary split in the embedding and the LM head; the logits are replicated at the end.

The axis type is ``Auto``. The model modules carry logical names but no shardings; with ``Auto`` the
partitioner propagates the parameter shardings through them, while ``Explicit`` would need an
``out_sharding`` on every contraction over a split dim inside model code. Where a layout matters it is
pinned with ``constrain`` and with jit in/out shardings, and every kernel call goes through
``shard_kernel`` (``jax.shard_map``) because Pallas calls are never partitioned automatically.

Nothing is silently replicated: a dim named with a split logical name that does not divide by the mesh
size raises ``ValueError``; ``PaddingPlan`` pads the model exactly (zero heads, never-selected experts,
zero FFN columns, dropped vocab rows; ``k3jax.padding``).
"""

from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k3jax import padding
from k3jax.cache import KdaState, ModelCache
from k3jax.config import KDA

MODEL = "model"
MESH_AXES = (MODEL,)

# Logical dim name -> mesh axis (None: whole on every device). One entry per name; the parameter names are
# those of ``k3jax.nn_util.LOGICAL_AXES``, the rest name activation and cache dims.
LOGICAL_RULES: dict[str, str | None] = {
    "heads": MODEL,  # MLA query heads
    "kda_heads": MODEL,  # KDA heads; also the head-major fused [H * K] conv channels
    "experts": MODEL,  # routed experts and the router's expert dim
    "mlp": MODEL,  # dense MLP and shared-expert widths
    "vocab": MODEL,  # embedding rows and LM-head columns
    "kv_tokens": MODEL,  # pages of the DCP latent cache: each device holds its own share of the tokens
    "embed": None, "moe_embed": None, "moe_mlp": None, "kda_head_dim": None, "kda_gate_rank": None,
    "conv_width": None, "qk_head_dim": None, "qk_nope_dim": None, "v_head_dim": None, "q_lora": None,
    "kv_lora": None, "kv_latent": None,
    "batch": None, "tokens": None, "slots": None,  # sequences, packed tokens, KDA pool slots
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


def _logical_axes(path, var) -> tuple[str | None, ...]:
  names = var.get_metadata().get("logical_axes")
  if names is None:
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no logical_axes metadata (create it with "
                     f"k3jax.nn_util.param)")
  return names


def param_specs(model: nnx.Module) -> nnx.State:
  """``nnx.state(model)`` with each parameter replaced by the PartitionSpec of its logical axes."""
  return nnx.map_state(lambda path, var: spec(*_logical_axes(path, var)), nnx.state(model))


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> tuple[nnx.Module, padding.PaddingPlan]:
  """Pads ``model`` for the mesh and places every parameter on its sharding.

  On a mesh spanning several processes (``jax.distributed``) every process passes the same model (same seed
  or checkpoint, e.g. ``load_hf`` without a mesh); each places only its own devices' blocks of it.

  Returns:
    The padded, placed model (``model`` itself when nothing needs padding) and its ``PaddingPlan``.

  Raises:
    ValueError: a parameter's split dim still does not divide by the mesh size (it is named).
  """
  plan = padding.PaddingPlan.for_config(model.cfg, mesh_size(mesh))
  model = padding.pad_model(model, plan)
  state = nnx.state(model)
  for path, var in nnx.to_flat_state(state):
    check_divisible(".".join(map(str, path)), var.shape, _logical_axes(path, var), mesh)
  shardings = tree_shardings(mesh, param_specs(model))
  if not mesh.is_multi_process:
    nnx.update(model, jax.device_put(state, shardings))
    return model, plan
  targets = dict(nnx.to_flat_state(shardings))
  for path, var in nnx.to_flat_state(state):
    var.set_value(_place_across_processes(var.get_value(), targets[path]))
  return model, plan


def check_load_mesh(mesh: jax.sharding.Mesh | None) -> None:
  """A loader's ``mesh`` argument: None or a mesh with the ``"model"`` axis (``make_mesh``)."""
  if mesh is not None and MODEL not in mesh.axis_names:
    raise ValueError(f"mesh must have the {MODEL!r} axis (k3jax.sharding.make_mesh), got axes {mesh.axis_names}")


def param_target(name: str, shape: tuple[int, ...], names: Sequence[str | None],
                 mesh: jax.sharding.Mesh | None) -> jax.sharding.Sharding:
  """Where a loader places parameter ``name`` (``shape``, logical axes ``names``): whole on this process's first
  device without a mesh (not ``jax.devices()[0]``, which is process 0's), else split by its logical axes (a
  split dim that does not divide raises, as in ``shard_model``)."""
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  check_divisible(name, shape, names, mesh)
  return NamedSharding(mesh, spec(*names))


def _place_across_processes(x, target: NamedSharding) -> jax.Array:
  """``x`` (the same whole array in every process) on ``target``, a sharding over several processes' devices.

  ``jax.device_put`` refuses a committed array here (one that ``load_hf`` placed, say): it would be a transfer
  between hosts. Every process already holds the whole value, so each builds its own devices' blocks from it.
  """
  if not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return jax.device_put(x, target)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, target, lambda index: host[index], dtype=host.dtype)


# Layouts of the cache arrays (``k3jax.cache``); the MLA latent cache is the DCP layout of ``k3jax.dcp``.
MLA_CACHE_NAMES = ("kv_tokens", None, "kv_latent")
KDA_POOL_NAMES = ("slots", "kda_heads", None, None)  # [P, H, V, K]
CONV_POOL_NAMES = ("slots", None, "kda_heads")  # [P, W - 1, H * K]


def cache_specs(cfg) -> ModelCache:
  """The ``ModelCache`` of PartitionSpecs for ``cfg``: KDA pools split by heads, MLA caches by pages."""
  conv = spec(*CONV_POOL_NAMES)
  kda = tuple(KdaState(recurrent=spec(*KDA_POOL_NAMES), conv_q=conv, conv_k=conv, conv_v=conv)
              for t in cfg.layer_types if t == KDA)
  mla = tuple(spec(*MLA_CACHE_NAMES) for t in cfg.layer_types if t != KDA)
  return ModelCache(kda=kda, mla=mla, state_indices=P(), block_table=P(), seq_lens=P())


def ambient_mesh() -> jax.sharding.AbstractMesh | None:
  """The mesh set with ``jax.set_mesh`` when its model axis has more than one device, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or mesh_size(mesh) == 1 else mesh

"""Converted models as Orbax checkpoints: ``save_converted`` and ``load_converted`` (``python -m k3jax convert``).

A converted model is one Orbax checkpoint directory (``orbax.checkpoint.CompositeCheckpointHandler``) with two
items, written atomically (Orbax writes a temporary directory and renames it when every item is committed):

* ``params``: every parameter of ``nnx.state(model)`` in its storage dtype, in a flat dict keyed by its dotted
  NNX path (``layers.3.self_attn.q_proj.kernel``), as an Orbax PyTree (TensorStore arrays).
* ``k3jax``: JSON ``{"format": "k3jax.converted", "format_version": FORMAT_VERSION, "config": {...}}``; the
  config holds every ``K3Config`` field (dtypes by name) except ``impl``, the kernel backend, which belongs
  to the machine that loads the model (``K3Config``'s default picks it there).

Layout: always the *unpadded* model, so one checkpoint restores onto any mesh size. ``load_converted`` builds
the abstract model of the ``PaddingPlan`` for the mesh (as ``k3jax.checkpoint.load_hf`` does) and restores
each array directly with its target sharding: Orbax reads only the blocks each device of this process holds.
A padded dim is restored with ``strict=False``, where Orbax fills the tail with zeros, which is
``k3jax.padding``'s fill for every parameter except ``e_score_correction_bias`` (filled with ``-inf``
afterwards, on the device, by ``padding.pad_param``). ``save_converted`` accepts a padded model too (one
placed by ``shard_model`` or ``load_hf(..., mesh)``) and drops the padding before writing.

Multi-process: both functions are collective (every process calls them with the same arguments).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from k3jax import padding
from k3jax import sharding as sharding_lib
from k3jax.config import RUNTIME_FIELDS, K3Config
from k3jax.model import KimiK3Model

FORMAT = "k3jax.converted"
FORMAT_VERSION = 1
PARAMS_ITEM = "params"
META_ITEM = "k3jax"
# Saved by name; ``impl`` is not saved (see the module docstring).
_DTYPE_FIELDS = tuple(f for f in RUNTIME_FIELDS if f != "impl")


# ------------------------------------------------------------------------------------------------ config
def config_to_json(cfg: K3Config) -> dict:
  """Every field of ``cfg`` except ``impl`` as JSON values (dtypes by name, ``layer_types`` as a list)."""
  out = {}
  for field in dataclasses.fields(cfg):
    value = getattr(cfg, field.name)
    if field.name == "impl":
      continue
    if field.name in _DTYPE_FIELDS:
      value = jnp.dtype(value).name
    elif isinstance(value, tuple):
      value = list(value)
    out[field.name] = value
  return out


def config_from_json(d: dict, where: str, **runtime) -> K3Config:
  """Inverse of ``config_to_json``; ``runtime`` (``RUNTIME_FIELDS``) replaces the saved dtypes / sets ``impl``.

  Raises:
    ValueError: ``d`` is not a dict of ``K3Config`` fields (``where`` names the file), or a bad ``runtime`` key.
  """
  bad = sorted(set(runtime) - set(RUNTIME_FIELDS))
  if bad:
    raise ValueError(f"runtime overrides must be in {sorted(RUNTIME_FIELDS)}, got {bad}")
  if not isinstance(d, dict):
    raise ValueError(f"{where}: config must be a JSON object, got {type(d).__name__}")
  known = {f.name for f in dataclasses.fields(K3Config)} - {"impl"}
  unknown = sorted(set(d) - known)
  if unknown:
    raise ValueError(f"{where}: config has unknown fields {unknown}")
  fields = {**d, **runtime}
  if "layer_types" in fields:
    fields["layer_types"] = tuple(fields["layer_types"])
  try:
    return K3Config(**fields)
  except TypeError as e:  # a missing required field
    raise ValueError(f"{where}: config is not a K3Config: {e}") from e


# ------------------------------------------------------------------------------------------------ helpers
def _abstract_state(cfg: K3Config) -> tuple[nnx.GraphDef, nnx.State]:
  return nnx.split(nnx.eval_shape(lambda: KimiK3Model(cfg, rngs=nnx.Rngs(0))))


def _name(path) -> str:
  return ".".join(map(str, path))


def _checkpointer() -> ocp.Checkpointer:
  # Handlers named up front: ``metadata`` and a partial ``restore`` need them before anything is restored.
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{PARAMS_ITEM: ocp.PyTreeCheckpointHandler(),
                                                            META_ITEM: ocp.JsonCheckpointHandler()}))


def _architecture(cfg: K3Config) -> dict:
  """The fields that padding does not change and that are not runtime choices."""
  skip = set(padding.PADDED_FIELDS) | set(RUNTIME_FIELDS)
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


# ------------------------------------------------------------------------------------------------ save
def save_converted(cfg: K3Config, model: KimiK3Model, path: str | os.PathLike) -> None:
  """Writes ``model``'s parameters and ``cfg`` as an Orbax checkpoint directory at ``path``.

  Args:
    cfg: the unpadded config (``load_hf``'s first result).
    model: ``KimiK3Model(cfg)``, or its padded form on a mesh (``model.cfg`` the padded config): padded
      parameters are sliced back to ``cfg``'s shapes (the tail is padding, zero or ``-inf``, by construction).
      Arrays may live on any devices and shardings.
    path: the checkpoint directory; it must not exist or be empty.

  Raises:
    ValueError: ``path`` is a non-empty directory or a file, or ``model`` is not a model of ``cfg`` (a
      parameter of another shape or dtype, or another architecture; named).
  """
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    raise ValueError(f"{path}: the output of save_converted must not exist or be an empty directory")
  if not isinstance(cfg, K3Config) or not isinstance(model, KimiK3Model):
    raise ValueError(f"save_converted needs a K3Config and a KimiK3Model, got {type(cfg).__name__} and "
                     f"{type(model).__name__}")
  mine, theirs = _architecture(cfg), _architecture(model.cfg)
  if mine != theirs:
    diff = {k: (v, theirs[k]) for k, v in mine.items() if theirs[k] != v}
    raise ValueError(f"model is not a model of cfg: {{field: (cfg, model.cfg)}} {diff}")
  real = dict(nnx.to_flat_state(_abstract_state(cfg)[1]))
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  if set(flat) != set(real):
    raise ValueError(f"model parameters {sorted(map(_name, set(flat) ^ set(real)))[:5]} do not match cfg's model")
  params = {}
  for p, var in flat.items():
    x, want = var.get_value(), real[p]
    if x.ndim != len(want.shape) or any(s < w for s, w in zip(x.shape, want.shape)) or x.dtype != want.dtype:
      raise ValueError(f"{_name(p)} must be {np.dtype(want.dtype).name}{tuple(want.shape)} (or padded), got "
                       f"{np.dtype(x.dtype).name}{tuple(x.shape)}")
    if tuple(x.shape) != tuple(want.shape):  # drop the padding: the saved layout is mesh-independent
      x = x[tuple(slice(0, w) for w in want.shape)]
    params[_name(p)] = x
  meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": config_to_json(cfg)}
  # force=True only replaces an empty directory (checked above); Orbax then creates it atomically.
  _checkpointer().save(path, ocp.args.Composite(**{PARAMS_ITEM: ocp.args.PyTreeSave(params),
                                                  META_ITEM: ocp.args.JsonSave(meta)}), force=True)


# ------------------------------------------------------------------------------------------------ load
def read_metadata(path: str | os.PathLike) -> dict:
  """The ``k3jax`` JSON item of a converted checkpoint, with its format and version checked.

  Raises:
    ValueError: ``path`` is missing or not a k3jax converted checkpoint, or its ``format_version`` is not
      ``FORMAT_VERSION`` (the found and expected versions named).
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise ValueError(f"{path}: no such directory (a k3jax converted checkpoint, written by 'convert')")
  if not os.path.isdir(os.path.join(path, META_ITEM)) or not os.path.isdir(os.path.join(path, PARAMS_ITEM)):
    raise ValueError(f"{path} is not a k3jax converted checkpoint (no {META_ITEM!r} and {PARAMS_ITEM!r} Orbax "
                     f"items; write one with 'python -m k3jax convert')")
  try:
    meta = _checkpointer().restore(path, ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: cannot read the {META_ITEM!r} item of the converted checkpoint: {e}") from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{path} is not a k3jax converted checkpoint (its {META_ITEM!r} item has no "
                     f"format {FORMAT!r})")
  if meta.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"{path}: converted checkpoint format_version {meta.get('format_version')!r}, this k3jax "
                     f"reads format_version {FORMAT_VERSION}; convert the HF checkpoint again")
  return meta


def load_converted(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None,
                   **runtime) -> tuple[K3Config, KimiK3Model]:
  """Restores what ``save_converted`` wrote, each array directly on its target sharding.

  Args:
    path: the checkpoint directory.
    mesh: None puts every parameter whole on this process's first device. A mesh with the ``"model"`` axis pads the
      model with ``PaddingPlan.for_config(cfg, mesh size)`` and restores each parameter with the sharding of
      its logical axes (as ``k3jax.sharding.shard_model`` would place it); each device's block is read from
      the checkpoint, never the whole array.
    **runtime: ``RUNTIME_FIELDS`` overrides (``impl``; a storage ``param_dtype`` other than the saved one casts
      on restore).

  Returns:
    ``(cfg, model)``: the unpadded config and the model (``model.cfg`` is the padded config on a mesh that
    needs padding; run it with ``k3jax.steps.jit_model_step(model, mesh, vocab_size=cfg.vocab_size)``).

  Raises:
    ValueError: a missing path or one that is not a k3jax converted checkpoint, another ``format_version``, a
      config that is not a ``K3Config``, a stored array missing, unexpected or of the wrong shape or dtype
      (named), or a mesh without the ``"model"`` axis.
  """
  path = os.path.abspath(os.fspath(path))
  meta = read_metadata(path)
  where = os.path.join(path, META_ITEM)
  saved_cfg = config_from_json(meta.get("config"), where)
  cfg = config_from_json(meta.get("config"), where, **runtime)
  sharding_lib.check_load_mesh(mesh)

  ckpt = _checkpointer()
  stored = ckpt.metadata(path).item_metadata[PARAMS_ITEM].tree
  expected = {_name(p): var for p, var in nnx.to_flat_state(_abstract_state(saved_cfg)[1])}
  missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
  if missing or extra:
    raise ValueError(f"{path}: parameters missing {missing[:5]}, unexpected {extra[:5]} for its config")
  for name, var in expected.items():
    got = stored[name]
    if tuple(got.shape) != tuple(var.shape) or np.dtype(got.dtype) != np.dtype(var.dtype):
      raise ValueError(f"{path}: {name} must be {np.dtype(var.dtype).name}{tuple(var.shape)}, got "
                       f"{np.dtype(got.dtype).name}{tuple(got.shape)}")

  plan = padding.PaddingPlan.for_config(cfg, 1 if mesh is None else sharding_lib.mesh_size(mesh))
  graphdef, state = _abstract_state(plan.config(cfg))
  flat = list(nnx.to_flat_state(state))
  targets, args = {}, {}
  for p, var in flat:
    name, shape = _name(p), tuple(var.shape)
    target = sharding_lib.param_target(name, shape, var.get_metadata()["logical_axes"], mesh)
    targets[name] = jax.ShapeDtypeStruct(shape, var.dtype, sharding=target)
    # strict=False lets Orbax zero-fill the padded tail; the stored shapes were checked above.
    args[name] = ocp.ArrayRestoreArgs(sharding=target, global_shape=shape, dtype=var.dtype,
                                      strict=shape == tuple(expected[name].shape))
  restored = ckpt.restore(path, ocp.args.Composite(**{PARAMS_ITEM: ocp.args.PyTreeRestore(
      item=targets, restore_args=args)}))[PARAMS_ITEM]
  for p, var in flat:
    name = _name(p)
    x = restored[name]
    real = tuple(expected[name].shape)
    if x.shape != real and _pad_fill(str(p[-1])) != 0:  # Orbax filled zeros; this parameter pads otherwise
      x = _refill(str(p[-1]), real, x.sharding)(x)
    var.set_value(x)
  return cfg, nnx.merge(graphdef, state)


def _pad_fill(name: str) -> float:
  """The value ``padding.pad_param`` pads parameter ``name`` with (asked of it, so the two cannot diverge)."""
  return float(padding.pad_param(name, np.zeros((1,), np.float32), (2,))[1])


def _refill(name: str, real: tuple[int, ...], target: jax.sharding.Sharding):
  """A jitted ``x -> pad_param(name, x[:real], x.shape)`` that keeps ``x``'s sharding (runs where ``x`` lives)."""
  return jax.jit(lambda x: padding.pad_param(name, x[tuple(slice(0, r) for r in real)], x.shape),
                 out_shardings=target)


__all__ = ["FORMAT", "FORMAT_VERSION", "config_from_json", "config_to_json", "load_converted", "read_metadata",
           "save_converted"]

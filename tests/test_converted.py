"""Converted models as Orbax checkpoints (``k3jax.converted``): round trips on one device and onto meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from support import device_mesh, fast_jit

import k3jax
from k3jax import converted, sharding
from pallas_kernels import util


def flat(model) -> dict:
  """Dotted parameter path -> jax.Array."""
  return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def assert_same_params(got, want):
  got, want = flat(got), flat(want)
  assert sorted(got) == sorted(want)
  for name, w in want.items():
    g = got[name]
    assert g.dtype == w.dtype and g.shape == w.shape, name
    # Bitwise: compare the raw bytes (bf16 included; -inf padding compares equal too).
    assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A random tiny model (bf16 storage, f32 router / A_log / dt_bias) and its checkpoint directory."""
  cfg = k3jax.preset("tiny", impl="xla")
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(3))
  path = tmp_path_factory.mktemp("conv") / "ckpt"
  converted.save_converted(cfg, model, path)
  return cfg, model, path


def test_round_trip_one_device(saved):
  cfg, model, path = saved
  # impl is not saved: a load takes this machine's default backend, or the one asked for.
  assert converted.load_converted(path)[0] == cfg.replace(impl=util.default_impl())
  cfg2, model2 = converted.load_converted(path, impl="xla")  # tiny's widths are below the Pallas kernels'
  assert cfg2 == cfg and model2.cfg == cfg
  assert_same_params(model2, model)
  assert all(x.sharding == SingleDeviceSharding(jax.devices()[0]) for x in flat(model2).values())
  # The step k3jax.prefill jits, compiled once at -O0 (fast_jit) for both models: same graph, same executable.
  graph = nnx.graphdef(model)
  run = fast_jit(lambda st, tok, cu, cache: nnx.merge(graph, st).prefill(tok, cu, cache))
  tokens, cu = jnp.asarray([5, 9, 2, 7], jnp.int32), jnp.asarray([0, 4], jnp.int32)
  want, _ = run(nnx.state(model), tokens, cu, k3jax.init_cache(cfg, 1, 8))
  got, _ = run(nnx.state(model2), tokens, cu, k3jax.init_cache(cfg, 1, 8))
  assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("n", [2, 9])  # 2: no padding; 9: every split dim of tiny is padded
def test_round_trip_onto_a_mesh(saved, n, tmp_path):
  cfg, model, path = saved
  mesh = device_mesh(n)
  cfg2, model2 = converted.load_converted(path, mesh, impl="xla")
  ref, plan = sharding.shard_model(model, mesh)
  assert bool(plan.applied) == (n == 9) and cfg2 == cfg and model2.cfg == ref.cfg
  assert_same_params(model2, ref)
  expected = {".".join(map(str, p)): s for p, s in nnx.to_flat_state(
      sharding.tree_shardings(mesh, sharding.param_specs(ref)))}
  got = {name: x.sharding for name, x in flat(model2).items()}
  assert got == expected and any(s.spec != jax.sharding.PartitionSpec() for s in got.values())

  # A padded (sharded) model saves unpadded: restoring it on one device gives the original parameters.
  converted.save_converted(cfg2, model2, tmp_path / "again")
  assert_same_params(converted.load_converted(tmp_path / "again")[1], model)


def test_runtime_overrides(saved):
  cfg, model, path = saved
  cfg2, model2 = converted.load_converted(path, param_dtype=jnp.float32, state_dtype=jnp.bfloat16, impl="xla")
  assert cfg2 == cfg.replace(param_dtype=jnp.float32, state_dtype=jnp.bfloat16)
  for name, x in flat(model2).items():
    assert x.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x), np.asarray(flat(model)[name], np.float32), err_msg=name)
  with pytest.raises(ValueError, match="runtime overrides must be in"):
    converted.load_converted(path, vocab_size=3)


def _write(path, params, meta):
  """A checkpoint with the converted layout but arbitrary contents."""
  converted._checkpointer().save(path, ocp.args.Composite(**{
      converted.PARAMS_ITEM: ocp.args.PyTreeSave(params), converted.META_ITEM: ocp.args.JsonSave(meta)}))


def test_version_and_format_are_checked(saved, tmp_path):
  cfg, model, path = saved
  meta = converted.read_metadata(path)
  assert meta["format_version"] == converted.FORMAT_VERSION
  params = {"embed_tokens": np.zeros((2,), np.float32)}  # never read: the metadata is checked first
  _write(tmp_path / "v0", params, {**meta, "format_version": 0})
  with pytest.raises(ValueError, match=f"v0: converted checkpoint format_version 0, this k3jax reads "
                                       f"format_version {converted.FORMAT_VERSION}"):
    converted.load_converted(tmp_path / "v0")
  _write(tmp_path / "nov", params, {k: v for k, v in meta.items() if k != "format_version"})
  with pytest.raises(ValueError, match="nov: converted checkpoint format_version None"):
    converted.load_converted(tmp_path / "nov")
  _write(tmp_path / "other", params, {"format": "something else"})
  with pytest.raises(ValueError, match="other is not a k3jax converted checkpoint"):
    converted.load_converted(tmp_path / "other")
  with pytest.raises(ValueError, match="missing: no such directory"):
    converted.load_converted(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="empty is not a k3jax converted checkpoint"):
    converted.load_converted(tmp_path / "empty")
  _write(tmp_path / "badcfg", params, {**meta, "config": {**meta["config"], "colour": 1}})
  with pytest.raises(ValueError, match="config has unknown fields \\['colour'\\]"):
    converted.load_converted(tmp_path / "badcfg")


def test_stored_arrays_are_checked(saved, tmp_path):
  cfg, model, path = saved
  meta = converted.read_metadata(path)
  params = {k: np.asarray(v) for k, v in flat(model).items()}
  name = "layers.0.self_attn.q_proj.kernel"
  _write(tmp_path / "shape", {**params, name: params[name][..., :1]}, meta)
  with pytest.raises(ValueError, match=f"{name} must be bfloat16\\(64, 4, 16\\), got bfloat16\\(64, 4, 1\\)"):
    converted.load_converted(tmp_path / "shape")
  _write(tmp_path / "missing", {k: v for k, v in params.items() if k != name}, meta)
  with pytest.raises(ValueError, match=f"parameters missing \\['{name}'\\], unexpected \\[\\]"):
    converted.load_converted(tmp_path / "missing")
  _write(tmp_path / "extra", {**params, "extra": params[name]}, meta)
  with pytest.raises(ValueError, match="unexpected \\['extra'\\]"):
    converted.load_converted(tmp_path / "extra")


def test_save_rejects_bad_arguments(saved, tmp_path):
  cfg, model, path = saved
  with pytest.raises(ValueError, match="must not exist or be an empty directory"):
    converted.save_converted(cfg, model, path)
  with pytest.raises(ValueError, match="model is not a model of cfg"):
    converted.save_converted(cfg.replace(hidden_size=32), model, tmp_path / "x")
  with pytest.raises(ValueError, match="mesh must have the 'model' axis"):
    converted.load_converted(path, jax.make_mesh((1,), ("data",)))

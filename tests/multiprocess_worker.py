"""One process of ``test_multiprocess.py``: 3 of these, 3 CPU devices each, form the 9-device mesh.

Run as ``python multiprocess_worker.py PROCESS_ID PORT HF_PATH OUT_DIR``: joins ``jax.distributed`` on
``localhost:PORT`` (3 processes, gloo CPU collectives), loads the tiny HF checkpoint with ``load_hf(mesh=...)``,
checks that this process holds and read only its own shards, runs the sharded prefill + decodes, saves the
model with ``save_converted`` (collective), restores it with ``load_converted`` onto the mesh and runs the
steps again. Writes ``OUT_DIR/logits_{PROCESS_ID}.npz`` (this process's copy of the replicated logits).

The test process imports ``CONFIG`` and ``run_steps`` to compute the single-process 9-device reference.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import checkpoint, converted, sharding, steps
from k3jax.config import preset

NUM_PROCESSES = 3
LOCAL_DEVICES = 3
FAST = {"xla_backend_optimization_level": 0}
# MLA + dense MLP, then KDA + latent MoE; 4 heads, 8 experts, vocab 256: all padded for 9 devices.
CONFIG = preset("tiny", impl="xla", dtype=jnp.float32, param_dtype=jnp.float32, num_hidden_layers=2,
                layer_types=("mla", "kda"), partial_dtype=jnp.float32, state_dtype=jnp.float32)
LENS = (5, 1, 3)
NUM_DECODES = 2


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The fixed prompt: packed tokens ``[T]``, ``cu_seqlens [N + 1]``, decode tokens ``[NUM_DECODES, N]``."""
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, CONFIG.vocab_size, sum(LENS)).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
  decodes = rng.integers(0, CONFIG.vocab_size, (NUM_DECODES, len(LENS))).astype(np.int32)
  return tokens, cu, decodes


def make_step(model, mesh) -> steps.ModelStep:
  return steps.jit_model_step(model, mesh, vocab_size=CONFIG.vocab_size, compiler_options=FAST)


def run_steps(step: steps.ModelStep, padded_cfg, *, global_inputs: bool = False) -> dict[str, np.ndarray]:
  """Sharded prefill then ``NUM_DECODES`` decodes; this process's copy of each step's (replicated) logits.

  ``global_inputs``: pass the inputs as global replicated arrays (``make_array_from_process_local_data``)
  instead of host-local ``jnp`` arrays; both must work.
  """
  mesh = step.mesh
  tokens, cu, decodes = inputs()
  whole = NamedSharding(mesh, P())
  put = (lambda x: jax.make_array_from_process_local_data(whole, x)) if global_inputs else jnp.asarray
  cache = steps.init_mesh_cache(padded_cfg, len(LENS), 64, mesh)
  logits, cache = step.prefill(put(tokens), put(cu), cache)
  out = [logits]
  for t in decodes:
    logits, cache = step.decode(put(t), cache)
    out.append(logits)
  for x in out:
    assert x.is_fully_replicated and len(x.addressable_shards) == len(mesh.local_devices)
  return {f"step{i}": np.asarray(x) for i, x in enumerate(out)}  # replicated: readable in every process


def _check_local_shards(model, mesh) -> None:
  """Every parameter holds exactly this process's devices' blocks, and the expert stacks are split."""
  local = set(mesh.local_devices)
  assert len(local) == LOCAL_DEVICES
  for path, var in nnx.to_flat_state(nnx.state(model)):
    x = var.get_value()
    name = ".".join(map(str, path))
    assert not x.is_fully_addressable, name
    assert {s.device for s in x.addressable_shards} == local, name
    if name.endswith("experts.w1"):
      assert {s.data.shape[0] for s in x.addressable_shards} == {1}, name


def _local_experts(model) -> set[int]:
  """Routed experts (real, not padding) whose blocks live on this process's devices."""
  w1 = model.layers[1].block_sparse_moe.experts.w1.get_value()
  out = set()
  for s in w1.addressable_shards:
    out.update(range(*s.index[0].indices(w1.shape[0])))
  return {e for e in out if e < CONFIG.num_experts}


def main(argv: list[str]) -> None:
  pid, port, hf_path, out_dir = int(argv[0]), int(argv[1]), argv[2], argv[3]
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=NUM_PROCESSES, process_id=pid,
                             initialization_timeout=120)
  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (NUM_PROCESSES, 9, LOCAL_DEVICES)
  mesh = sharding.make_mesh(9)

  reads = []
  original = checkpoint._Checkpoint.read

  def spy(self, name):
    reads.append(name)
    return original(self, name)

  checkpoint._Checkpoint.read = spy
  cfg, model = checkpoint.load_hf(hf_path, mesh=mesh, config=CONFIG, progress=False)
  checkpoint._Checkpoint.read = original
  _check_local_shards(model, mesh)
  # Without a mesh each process holds the whole model on its first own device; shard_model then places it on
  # the mesh exactly as load_hf(mesh=...) does.
  _, whole = checkpoint.load_hf(hf_path, config=CONFIG, progress=False)
  assert all(var.get_value().devices() == {jax.local_devices()[0]}
             for _, var in nnx.to_flat_state(nnx.state(whole)))
  placed, _ = sharding.shard_model(whole, mesh)
  _check_local_shards(placed, mesh)
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(placed))):
    a, b = a.get_value(), b.get_value()
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), path
    for sa, sb in zip(a.addressable_shards, b.addressable_shards):
      assert sa.device == sb.device and sa.index == sb.index, path
      np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data), err_msg=str(path))
  # Only this process's experts were read from the checkpoint (each once); the other processes read theirs.
  mine = _local_experts(model)
  assert 0 < len(mine) < CONFIG.num_experts, mine
  read_experts = sorted(n for n in reads if ".experts." in n)
  assert read_experts == sorted(f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                                for e in mine for w in ("w1", "w2", "w3")), read_experts
  step = make_step(model, mesh)
  results = {f"hf_{k}": v for k, v in run_steps(step, model.cfg).items()}
  results.update({f"hf_global_{k}": v for k, v in run_steps(step, model.cfg, global_inputs=True).items()})

  # Orbax: every process saves (collective) to the shared directory, then restores only its own blocks.
  orbax_path = os.path.join(out_dir, "converted")
  converted.save_converted(cfg, model, orbax_path)
  cfg2, restored = converted.load_converted(orbax_path, mesh, impl="xla")
  assert cfg2 == cfg
  _check_local_shards(restored, mesh)
  # The same jitted step (one compile) run on the restored parameters.
  restored_step = dataclasses.replace(step, state=nnx.state(restored))
  results.update({f"orbax_{k}": v for k, v in run_steps(restored_step, restored.cfg).items()})
  np.savez(os.path.join(out_dir, f"logits_{pid}.npz"), **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])

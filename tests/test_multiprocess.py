"""The sharded model across processes: 3 ``jax.distributed`` processes x 3 CPU devices form the 9-device mesh.

The workers (``multiprocess_worker.py``) load a tiny HF checkpoint onto the mesh (each process placing and
reading only its own blocks), run the sharded prefill + decodes with host-local and with global inputs,
save and restore the model through Orbax, and run it again. Their logits must equal those of the same model
on this process's 9-device mesh.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import multiprocess_worker as worker
from support import device_mesh
from k3jax import checkpoint, testing

TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # The workers set 3 CPU devices themselves; a device count forced through XLA_FLAGS would contradict it.
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


@pytest.mark.slow
def test_multiprocess_3x3_equals_single_process_9_devices(tmp_path):
  hf = testing.write_tiny_hf(tmp_path / "hf", worker.CONFIG, seed=3)
  port = _free_port()
  script = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
  procs = [subprocess.Popen([sys.executable, script, str(i), str(port), hf, str(tmp_path)], env=_worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(worker.NUM_PROCESSES)]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    outputs = [p.communicate()[0] for p in procs]
    raise AssertionError("workers timed out:\n" + "\n".join(
        f"--- process {i}:\n{out[-6000:]}" for i, out in enumerate(outputs)))
  failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
  assert not failed, f"workers failed {failed}:\n" + "\n".join(
      f"--- process {i} (rc {p.returncode}):\n{out[-6000:]}" for i, (p, out) in enumerate(zip(procs, outputs)))

  # The reference: the same checkpoint and steps on this process's 9 CPU devices.
  mesh = device_mesh(9)
  _, model = checkpoint.load_hf(hf, mesh=mesh, config=worker.CONFIG, progress=False)
  ref = worker.run_steps(worker.make_step(model, mesh), model.cfg)
  assert len(ref) == worker.NUM_DECODES + 1
  for i in range(worker.NUM_PROCESSES):
    got = np.load(tmp_path / f"logits_{i}.npz")
    assert sorted(got.files) == sorted(f"{kind}_{k}" for kind in ("hf", "hf_global", "orbax") for k in ref)
    for name in got.files:
      want = ref[name.rsplit("_", 1)[1]]
      assert got[name].shape == want.shape == (sum(worker.LENS) if name.endswith("step0") else len(worker.LENS),
                                               worker.CONFIG.vocab_size), name
      assert np.isfinite(got[name]).all(), name
      # Same program, same 9-way partition; only the collectives' transport differs (gloo across processes).
      np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=f"process {i} {name}")

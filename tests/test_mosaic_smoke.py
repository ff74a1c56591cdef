"""The Mosaic GPU toolchain smoke test: TMA + wgmma in interpret mode, lowered for CUDA, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_interpret
from pallas_kernels._smoke import smoke_matmul


def _inputs():
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (64, 64), jnp.bfloat16)
  b = jax.random.normal(kb, (64, 64), jnp.bfloat16)
  return a, b


def _check(out, a, b):
  assert out.shape == (64, 64) and out.dtype == jnp.float32
  oracle = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  # bf16 inputs are exact in f32 and products of two bf16 are exact in f32, so only the f32 summation of
  # 64 terms of size ~1 rounds: a few ulp of |sum| <= ~30, i.e. well below 1e-4.
  np.testing.assert_allclose(np.asarray(out), oracle, rtol=0, atol=1e-4)
  np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32)),
                             rtol=0, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode is exercised on CPU")
def test_smoke_interpret_matches_dot():
  # Interpret mode keeps its barrier bookkeeping per device: pin the inputs to one device.
  a, b = (jax.device_put(x, jax.devices()[0]) for x in _inputs())
  with mosaic_interpret.interpret_mode():
    out = smoke_matmul(a, b)
  _check(out, a, b)


def test_smoke_lowers_for_cuda():
  a, b = _inputs()
  text = jax.jit(smoke_matmul).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_smoke_rejects_bad_inputs():
  a, b = _inputs()
  with pytest.raises(ValueError, match=r"a must have shape \(64, 64\), got \(64, 32\)"):
    smoke_matmul(a[:, :32], b)
  with pytest.raises(ValueError, match="b must have dtype in \\['bfloat16'\\], got float32"):
    smoke_matmul(a, b.astype(jnp.float32))


@pytest.mark.gpu
def test_smoke_compiled_matches_dot():
  a, b = _inputs()
  _check(smoke_matmul(a, b), a, b)


@pytest.mark.parametrize("ordered", [True, False])
def test_interpret_mode_reports_an_unordered_smem_access(ordered):
  """Race detection is on in ``mosaic_interpret.interpret_mode``: a TMA store that reads an SMEM buffer before the
  wait on the TMA load that fills it is reported; with the wait first it is not."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(x_ref, o_ref, buf, bar):
    plgpu.copy_gmem_to_smem(x_ref, buf, bar)
    if ordered:
      plgpu.barrier_wait(bar)
    plgpu.copy_smem_to_gmem(buf, o_ref)
    plgpu.wait_smem_to_gmem(0)
    if not ordered:
      plgpu.barrier_wait(bar)  # every barrier phase is awaited

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                        scratch_types=[plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier()])
  with mosaic_interpret.interpret_mode():
    jax.block_until_ready(jax.jit(kernel)(jnp.ones((64, 64), jnp.float32)))
  found = mosaic_interpret.races_found()
  mosaic_interpret.reset_state()  # the expected race must not fail this test's teardown check
  assert found == (not ordered)

"""Test setup: 9 CPU devices (the 9-device mesh exists only on CPUs here), markers, the `gpu` skip."""

import os

# The CPU client's thread pool (tsl reads NPROC): interpret mode runs each warpgroup of a kernel as a thread that
# blocks in barrier waits on that pool, and with 2 cores the narrow MLA kernel's memory warpgroup (which
# dequantises an fp8 cache) could not get a thread while both compute warpgroups waited for it.
os.environ.setdefault("NPROC", "8")

import jax  # noqa: E402

# Must happen before JAX initialises its backends.
jax.config.update("jax_num_cpu_devices", 9)

import pytest  # noqa: E402

from pallas_kernels import mosaic_interpret, util  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if util.is_hopper_gpu():
    return
  skip = pytest.mark.skip(reason="needs a Hopper GPU (sm_90a)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """A failed interpreted kernel must not fail every later one: the interpreter's state is process-wide."""
  yield
  mosaic_interpret.reset_state()


@pytest.fixture
def kernel_impl() -> str:
  """The kernel backend a kernel test runs: compiled on a Hopper GPU, interpret mode elsewhere."""
  return "pallas" if util.is_hopper_gpu() else "interpret"

"""Test setup: 9 CPU devices (the 9-device mesh exists only on CPUs here), f32 matmuls at full precision and
bf16 roundings kept on a GPU too, the `gpu` skip, and a log of failures written as they happen
(``K3JAX_FAILURE_LOG``)."""

import os
import shutil
import tempfile

# The CPU client's thread pool (tsl reads NPROC): interpret mode runs each warpgroup of a kernel as a thread that
# blocks in barrier waits on that pool, and with 2 cores the narrow MLA kernel's memory warpgroup (which
# converts an fp8 cache) could not get a thread while both compute warpgroups waited for it.
os.environ.setdefault("NPROC", "8")
# pytest-xdist workers are separate JAX processes sharing one GPU (`make gpu-check` runs 14): by default the first
# to allocate takes 75% of its memory and the next workers' allocations fail. Each worker takes only what its
# running test needs and gives back what the test freed (the platform allocator: JAX's own pool would keep each
# worker's largest test's memory to the end of the run, and the real-size tests of other workers then ran out of
# memory). No effect on CPUs.
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

import jax  # noqa: E402

# Must happen before JAX initialises its backends.
jax.config.update("jax_num_cpu_devices", 9)
# The f32 tests compare against float64 oracles at f32 tolerances. XLA's default f32 matmul on a GPU rounds its
# operands to TF32 (10 mantissa bits), a speed choice of the caller and not the code under test; CPUs already
# multiply in full f32, so this changes nothing in CI. bf16 matmuls are unaffected.
jax.config.update("jax_default_matmul_precision", "highest")
# The XLA paths round to bf16 where the op says so (a bf16 state carried from token to token, bf16 partials):
# the tests check those roundings. XLA on a GPU may keep f32 inside a fusion instead ("excess precision").
# No autotuning of XLA's GPU matmuls and fusions: the tests check numerics, not speed, and on the one lent GPU
# every compile counts against the device time.
XLA_TEST_FLAGS = ("--xla_allow_excess_precision=false", "--xla_gpu_autotune_level=0")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *XLA_TEST_FLAGS]).strip()

import pytest  # noqa: E402

from pallas_kernels import mosaic_interpret, util  # noqa: E402


class FailureLog:
  """Appends each failure's traceback to a file when it happens: pytest prints tracebacks only at the end, so a
  run killed by a time limit (``make gpu-check`` on a lent GPU) would otherwise lose them."""

  def __init__(self, path: str):
    self.path = path

  def pytest_runtest_logreport(self, report):
    if report.failed:
      with open(self.path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


# A persistent compilation cache shared by the controller's xdist workers within one run: the tests compile
# the same computations many times (each test builds its own jit of the same ops and shapes, and both workers
# compile what they share), and on a 2-core CI machine compiling is most of the suite's time. Every executable
# is stored, however quick its compile: the many small ones add up. A fresh directory per run, removed at its
# end, so a run never reads what another JAX or another checkout wrote.
CACHE_DIR_ENV = "K3JAX_TEST_COMPILATION_CACHE"


def _use_compilation_cache(config) -> None:
  if not hasattr(config, "workerinput"):
    path = tempfile.mkdtemp(prefix="k3jax-jax-cache-")
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    os.environ[CACHE_DIR_ENV] = path  # inherited by the xdist workers, which start after pytest_configure
  jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_DIR_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
  _use_compilation_cache(config)
  # Only where K3JAX_FAILURE_LOG names a file, and not in an xdist worker (it has ``workerinput``): the
  # controller receives every worker's reports.
  path = os.environ.get("K3JAX_FAILURE_LOG")
  if path and not hasattr(config, "workerinput"):
    config.pluginmanager.register(FailureLog(path), "k3jax-failure-log")


def pytest_collection_modifyitems(config, items):
  # The slow tests first (a stable sort: the same order in every xdist worker, which xdist requires): with work
  # stealing the run then ends in short tests, instead of one worker finishing a long one while the other idles.
  items.sort(key=lambda item: "slow" not in item.keywords)
  if util.is_hopper_gpu():
    return
  skip = pytest.mark.skip(reason="needs a Hopper GPU (sm_90a)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """A failed interpreted kernel must not fail every later one: the interpreter's state is process-wide. A test
  whose interpreted kernels raced (``mosaic_interpret.races_found``) fails here."""
  yield
  raced = mosaic_interpret.races_found()
  mosaic_interpret.reset_state()
  assert not raced, "interpret mode detected a data race (the RACE DETECTED lines in the captured output)"


@pytest.fixture
def kernel_impl() -> str:
  """The kernel backend a kernel test runs: compiled on a Hopper GPU, interpret mode elsewhere."""
  return "pallas" if util.is_hopper_gpu() else "interpret"

"""Shared test support (the oracles and input factories are public, in ``pallas_kernels.testing``).

``fast_jit``: CPU compiles at XLA backend optimisation level 0. ``device_mesh``, ``needs_devices``: a mesh
of the default backend's devices, or a skip where it has too few. ``budget``: the example budget of the
randomized (property-based) differential tests.

The randomized tests draw whole batches (lengths, slots, gates, pages) with ``hypothesis``. Their budget is
fixed per test: a small one on the CPU (CI runs the kernels in interpret mode, which is slow) and a larger one
on a Hopper GPU (``make gpu-check``). ``K3JAX_EXAMPLES`` multiplies both (e.g. ``K3JAX_EXAMPLES=4`` for a
longer hunt). CPU runs are derandomized, so CI draws the same examples every time; GPU runs draw new ones.
``SEEDS``, ``decode_batches`` and ``decode_slots`` are the strategies and slot layouts the randomized decode
tests of several kernels share. ``users_xla_env``: a child process's environment with the XLA flags users run with.
"""

import functools
import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st

from k3jax import sharding
from pallas_kernels import util


# Linux caps a process's memory mappings (``vm.max_map_count``, 65,530 by default), and every compiled XLA:CPU
# executable holds a few of its own for as long as JAX's caches keep it. Interpret mode compiles executables per
# kernel, shape and warpgroup thread, so a long randomized run (``K3JAX_EXAMPLES=20``) filled the table, and the
# next mapping failed inside jaxlib as a segmentation fault. Past this many mappings an example first drops JAX's
# caches (their executables unmap when collected).
MAX_MAPPINGS = 40_000


def release_compiled_code() -> bool:
  """``jax.clear_caches()`` if the process holds more than ``MAX_MAPPINGS`` memory mappings (Linux; elsewhere
  nothing). Returns whether it cleared them."""
  try:
    with open("/proc/self/maps") as f:
      mappings = sum(1 for _ in f)
  except OSError:
    return False
  if mappings <= MAX_MAPPINGS:
    return False
  jax.clear_caches()
  return True


def budget(cpu: int, gpu: int):
  """Decorator of a randomized test (outside its ``@given``): ``hypothesis.settings`` with ``cpu`` examples without
  a Hopper GPU and ``gpu`` with one, each example starting with ``release_compiled_code``."""
  scale = float(os.environ.get("K3JAX_EXAMPLES", "1"))
  on_gpu = util.is_hopper_gpu()
  # No shrinking: each example compiles or interprets kernels, so shrinking a failure would cost minutes;
  # the failing example is printed as drawn.
  example_settings = settings(max_examples=max(1, round((gpu if on_gpu else cpu) * scale)), deadline=None,
                              derandomize=not on_gpu, database=None, print_blob=True,
                              phases=(Phase.explicit, Phase.generate),
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture])

  def apply(test):
    if not hasattr(test, "hypothesis"):
      raise TypeError(f"@budget goes above @given, got {test!r}")
    test = example_settings(test)
    inner = test.hypothesis.inner_test  # what hypothesis calls once per example (replaceable, as documented)

    @functools.wraps(inner)
    def each_example(*args, **kwargs):
      release_compiled_code()
      return inner(*args, **kwargs)

    test.hypothesis.inner_test = each_example
    return test

  return apply


SEEDS = st.integers(0, 2**31 - 1)


@st.composite
def decode_batches(draw):
  """Rows of the one-token (S = None) or speculative (1 + S tokens) form: slots, num_accepted, padding rows."""
  N = draw(st.integers(1, 4))
  S = draw(st.sampled_from([None, 1, 3]))
  cols = 1 if S is None else 1 + S
  accepted = [draw(st.integers(1, cols)) for _ in range(N)]
  padding = draw(st.lists(st.booleans(), min_size=N, max_size=N))  # read slot -1: nothing read or written
  skipped = [[draw(st.booleans()) for _ in range(cols)] for _ in range(N)]  # -1 columns (not the read one)
  return N, S, accepted, padding, skipped


def decode_slots(rng: np.random.Generator, N: int, cols: int, accepted: list[int], padding: list[bool],
                 skipped: list[list[bool]]) -> tuple[int, np.ndarray]:
  """Pool size ``P`` (two slots more than named) and distinct slots ``[N, cols]``: -1 at padding rows' read
  column and at skipped columns other than the read one."""
  P = N * cols + 2
  slots = rng.permutation(P)[:N * cols].reshape(N, cols).astype(np.int32)
  for n in range(N):
    for t in range(cols):
      if padding[n] and t == accepted[n] - 1 or skipped[n][t] and t != accepted[n] - 1:
        slots[n, t] = -1
  return P, slots


def needs_devices(n: int) -> None:
  """Skips the calling test where the default backend has fewer than ``n`` devices.

  CI runs these tests on 9 CPU devices. On a one-GPU machine a mesh would need GPUs it does not have, and a
  mesh of CPU devices there would only repeat CI's run.
  """
  have = len(jax.devices())
  if have < n:
    pytest.skip(f"needs {n} {jax.default_backend()} devices, this machine has {have} (CI runs it on 9 CPU devices)")


def device_mesh(n: int) -> jax.sharding.Mesh:
  """``sharding.make_mesh(n)``, after ``needs_devices(n)``."""
  needs_devices(n)
  return sharding.make_mesh(n)


def fast_jit(fn):
  """``jax.jit`` compiled at XLA backend optimisation level 0: CPU compiles of the KDA/MoE graphs drop from
  ~30 s to ~6 s on a 2-core machine, the numerics are the same ops. Cached per input structure."""
  cache = {}

  def wrapped(*args):
    key = jax.tree.structure(args), tuple((a.shape, a.dtype) for a in jax.tree.leaves(args))
    if key not in cache:
      cache[key] = jax.jit(fn).lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})
    return cache[key](*args)

  return wrapped


def users_xla_env(**extra: str) -> dict[str, str]:
  """This process's environment with XLA's flags as users run them: without the excess-precision setting that
  conftest adds (XLA may then drop a rounding the code relies on, as it once did q's e4m3 split), for a child
  process. ``extra`` is added."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "excess_precision" not in f)
  return dict(os.environ, XLA_FLAGS=flags, **extra)

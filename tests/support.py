"""Shared test support (the oracles and input factories are public, in ``pallas_kernels.testing``).

``fast_jit``: CPU compiles at XLA backend optimisation level 0. ``budget``: the example budget of the
randomized (property-based) differential tests.

The randomized tests draw whole batches (lengths, slots, gates, pages) with ``hypothesis``. Their budget is
fixed per test: a small one on the CPU (CI runs the kernels in interpret mode, which is slow) and a larger one
on a Hopper GPU (``make gpu-check``). ``K3JAX_EXAMPLES`` multiplies both (e.g. ``K3JAX_EXAMPLES=4`` for a
longer hunt). CPU runs are derandomized, so CI draws the same examples every time; GPU runs draw new ones.
"""

import os

import jax
from hypothesis import HealthCheck, Phase, settings

from pallas_kernels import util


def budget(cpu: int, gpu: int) -> settings:
  """``hypothesis.settings`` for a randomized test: ``cpu`` examples without a Hopper GPU, ``gpu`` with one."""
  scale = float(os.environ.get("K3JAX_EXAMPLES", "1"))
  on_gpu = util.is_hopper_gpu()
  # No shrinking: each example compiles or interprets kernels, so shrinking a failure would cost minutes;
  # the failing example is printed as drawn.
  return settings(max_examples=max(1, round((gpu if on_gpu else cpu) * scale)), deadline=None,
                  derandomize=not on_gpu, database=None, print_blob=True,
                  phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture])


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

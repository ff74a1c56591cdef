import os

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import support

from pallas_kernels import util
from pallas_kernels.kda import KdaConfig
from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning


def test_nine_cpu_devices():
  if jax.default_backend() == "cpu":
    assert len(jax.devices()) == 9


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="runs in a pytest-xdist worker only")
def test_xdist_workers_share_the_gpu_memory():
  # conftest: without these, the first worker to allocate on a GPU takes 75% of its memory and the others fail
  assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
  assert os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform"


def test_default_impl_decided_in_one_place():
  expected = "pallas" if util.is_hopper_gpu() else "xla"
  assert util.default_impl() == expected
  assert KdaConfig().impl == expected
  assert MlaDecodeConfig(scale=1.0).impl == expected


def test_configs_canonicalise_dtypes_and_hash_alike():
  a = KdaConfig(state_dtype=jnp.bfloat16, impl="xla")
  b = KdaConfig(state_dtype="bfloat16", impl="xla")
  assert a == b and hash(a) == hash(b) and a.state_dtype == jnp.dtype(jnp.bfloat16)
  c = MlaDecodeConfig(scale=0.5, partial_dtype=jnp.float32, impl="xla", tuning=MlaDecodeTuning(num_splits=2))
  d = MlaDecodeConfig(scale=1 / 2, partial_dtype="float32", impl="xla", tuning=MlaDecodeTuning(num_splits=2))
  assert c.partial_dtype == jnp.dtype("float32") and c == d and hash(c) == hash(d)


def test_compiler_params_switch_the_profiler_on_from_the_environment(monkeypatch):
  monkeypatch.delenv(util.PROFILE_DIR_ENV, raising=False)
  plain = util.compiler_params(approx_math=True)
  assert plain.approx_math and plain.profile_space == 0 and plain.profile_dir == ""
  monkeypatch.setenv(util.PROFILE_DIR_ENV, "/tmp/traces")
  monkeypatch.setenv(util.PROFILE_SPACE_ENV, "64")
  on = util.compiler_params(approx_math=True)
  assert on.approx_math and on.profile_space == 64 and on.profile_dir == "/tmp/traces" and on.profile_bounds_check
  monkeypatch.setenv(util.PROFILE_SPACE_ENV, "0")
  with pytest.raises(ValueError, match=f"{util.PROFILE_SPACE_ENV} must be an int >= 1, got 0"):
    util.compiler_params()


def test_phases_name_consecutive_regions():
  def body(x):
    phases = util.Phases()
    phases.start("first")
    y = x + 1
    phases.start("second")
    z = y * 2
    phases.end()
    return z - 1

  eqns = jax.make_jaxpr(body)(1.0).eqns
  assert [str(e.source_info.name_stack) for e in eqns] == ["first", "second", ""]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts mappings in /proc/self/maps (Linux)")
def test_randomized_examples_drop_jax_caches_past_the_mapping_limit(monkeypatch):
  """``support.budget`` starts every example with ``release_compiled_code``: JAX's caches are dropped before
  each example once the process holds more than ``MAX_MAPPINGS`` memory mappings, and never below that."""
  cleared, examples = [], []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(len(examples)))

  @support.budget(cpu=3, gpu=3)
  @given(x=st.integers())
  def body(x):
    examples.append(x)

  for limit, clears in ((10**9, False), (0, True)):
    cleared.clear()
    examples.clear()
    monkeypatch.setattr(support, "MAX_MAPPINGS", limit)
    body()
    assert examples and cleared == (list(range(len(examples))) if clears else []), (limit, cleared, examples)

import jax
import jax.numpy as jnp

from pallas_kernels import util
from pallas_kernels.kda import KdaConfig
from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning


def test_nine_cpu_devices():
  if jax.default_backend() == "cpu":
    assert len(jax.devices()) == 9


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

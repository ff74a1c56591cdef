"""Short-convolution kernel test support shared by the per-kernel tests and the randomized ones: the conv
width, dtypes and tolerances (each derived next to it), input factories, the prefill runner (kernel and
``impl="xla"``) and its check."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.short_conv import ShortConvConfig, short_conv_prefill

W = 4
F32, BF16 = jnp.float32, jnp.bfloat16
# f32 rows: the only rounding is the f32 sum of W products and the SiLU, ~1e-6 relative at |y| ~ 3.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 y: one rounding of an f32 result (half an ulp, 2^-9 relative); f32 and float64 may land on
# neighbouring bf16 numbers, so allow one ulp (2^-8) with some room.
BF16_TOL = dict(rtol=8e-3, atol=1e-5)


def _np_dtype(dtype):
  return ml_dtypes.bfloat16 if dtype == BF16 else np.float32


def inputs(seed, n, steps, d, num_slots, dtype, pool_dtype, poison=()):
  # NumPy draws: eager jax.random would compile one XLA program per shape (seconds per test on CPU).
  # Projection outputs of unit scale; taps of a short conv are O(1/sqrt(W)). Slots in ``poison`` are NaN.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, steps, d)).astype(_np_dtype(dtype))
  weight = (rng.standard_normal((d, W)) / 2).astype(_np_dtype(dtype))
  pool = rng.standard_normal((num_slots, W - 1, d)).astype(_np_dtype(pool_dtype))
  pool[list(poison)] = np.nan
  return x, weight, pool


def assert_bitwise_equal(a, b):
  """Equal bit patterns (NaN payloads included)."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  uint = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
  np.testing.assert_array_equal(a.view(uint), b.view(uint))


def prefill_inputs(seed, lengths, d, num_slots, dtype, pool_dtype, poison=()):
  """x [T, d], weight, pool (slots in ``poison`` NaN) and cu_seqlens for sequences of ``lengths``."""
  x, weight, pool = inputs(seed, sum(lengths), 1, d, num_slots, dtype, pool_dtype, poison=poison)
  return x[:, 0], weight, pool, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def prefill_both(x, weight, pool, cu, slots, has_init, ckpts, *, impl, activation="silu", tuning=None):
  """``short_conv_prefill`` with ``impl="xla"`` and with the kernel (``impl``, on one device, with ``tuning``);
  ``ckpts``: (sequence, offset, slot) sorted by sequence, or None. Returns ((y, pool) xla, (y, pool) kernel) as
  NumPy."""
  put = functools.partial(jax.device_put, device=jax.devices()[0])
  n = len(slots)
  args = dict(cu_seqlens=put(cu), state_indices=put(np.asarray(slots, np.int32)),
              has_initial_state=put(np.asarray(has_init)), checkpoint_indptr=None, checkpoint_offsets=None,
              checkpoint_slots=None)
  if ckpts is not None:
    args.update(checkpoint_indptr=put(np.searchsorted([c[0] for c in ckpts], np.arange(n + 1)).astype(np.int32)),
                checkpoint_offsets=put(np.asarray([c[1] for c in ckpts], np.int32).reshape(-1)),
                checkpoint_slots=put(np.asarray([c[2] for c in ckpts], np.int32).reshape(-1)))
  xs, ws, ps = put(x), put(weight), put(pool)
  ref = short_conv_prefill(xs, ws, conv_pool=ps, **args, config=ShortConvConfig(activation=activation, impl="xla"))
  out = short_conv_prefill(xs, ws, conv_pool=ps, **args,
                           config=ShortConvConfig(activation=activation, impl=impl, tuning=tuning))
  assert out[0].shape == x.shape and out[0].dtype == x.dtype
  assert out[1].shape == pool.shape and out[1].dtype == pool.dtype
  return [tuple(np.asarray(a) for a in r) for r in (ref, out)]


def check_prefill(ref, out, *, dtype, untouched, pool):
  (y_ref, p_ref), (y, p) = ref, out
  # The same f32 math in a different order, rounded once to x's dtype.
  np.testing.assert_allclose(y.astype(np.float32), y_ref.astype(np.float32),
                             **(F32_TOL if dtype == F32 else BF16_TOL))
  assert_bitwise_equal(p, p_ref)
  assert_bitwise_equal(p[untouched], pool[untouched])

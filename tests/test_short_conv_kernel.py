"""The short conv decode Mosaic GPU kernel (interpret mode on CPU, compiled on a Hopper GPU: the ``kernel_impl``
fixture) vs a float64 oracle and vs the pure-JAX ``short_conv_update(impl="xla")``."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.kda import short_conv_kernel
from pallas_kernels.kda.short_conv import short_conv_update

W = 4
F32, BF16 = jnp.float32, jnp.bfloat16
# f32 rows: the only rounding is the f32 sum of W products and the SiLU, ~1e-6 relative at |y| ~ 3.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 y: one rounding of an f32 result (half an ulp, 2^-9 relative); f32 and float64 may land on
# neighbouring bf16 numbers, so allow one ulp (2^-8) with some room.
BF16_TOL = dict(rtol=8e-3, atol=1e-5)


def _oracle(x, weight, pool, slots, accepted, activation="silu"):
  """Float64 loop over rows, speculative form (``x [N, 1 + S, D]``, ``slots [N, 1 + S]``).

  Returns ``y`` (float64) and the new pool in the pool's dtype (rows rounded once to it).
  """
  xf, w = np.asarray(x, np.float64), np.asarray(weight, np.float64)
  pool = np.asarray(pool)
  new_pool, y = pool.copy(), np.zeros(xf.shape)
  for n in range(xf.shape[0]):
    read = slots[n][accepted[n] - 1]
    if read < 0:
      continue
    hist = np.concatenate([pool[read].astype(np.float64), xf[n]])
    for t in range(xf.shape[1]):
      acc = sum(w[:, i] * hist[t + i] for i in range(W))
      y[n, t] = acc / (1.0 + np.exp(-acc)) if activation == "silu" else acc
      if slots[n][t] >= 0:
        new_pool[slots[n][t]] = hist[t + 1:t + W].astype(pool.dtype)
  return y, new_pool


def _np_dtype(dtype):
  return ml_dtypes.bfloat16 if dtype == BF16 else np.float32


def _inputs(seed, n, steps, d, num_slots, dtype, pool_dtype, poison=()):
  # NumPy draws: eager jax.random would compile one XLA program per shape (seconds per test on CPU).
  # Projection outputs of unit scale; taps of a short conv are O(1/sqrt(W)). Slots in ``poison`` are NaN.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, steps, d)).astype(_np_dtype(dtype))
  weight = (rng.standard_normal((d, W)) / 2).astype(_np_dtype(dtype))
  pool = rng.standard_normal((num_slots, W - 1, d)).astype(_np_dtype(pool_dtype))
  pool[list(poison)] = np.nan
  return x, weight, pool


def _kernel(x, weight, pool, slots, accepted, *, impl, activation="silu", block_rows=None, single=False):
  """The kernel (``impl`` pallas or interpret) on one device (interpret mode keeps per-device barrier state)."""
  put = functools.partial(jax.device_put, device=jax.devices()[0])
  slots = put(np.asarray(slots, np.int32))
  if single:
    x, slots, accepted = x[:, 0], slots[:, 0], None
  else:
    accepted = put(np.asarray(accepted, np.int32))
  y, new_pool = short_conv_kernel.short_conv_update_mosaic(put(x), put(weight), put(pool), slots, accepted,
                                                           activation=activation, interpret=impl == "interpret",
                                                           block_rows=block_rows)
  assert y.shape == x.shape and y.dtype == x.dtype
  assert new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
  return np.asarray(y).reshape(x.shape[0], -1, x.shape[-1]), np.asarray(new_pool)


def _assert_bitwise_equal(a, b):
  """Equal bit patterns (NaN payloads included)."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  uint = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
  np.testing.assert_array_equal(a.view(uint), b.view(uint))


def _check(y, new_pool, y_ref, pool_ref, *, dtype, dead_rows, untouched, pool):
  np.testing.assert_allclose(y.astype(np.float64), y_ref, **(F32_TOL if dtype == F32 else BF16_TOL))
  np.testing.assert_array_equal(y[dead_rows], 0.0)
  # Windows are raw rows moved around, rounded once to the pool dtype: exact, as in the oracle. Untouched
  # slots (NaN-poisoned, some of them never read) keep their bits.
  _assert_bitwise_equal(new_pool, pool_ref)
  _assert_bitwise_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("dtype, pool_dtype, d, block_rows", [
    (F32, F32, 512, (128, 1)),
    # 3 rows per program: the second program has one row, two past the end; a last block of 128 channels.
    (BF16, BF16, 640, (256, 3)),
    (BF16, F32, 1536, (512, 2)),
    (F32, BF16, 384, None),
])
def test_one_token_matches_oracle(kernel_impl, dtype, pool_dtype, d, block_rows):
  n, num_slots = 4, 8
  untouched = [1, 3, 4, 6, 7]
  x, weight, pool = _inputs(0, n, 1, d, num_slots, dtype, pool_dtype, poison=untouched)
  slots = np.asarray([[5], [-1], [0], [2]])  # the -1 row outputs 0 and touches nothing
  y, new_pool = _kernel(x, weight, pool, slots, None, impl=kernel_impl, block_rows=block_rows, single=True)
  y_ref, pool_ref = _oracle(x, weight, pool, slots, [1] * n)
  _check(y, new_pool, y_ref, pool_ref, dtype=dtype, dead_rows=[1], untouched=untouched, pool=pool)


@pytest.mark.parametrize("dtype, pool_dtype, activation, d, block_rows", [
    (F32, F32, "silu", 1024, (256, 1)),
    (BF16, BF16, None, 1024, (128, 2)),
    (F32, BF16, "silu", 1536, (1024, 2)),  # x rows rounded to the pool dtype when written; a last block of 512
])
def test_speculative_matches_oracle(kernel_impl, dtype, pool_dtype, activation, d, block_rows):
  n, steps, num_slots = 3, 3, 12
  # Row 0 resumes from its 2nd column (slot 1, also written by it); row 1's read slot is -1 (padding: its
  # other slots stay untouched); row 2 skips writing column 1. Slot 10 is NaN and never read or written.
  slots = np.asarray([[0, 1, 2], [-1, 4, 5], [6, -1, 8]])
  accepted = [2, 1, 3]
  untouched = [3, 4, 5, 7, 9, 10, 11]
  x, weight, pool = _inputs(1, n, steps, d, num_slots, dtype, pool_dtype, poison=untouched)
  y, new_pool = _kernel(x, weight, pool, slots, accepted, impl=kernel_impl, activation=activation,
                        block_rows=block_rows)
  y_ref, pool_ref = _oracle(x, weight, pool, slots, accepted, activation=activation)
  _check(y, new_pool, y_ref, pool_ref, dtype=dtype, dead_rows=[1], untouched=untouched, pool=pool)


@pytest.mark.parametrize("speculative", [False, True])
def test_public_api_matches_xla(kernel_impl, speculative):
  """``short_conv_update(impl=kernel)`` vs ``impl="xla"``, two steps in a row under jit (pool donated)."""
  n, steps, d, num_slots = 3, 2 if speculative else 1, 256, 8
  x, weight, pool = _inputs(2, n, steps, d, num_slots, BF16, BF16, poison=[6])
  slots = jnp.asarray([[0, 1], [-1, 2], [4, 5]] if speculative else [[1], [-1], [4]], jnp.int32)
  accepted = jnp.asarray([2, 1, 1], jnp.int32) if speculative else None
  if not speculative:
    x, slots = x[:, 0], slots[:, 0]
  outs = {}
  for impl in ("xla", kernel_impl):
    step = jax.jit(functools.partial(short_conv_update, weight=jnp.asarray(weight), state_indices=slots,
                                     num_accepted=accepted, impl=impl), donate_argnames="conv_pool")
    p = jnp.asarray(pool)
    ys = []
    for _ in range(2):
      y, p = step(jnp.asarray(x), conv_pool=p)
      ys.append(np.asarray(y, np.float32))
    outs[impl] = ys, np.asarray(p)
  (ys_ref, p_ref), (ys, p) = outs["xla"], outs[kernel_impl]
  for y, y_ref in zip(ys, ys_ref):
    # The same f32 math in a different order, both rounded to bf16: at most one ulp apart.
    np.testing.assert_allclose(y, y_ref, **BF16_TOL)
  _assert_bitwise_equal(p, p_ref)
  _assert_bitwise_equal(p[6], pool[6])


def test_rejects_unsupported_channels_and_bad_impl():
  x, weight, pool = _inputs(3, 1, 1, 96, 2, F32, F32)
  args = (jnp.asarray(x[:, 0]), jnp.asarray(weight))
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray([0], jnp.int32))
  with pytest.raises(NotImplementedError, match="D % 128 == 0, got D=96"):
    short_conv_update(*args, **kw, impl="interpret")
  with pytest.raises(ValueError, match="impl must be one of"):
    short_conv_update(*args, **kw, impl="triton")


def test_empty_batch(kernel_impl):
  _, weight, pool = _inputs(3, 1, 1, 256, 2, F32, F32)
  y, new_pool = short_conv_update(jnp.zeros((0, 256)), jnp.asarray(weight), conv_pool=jnp.asarray(pool),
                                  state_indices=jnp.zeros((0,), jnp.int32), impl=kernel_impl)
  assert y.shape == (0, 256) and y.dtype == jnp.float32
  _assert_bitwise_equal(new_pool, pool)


@pytest.mark.parametrize("n, d", [(1, 36864), (256, 36864), (8, 4224), (256, 4224), (3, 384)])
def test_plan_fills_the_gpu(n, d):
  block, rows = short_conv_kernel.plan(n, d)
  assert 1 <= rows <= short_conv_kernel.MAX_ROWS
  programs = -(-d // block) * -(-n // rows)
  # Enough programs for every SM when there are enough channels; 16-byte bf16 accesses for big batches.
  assert programs >= min(short_conv_kernel.NUM_SMS, n * d // 128)
  if n * d >= 1024 * short_conv_kernel.TARGET_PROGRAMS:
    assert block == 1024 and programs >= short_conv_kernel.TARGET_PROGRAMS


@pytest.mark.parametrize("n, d", [(1, 3 * 96 * 128), (256, 3 * 96 * 128), (256, 3 * 11 * 128)])
@pytest.mark.parametrize("steps, dtype, pool_dtype", [(1, BF16, BF16), (4, BF16, BF16), (1, F32, BF16),
                                                      (3, BF16, F32)])
def test_lowers_for_cuda(n, d, steps, dtype, pool_dtype):
  """Mosaic GPU lowering and layout inference at the K3 sizes (D = 3 H K: 96 heads, and 11 heads per device
  at TP 9, where the last block is 128 channels), on the CPU."""
  lead = (n,) if steps == 1 else (n, steps)
  shapes = [jax.ShapeDtypeStruct((*lead, d), dtype), jax.ShapeDtypeStruct((d, W), dtype),
            jax.ShapeDtypeStruct((2 * n * steps, W - 1, d), pool_dtype), jax.ShapeDtypeStruct(lead, jnp.int32),
            jax.ShapeDtypeStruct((n,), jnp.int32) if steps > 1 else None]
  f = functools.partial(short_conv_kernel.short_conv_update_mosaic, activation="silu", interpret=False)
  text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("n, steps, d", [(1, 1, 3 * 96 * 128), (256, 1, 3 * 96 * 128), (64, 4, 3 * 96 * 128),
                                         (256, 1, 3 * 11 * 128)])
def test_real_sizes_on_gpu(n, steps, d):
  """The compiled kernel vs ``impl="xla"`` at K3 sizes, with padding rows, skipped writes and poisoned slots."""
  num_slots = n * steps + 8
  rng = np.random.default_rng(4)
  slots = rng.permutation(n * steps).reshape(n, steps)
  if n > 1:
    slots[n // 2] = -1
  if steps > 1:
    slots[0, 1] = -1
  accepted = rng.integers(1, steps + 1, n)
  accepted[0] = 1
  untouched = list(range(n * steps, num_slots))
  x, weight, pool = _inputs(4, n, steps, d, num_slots, BF16, BF16, poison=untouched)
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray(slots if steps > 1 else slots[:, 0], jnp.int32),
            num_accepted=jnp.asarray(accepted, jnp.int32) if steps > 1 else None)
  xs = jnp.asarray(x if steps > 1 else x[:, 0])
  y_ref, p_ref = short_conv_update(xs, jnp.asarray(weight), **kw, impl="xla")
  y, p = short_conv_update(xs, jnp.asarray(weight), **kw, impl="pallas")
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), **BF16_TOL)
  _assert_bitwise_equal(np.asarray(p), np.asarray(p_ref))
  _assert_bitwise_equal(np.asarray(p)[untouched], pool[untouched])

"""The KDA decode Mosaic GPU kernel (interpret mode on CPU, compiled on a Hopper GPU) vs a float64 oracle.

The kernel donates its pool argument, so every call here gets a fresh copy of the pool.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.kda.config import KdaConfig
from pallas_kernels.kda.decode_kernel import kda_decode_mosaic

POISON = 1e30
LB = -3.0  # a K3 lower-bound gate inside FLA's accepted [-5, 0)


def _oracle(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots, accepted, *, lower_bound, state_dtype):
  """Float64 token recurrence on pool slots, speculative form (``slots [N, 1 + S]``), V-first states."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, g_raw, beta_raw, A_log, dt_bias = map(f, (q, k, v, g_raw, beta_raw, A_log, dt_bias))
  pool = np.asarray(pool)
  new_pool = pool.copy()
  n_seq, steps, heads, kdim = q.shape
  o = np.zeros(v.shape)
  for n in range(n_seq):
    read = slots[n, accepted[n] - 1]
    if read < 0:
      continue
    s = f(pool[read].astype(np.float32))
    for t in range(steps):
      qn = q[n, t] / np.sqrt((q[n, t] ** 2).sum(-1, keepdims=True) + 1e-6)
      kn = k[n, t] / np.sqrt((k[n, t] ** 2).sum(-1, keepdims=True) + 1e-6)
      x = g_raw[n, t] + dt_bias
      rate = np.exp(A_log)[:, None]
      if lower_bound is None:
        g = -rate * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
      else:
        g = lower_bound / (1 + np.exp(-rate * x))
      beta = 1 / (1 + np.exp(-beta_raw[n, t]))
      s = s * np.exp(g)[:, None, :]
      u = beta[:, None] * (v[n, t] - np.einsum("hvk,hk->hv", s, kn))
      s = s + u[:, :, None] * kn[:, None, :]
      s = s.astype(state_dtype).astype(np.float64)  # each token's state is stored, then read back
      o[n, t] = kdim ** -0.5 * np.einsum("hvk,hk->hv", s, qn)
      if slots[n, t] >= 0:
        new_pool[slots[n, t]] = s.astype(state_dtype)
  return o, new_pool


def _inputs(seed, n, steps, heads, kdim, vdim, num_slots, dtype=jnp.float32, state_dtype=jnp.float32):
  # NumPy draws: eager jax.random would compile one XLA program per shape (seconds per test on CPU).
  rng = np.random.default_rng(seed)
  shape = (n, steps, heads)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  q, k, v, g_raw = (normal(*shape, d).astype(dtype) for d in (kdim, kdim, vdim, kdim))
  beta_raw = normal(*shape).astype(dtype)
  # Decay rates exp(A_log) from 1 to 16, as at initialisation of the real layer.
  A_log = jnp.asarray(np.log(rng.uniform(1.0, 16.0, heads)), jnp.float32)
  dt_bias = 0.5 * normal(heads, kdim)
  # States of the size a unit-norm delta rule produces: entries O(1 / sqrt(K)).
  pool = normal(num_slots, heads, vdim, kdim) / np.sqrt(kdim)
  return [q, k, v, g_raw, beta_raw, A_log, dt_bias], pool.astype(state_dtype)


def _run(args, pool, slots, accepted, *, config, impl, single=False):
  """The kernel on one device (interpret mode keeps per-device barrier state) with a fresh pool copy."""
  dev = jax.devices()[0]
  args = [jax.device_put(a, dev) for a in args]
  slots = jax.device_put(jnp.asarray(slots, jnp.int32), dev)
  accepted = jax.device_put(jnp.asarray(accepted, jnp.int32), dev)
  if single:
    args = [a[:, 0] if i < 5 else a for i, a in enumerate(args)]
    slots, accepted = slots[:, 0], None
  pool = jax.device_put(jnp.array(pool, copy=True), dev)
  o, new_pool = kda_decode_mosaic(*args, pool, slots, accepted, config=config, interpret=impl == "interpret")
  if single:
    o = o[:, None]
  return np.asarray(o.astype(jnp.float32)), new_pool


def _check(o, new_pool, o_ref, pool_ref, pool, *, vdim, dtype, state_dtype, untouched):
  n, steps, heads = o_ref.shape[:3]
  assert o.shape == (n, steps, heads, vdim)
  assert new_pool.shape == pool.shape and new_pool.dtype == jnp.dtype(state_dtype)
  if state_dtype == jnp.float32 and dtype == jnp.float32:
    # f32 arithmetic on O(1) values over a handful of length-K reductions: ~1e-6; 2e-5 leaves room.
    tol = dict(rtol=2e-5, atol=2e-5)
  else:
    # One bf16 rounding of the state per token (and of o / the inputs for bf16 data): 2^-8 relative;
    # f32 and float64 may round a value to neighbouring bf16 numbers, so allow ~2 ulp of O(1) values.
    tol = dict(rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(o, o_ref, **tol)
  np.testing.assert_allclose(np.asarray(new_pool.astype(jnp.float32)), pool_ref.astype(np.float32), **tol)
  idx = jnp.asarray(untouched)
  np.testing.assert_array_equal(np.asarray(new_pool[idx]), np.asarray(pool[idx]))


@pytest.mark.parametrize("lower_bound, state_dtype, dtype, kdim, vdim", [
    (None, jnp.float32, jnp.float32, 64, 64),
    (LB, jnp.bfloat16, jnp.bfloat16, 32, 128),  # two V-blocks; a 64-byte-row bf16 state tile
])
def test_single_token_matches_oracle(kernel_impl, lower_bound, state_dtype, dtype, kdim, vdim):
  heads, num_slots = 2, 6
  args, pool = _inputs(0, 3, 1, heads, kdim, vdim, num_slots, dtype, state_dtype)
  slots = np.asarray([[4], [-1], [1]])  # the -1 row outputs 0 and touches nothing
  pool = pool.at[jnp.asarray([0, 2, 3, 5])].set(POISON)
  config = KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl=kernel_impl)
  o, new_pool = _run(args, pool, slots, [1, 1, 1], config=config, impl=kernel_impl, single=True)
  o_ref, pool_ref = _oracle(*args, pool, slots, [1, 1, 1], lower_bound=lower_bound,
                            state_dtype=ml_dtypes.bfloat16 if state_dtype == jnp.bfloat16 else np.float32)
  np.testing.assert_array_equal(o[1], 0.0)
  _check(o, new_pool, o_ref, pool_ref, pool, vdim=vdim, dtype=dtype, state_dtype=state_dtype,
         untouched=[0, 2, 3, 5])


@pytest.mark.parametrize("lower_bound, state_dtype", [(LB, jnp.float32), (None, jnp.bfloat16)])
def test_speculative_matches_oracle(kernel_impl, lower_bound, state_dtype):
  heads, kdim, vdim, num_slots = 2, 64, 64, 12
  args, pool = _inputs(1, 3, 3, heads, kdim, vdim, num_slots, state_dtype=state_dtype)
  # Row 0 resumes from its 2nd column; row 1's read slot is -1 (padding); row 2 skips writing column 1.
  slots = np.asarray([[0, 1, 2], [-1, 4, 5], [6, -1, 8]])
  accepted = [2, 1, 3]
  untouched = [3, 4, 5, 7, 9, 10, 11]
  pool = pool.at[jnp.asarray(untouched)].set(POISON)
  config = KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl=kernel_impl)
  o, new_pool = _run(args, pool, slots, accepted, config=config, impl=kernel_impl)
  o_ref, pool_ref = _oracle(*args, pool, slots, accepted, lower_bound=lower_bound,
                            state_dtype=ml_dtypes.bfloat16 if state_dtype == jnp.bfloat16 else np.float32)
  np.testing.assert_array_equal(o[1], 0.0)
  _check(o, new_pool, o_ref, pool_ref, pool, vdim=vdim, dtype=jnp.float32, state_dtype=state_dtype,
         untouched=untouched)


@pytest.mark.parametrize("lower_bound", [None, LB])
def test_decode_steps_continue_a_longer_recurrence(kernel_impl, lower_bound):
  """The state after T - j tokens followed by j kernel decode steps equals the recurrence over T tokens."""
  heads, kdim, vdim, total, j = 2, 64, 64, 6, 2
  args, pool = _inputs(2, 1, total, heads, kdim, vdim, 2)
  pool = pool.at[1].set(0.0)  # the prefix starts from zero; slot 0 stays as it is
  slots_all = np.asarray([[1] * total])
  o_ref, pool_ref = _oracle(*args, pool, slots_all, [1], lower_bound=lower_bound, state_dtype=np.float32)
  _, prefix_pool = _oracle(*[a[:, :total - j] if i < 5 else a for i, a in enumerate(args)], pool,
                           slots_all[:, :total - j], [1], lower_bound=lower_bound, state_dtype=np.float32)
  config = KdaConfig(lower_bound=lower_bound, impl=kernel_impl)
  state = jnp.asarray(prefix_pool)
  for t in range(total - j, total):
    o, state = _run([a[:, t:t + 1] if i < 5 else a for i, a in enumerate(args)], state, [[1]], [1],
                    config=config, impl=kernel_impl, single=True)
    # f32 kernel vs float64 over 6 tokens: same budget as a single step.
    np.testing.assert_allclose(o[:, 0], o_ref[:, t], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(state), pool_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(state[0]), np.asarray(pool[0]))


@pytest.mark.parametrize("single, lower_bound, state_dtype, dtype", [
    (True, None, jnp.float32, jnp.bfloat16), (False, LB, jnp.bfloat16, jnp.bfloat16),
    (True, LB, jnp.bfloat16, jnp.float32), (False, None, jnp.float32, jnp.float32)])
def test_lowers_for_cuda(single, lower_bound, state_dtype, dtype):
  """Mosaic GPU lowering and layout inference of each config at the real head size, on the CPU."""
  steps = 1 if single else 3
  args, pool = _inputs(3, 4, steps, 3, 128, 128, 16, dtype, state_dtype)
  slots = jnp.arange(4 * steps, dtype=jnp.int32).reshape(4, steps)
  accepted = jnp.ones((4,), jnp.int32)
  if single:
    args = [a[:, 0] if i < 5 else a for i, a in enumerate(args)]
    slots, accepted = slots[:, 0], None
  config = KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl="pallas")
  f = functools.partial(kda_decode_mosaic, config=config, interpret=False)
  text = jax.jit(f).trace(*args, pool, slots, accepted).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_rejects_unsupported_head_sizes():
  args, pool = _inputs(4, 1, 1, 1, 64, 32, 2)
  with pytest.raises(NotImplementedError, match="V % 64 == 0 and K % 8 == 0, got V=32, K=64"):
    kda_decode_mosaic(*[a[:, 0] if i < 5 else a for i, a in enumerate(args)], pool,
                      jnp.asarray([0], jnp.int32), None, config=KdaConfig(impl="interpret"), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("lower_bound, state_dtype", [(None, jnp.float32), (LB, jnp.bfloat16)])
def test_real_sizes_on_gpu(steps, lower_bound, state_dtype):
  n, heads, num_slots = 8, 11, 40
  args, pool = _inputs(5, n, steps, heads, 128, 128, num_slots, jnp.bfloat16, state_dtype)
  slots = np.arange(n * steps).reshape(n, steps)
  slots[3] = -1
  accepted = np.minimum(np.arange(n) % steps + 1, steps)
  untouched = list(range(n * steps, num_slots))
  pool = pool.at[jnp.asarray(untouched)].set(POISON)
  config = KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl="pallas")
  o, new_pool = _run(args, pool, slots, accepted, config=config, impl="pallas", single=steps == 1)
  o_ref, pool_ref = _oracle(*args, pool, slots, accepted, lower_bound=lower_bound,
                            state_dtype=ml_dtypes.bfloat16 if state_dtype == jnp.bfloat16 else np.float32)
  _check(o, new_pool, o_ref, pool_ref, pool, vdim=128, dtype=jnp.bfloat16, state_dtype=state_dtype,
         untouched=untouched)

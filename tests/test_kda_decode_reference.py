"""``kda_decode`` (impl="xla", i.e. ``kda_decode_reference``): one-token and speculative decode on pool slots,
against the float64 oracle of ``pallas_kernels.testing``, against prefill, and against sequential replay."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import KdaConfig, kda_decode, kda_prefill
from pallas_kernels.testing import bits, kda_gate_oracle, kda_gate_params, kda_inputs, kda_recurrence_oracle, rel_rmse

H, K, V, P = 2, 16, 16, 16


def f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def raw_tokens(rng, *lead):
  """Realistic raw decode inputs for ``lead`` token axes (``kda_inputs``), as jnp arrays."""
  return {n: jnp.asarray(x) for n, x in kda_inputs(rng, lead, H, K, V).items()}


def make_pool(rng, live, state_dtype):
  """Pool poisoned with 1e30 (NaN in slot 1) except random states in ``live`` slots."""
  pool = np.full((P, H, V, K), 1e30, np.float32)
  pool[1] = np.nan
  pool[list(live)] = rng.standard_normal((len(live), H, V, K))
  return jnp.asarray(pool, state_dtype)


def make_params(rng):
  A_log, dt_bias = kda_gate_params(rng, H, K, dt_bias_std=0.1)
  return dict(A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias))


def oracle_rows(tok, params, h0, lower_bound):
  """Float64 oracle over the token axis 1 of ``tok`` (rows = sequences): outputs and all states."""
  g = kda_gate_oracle(f64(tok["g_raw"]), f64(params["A_log"]), f64(params["dt_bias"]), lower_bound)
  beta = 1.0 / (1.0 + np.exp(-f64(tok["beta_raw"])))
  return kda_recurrence_oracle(f64(tok["q"]), f64(tok["k"]), f64(tok["v"]), g, beta, K ** -0.5, h0)


def check_untouched(old, new, written):
  for s in range(P):
    if s not in written:
      np.testing.assert_array_equal(bits(new[s]), bits(old[s]), err_msg=f"slot {s} changed")


# f32 pool: one token in f32, a few f32 ulps (2^-23 ~ 1.2e-7) of RMSE ratio vs float64; bound 1e-6. bf16
# pool: the state is rounded to bf16 once (an RMSE ratio of about 2^-9), bound 4e-3; o is computed from the
# f32 state before rounding, so it keeps the f32 bound.
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_decode_one_token_vs_oracle(lower_bound, state_dtype):
  rng = np.random.default_rng(0)
  slots = np.array([2, -1, 7, 0])
  tok, params = raw_tokens(rng, 4), make_params(rng)
  pool = make_pool(rng, [2, 7, 0], state_dtype)
  o, new = kda_decode(**tok, **params, state_pool=pool, state_indices=jnp.asarray(slots, jnp.int32),
                      config=KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl="xla"))
  assert o.shape == (4, H, V) and o.dtype == jnp.float32
  assert new.shape == pool.shape and new.dtype == pool.dtype
  live = slots >= 0
  h0 = f64(pool)[slots[live]]
  o_want, states = oracle_rows({n: x[live][:, None] for n, x in tok.items()}, params, h0, lower_bound)
  assert rel_rmse(o[live], o_want[:, 0]) < 1e-6
  assert rel_rmse(new[slots[live]], states[-1]) < (1e-6 if state_dtype == jnp.float32 else 4e-3)
  np.testing.assert_array_equal(np.asarray(o[~live]), 0.0)
  check_untouched(pool, new, set(slots[live]))


# Prefill of the whole sequences vs prefill of all but the last J tokens followed by J one-token decodes.
# Both sides carry f32 states; the chunked and token forms differ by f32 rounding, bound 5e-5 (RMSE ratio)
# as in test_kda_api.
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prefill_then_decode_equals_prefill(lower_bound):
  rng = np.random.default_rng(1)
  lens, J = (70, 130), 3
  T = sum(lens)
  tok, params = raw_tokens(rng, T), make_params(rng)
  cfg = KdaConfig(lower_bound=lower_bound, impl="xla")
  pool = make_pool(rng, [3], jnp.float32)
  slots = jnp.asarray([3, 5], jnp.int32)
  has = jnp.asarray([True, False])
  o_full, pool_full = kda_prefill(**tok, **params, cu_seqlens=jnp.asarray([0, 70, 200], jnp.int32),
                                  state_pool=pool, state_indices=slots, has_initial_state=has, config=cfg)
  ends = np.cumsum(lens)
  head = np.concatenate([np.arange(e - n, e - J) for n, e in zip(lens, ends)])
  o_head, pool_dec = kda_prefill(**{n: x[head] for n, x in tok.items()}, **params,
                                 cu_seqlens=jnp.asarray([0, 67, 194], jnp.int32), state_pool=pool,
                                 state_indices=slots, has_initial_state=has, config=cfg)
  np.testing.assert_allclose(np.asarray(o_head), np.asarray(o_full[head]), rtol=1e-4, atol=1e-5)
  for j in range(J):
    rows = ends - J + j
    o_j, pool_dec = kda_decode(**{n: x[rows] for n, x in tok.items()}, **params, state_pool=pool_dec,
                               state_indices=slots, config=cfg)
    assert rel_rmse(o_j, np.asarray(o_full[rows])) < 5e-5
  for s in (3, 5):
    assert rel_rmse(pool_dec[s], np.asarray(pool_full[s])) < 5e-5
  check_untouched(pool, pool_dec, {3, 5})


# Row 0 reads column 0, row 1 column 2, row 2 column 0 and skips its -1 column, row 3 is padding (read slot
# -1): output 0 and slots 11..13 untouched.
SPEC_SLOTS = np.array([[0, 2, 3, 4], [5, 6, 7, 8], [9, -1, 10, 14], [15, -1, 11, 12]])
SPEC_ACCEPTED = np.array([1, 3, 1, 2])


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_speculative_equals_sequential_decode(state_dtype):
  """The state after each draft token lands in its column and equals 1 + S one-token decodes (the carry is
  rounded to the pool dtype per token, so this holds for bf16 too); f32 also against the float64 oracle."""
  rng = np.random.default_rng(2)
  N, S1 = SPEC_SLOTS.shape
  tok, params = raw_tokens(rng, N, S1), make_params(rng)
  read = SPEC_SLOTS[np.arange(N), SPEC_ACCEPTED - 1]
  pool = make_pool(rng, [s for s in read if s >= 0], state_dtype)
  cfg = KdaConfig(lower_bound=-5.0, state_dtype=state_dtype, impl="xla")
  o, new = kda_decode(**tok, **params, state_pool=pool, state_indices=jnp.asarray(SPEC_SLOTS, jnp.int32),
                      num_accepted=jnp.asarray(SPEC_ACCEPTED, jnp.int32), config=cfg)
  assert o.shape == (N, S1, H, V) and o.dtype == jnp.float32
  assert new.shape == pool.shape and new.dtype == pool.dtype
  np.testing.assert_array_equal(np.asarray(o[3]), 0.0)
  # Sequential replay: the read slots (rows 0..2) advanced one token at a time.
  seq_pool = pool
  live = read[:3]
  for t in range(S1):
    o_t, seq_pool = kda_decode(**{n: x[:3, t] for n, x in tok.items()}, **params, state_pool=seq_pool,
                               state_indices=jnp.asarray(live, jnp.int32), config=cfg)
    # Same f32 ops on both sides; only XLA's fusion choices differ (f32 rounding; for bf16 a rare 1-ulp flip).
    np.testing.assert_allclose(np.asarray(o[:3, t]), np.asarray(o_t), rtol=1e-5, atol=1e-6)
    for n in range(3):
      if SPEC_SLOTS[n, t] >= 0:
        np.testing.assert_allclose(f64(new[SPEC_SLOTS[n, t]]), f64(seq_pool[live[n]]), rtol=1e-2, atol=1e-5)
  written = {int(s) for s in SPEC_SLOTS[:3].ravel() if s >= 0}
  check_untouched(pool, new, written)
  if state_dtype == jnp.float32:
    o_want, states = oracle_rows({n: x[:3] for n, x in tok.items()}, params, f64(pool)[live], -5.0)
    # f32 token recurrence over 4 tokens: a few f32 ulps, bound 1e-6.
    assert rel_rmse(o[:3], o_want) < 1e-6
    for n in range(3):
      for t in range(S1):
        if SPEC_SLOTS[n, t] >= 0:
          assert rel_rmse(new[SPEC_SLOTS[n, t]], states[t + 1, n]) < 1e-6


def test_speculative_rollback_equals_replaying_accepted_prefix():
  """Verify round 1 writes the state after every draft token; round 2 accepts a prefix of round 1 by reading
  column ``num_accepted - 1``: its outputs/states equal the float64 replay of the accepted prefix followed by
  the round-2 tokens from the original initial state."""
  rng = np.random.default_rng(3)
  N, S1 = 3, 4
  slots = jnp.asarray(np.arange(N * S1).reshape(N, S1), jnp.int32)
  tok1, tok2, params = raw_tokens(rng, N, S1), raw_tokens(rng, N, S1), make_params(rng)
  pool = make_pool(rng, [0, 4, 8], jnp.float32)
  h0 = f64(pool)[[0, 4, 8]]
  cfg = KdaConfig(lower_bound=None, impl="xla")
  _, pool1 = kda_decode(**tok1, **params, state_pool=pool, state_indices=slots,
                        num_accepted=jnp.ones((N,), jnp.int32), config=cfg)
  accepted = np.array([2, 4, 1])  # tokens of round 1 each row keeps
  o2, pool2 = kda_decode(**tok2, **params, state_pool=pool1, state_indices=slots,
                         num_accepted=jnp.asarray(accepted, jnp.int32), config=cfg)
  for n in range(N):
    a = accepted[n]
    replay = {k: np.concatenate([f64(tok1[k][n:n + 1, :a]), f64(tok2[k][n:n + 1])], axis=1) for k in tok1}
    o_want, states = oracle_rows(replay, params, h0[n:n + 1], None)
    # f32 token recurrence over <= 8 tokens: a few f32 ulps, bound 1e-6.
    assert rel_rmse(o2[n], o_want[0, a:]) < 1e-6
    for t in range(S1):
      assert rel_rmse(pool2[int(slots[n, t])], states[a + t + 1, 0]) < 1e-6

"""KDA references (gate, token recurrence, chunked WY) against the float64 NumPy oracles of
``pallas_kernels.testing``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import util
from pallas_kernels.kda import reference as ref
from pallas_kernels.testing import kda_gate_oracle, kda_gate_params, kda_inputs, kda_recurrence_oracle, rel_rmse


_STATIC = ("scale", "l2norm_qk", "lower_bound", "chunk_size")
# Module-level jits so parametrized cases with equal shapes and statics compile once.
recurrent = jax.jit(ref.kda_recurrent_reference, static_argnames=_STATIC[:2])
chunked = jax.jit(ref.kda_chunk_reference, static_argnames=_STATIC)


def make_inputs(seed, B, T, H, K, V, *, lower_bound, raw_gate_scale=1.0, A_log=None):
  """Realistic inputs of the dense references: q, k, v of ``kda_inputs`` (q, k are L2-normalised inside), g
  from the gate formula on ``raw_gate_scale`` times its ``g_raw`` (``A_log`` for every head if given, a small
  centred ``dt_bias``), beta = sigmoid(beta_raw), and an initial state ``[B, H, V, K]``."""
  rng = np.random.default_rng(seed)
  x = kda_inputs(rng, (B, T), H, K, V, g_scale=raw_gate_scale)
  A_log, dt_bias = kda_gate_params(rng, H, K, A_log=A_log, dt_bias_std=0.1)
  g = np.asarray(ref.kda_gate(jnp.asarray(x["g_raw"]), jnp.asarray(A_log), jnp.asarray(dt_bias),
                              lower_bound=lower_bound))
  beta = (1.0 / (1.0 + np.exp(-x["beta_raw"]))).astype(np.float32)
  return x["q"], x["k"], x["v"], g, beta, rng.standard_normal((B, H, V, K)).astype(np.float32)


@pytest.mark.parametrize("lower_bound", [None, -5.0, -0.5])
def test_gate_matches_oracle(lower_bound):
  rng = np.random.default_rng(0)
  H, K = 3, 8
  # Raw gates across both softplus branches (threshold 20) and deep into saturation.
  g_raw = np.concatenate([rng.normal(0, 30, (50, H, K)), np.full((1, H, K), 19.9), np.full((1, H, K), 20.1)])
  g_raw = g_raw.astype(np.float32)
  A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
  dt_bias = (0.1 * rng.standard_normal((H, K))).astype(np.float32)
  got = ref.kda_gate(jnp.asarray(g_raw), jnp.asarray(A_log), jnp.asarray(dt_bias), lower_bound=lower_bound)
  assert got.dtype == jnp.float32 and got.shape == g_raw.shape
  want = kda_gate_oracle(g_raw, A_log, dt_bias, lower_bound)
  # f32 exp/log1p/sigmoid: a few ulps relative. Deep tails (|g| < 1e-12, where f32 sigmoid/softplus lose
  # relative accuracy) are irrelevant next to O(1) decays: atol 1e-12.
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-12)
  assert (np.asarray(got) <= 0).all()
  if lower_bound is not None:
    assert (np.asarray(got) >= lower_bound).all()


# Hand-computed, K = V = 1, scale = 1, no L2 norm, g = log(1/2) both tokens:
#   t=0: beta=1/2, k=1, v=2, q=1:  S = 0*1/2 = 0;   u = 1/2*(2 - 0*1) = 1;      S = 0 + 1*1 = 1;    o = 1*1 = 1
#   t=1: beta=1/4, k=2, v=4, q=3:  S = 1*1/2 = 1/2; u = 1/4*(4 - 1/2*2) = 3/4;  S = 1/2 + 2*3/4 = 2; o = 3*2 = 6
# From S0 = 1 instead:
#   t=0: S = 1/2; u = 1/2*(2 - 1/2) = 3/4; S = 1/2 + 3/4 = 5/4; o = 5/4
#   t=1: S = 5/8; u = 1/4*(4 - 5/8*2) = 11/16; S = 5/8 + 2*11/16 = 2; o = 6
@pytest.mark.parametrize("h0, o_want, s_want", [(None, [1.0, 6.0], 2.0), (1.0, [1.25, 6.0], 2.0)])
@pytest.mark.parametrize("fn", ["recurrent", "chunk"])
def test_hand_computed(fn, h0, o_want, s_want):
  q = jnp.asarray([1.0, 3.0]).reshape(1, 2, 1, 1)
  k = jnp.asarray([1.0, 2.0]).reshape(1, 2, 1, 1)
  v = jnp.asarray([2.0, 4.0]).reshape(1, 2, 1, 1)
  g = jnp.full((1, 2, 1, 1), np.log(0.5), jnp.float32)
  beta = jnp.asarray([0.5, 0.25]).reshape(1, 2, 1)
  init = None if h0 is None else jnp.full((1, 1, 1, 1), h0)
  f = recurrent if fn == "recurrent" else chunked
  o, s = f(q, k, v, g, beta, scale=1.0, initial_state=init, l2norm_qk=False)
  assert o.shape == (1, 2, 1, 1) and o.dtype == jnp.float32
  assert s.shape == (1, 1, 1, 1) and s.dtype == jnp.float32
  # Exact binary fractions; only f32 rounding of exp(log 0.5) remains.
  np.testing.assert_allclose(np.asarray(o).ravel(), o_want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(s).ravel(), [s_want], rtol=1e-6)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_recurrent_vs_oracle(lower_bound):
  B, T, H, K, V = 2, 40, 2, 16, 32
  q, k, v, g, beta, h0 = make_inputs(1, B, T, H, K, V, lower_bound=lower_bound)
  o, s = recurrent(q, k, v, g, beta, initial_state=h0)
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
  assert s.shape == (B, H, V, K) and s.dtype == jnp.float32
  o_want, states = kda_recurrence_oracle(q, k, v, g, beta, K ** -0.5, h0)
  # f32 token recurrence: errors stay at a few f32 ulps (2^-23 ~ 1.2e-7); bound 1e-6.
  assert rel_rmse(o, o_want) < 1e-6
  assert rel_rmse(s, states[-1]) < 1e-6


# (lower_bound, raw-gate scale, A_log, tolerance): RMSE ratios (o and state) vs the float64 oracle and vs the
# f32 token recurrence. The chunked WY form differs from them by f32 rounding only: 2e-5 for normal gates and
# for saturated lb=-5 gates (g ~ -5 per token, 462 powers of two per chunk). The saturated softplus case
# (A_log = log 16, 30x raw gates, per-token g down to ~-1100) mixes fully decayed channels with undecayed
# ones, which conditions the f32 WY solve worse: 3e-4. The same algorithm in float64 agrees with the oracle
# to float64 rounding, so the gap is f32 rounding, not the algorithm.
GATE_CASES = [
    pytest.param(None, 1.0, None, 2e-5, id="softplus"),
    pytest.param(-5.0, 1.0, None, 2e-5, id="lb-5"),
    pytest.param(None, 30.0, float(np.log(16.0)), 3e-4, id="softplus-saturated"),
    pytest.param(-5.0, 30.0, None, 2e-5, id="lb-5-saturated"),
]


@pytest.mark.parametrize("lower_bound, raw_gate_scale, A_log, tol", GATE_CASES)
def test_chunk_vs_recurrent(lower_bound, raw_gate_scale, A_log, tol):
  B, T, H, K, V = 2, 200, 2, 16, 32  # T = 3 full chunks + a partial one
  q, k, v, g, beta, h0 = make_inputs(2, B, T, H, K, V, lower_bound=lower_bound, raw_gate_scale=raw_gate_scale,
                                     A_log=A_log)
  if raw_gate_scale > 1:
    assert g.min() < -100 or lower_bound is not None  # the case really saturates
  o, s = chunked(q, k, v, g, beta, initial_state=h0, lower_bound=lower_bound)
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
  assert s.shape == (B, H, V, K) and s.dtype == jnp.float32
  o_rec, s_rec = recurrent(q, k, v, g, beta, initial_state=h0)
  o_want, states = kda_recurrence_oracle(q, k, v, g, beta, K ** -0.5, h0)
  assert rel_rmse(o, o_want) < tol
  assert rel_rmse(s, states[-1]) < tol
  assert rel_rmse(o, o_rec) < tol
  assert rel_rmse(s, s_rec) < tol


def test_saturated_case_defeats_a_shared_anchor():
  """The saturated softplus inputs of ``test_chunk_vs_recurrent`` really need per-pair diagonal blocks: a
  single midpoint anchor over one 16-token block already overflows f32 on them."""
  g = make_inputs(2, 2, 200, 2, 16, 32, lower_bound=None, raw_gate_scale=30.0, A_log=float(np.log(16.0)))[3]
  G = np.cumsum(g[0, :16], axis=0, dtype=np.float32) * np.float32(util.LOG2E)
  with np.errstate(over="ignore"):
    assert not np.isfinite(np.exp2(G[8] - G)).all()

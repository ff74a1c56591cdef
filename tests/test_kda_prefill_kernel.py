"""KDA prefill kernel (Pallas Mosaic GPU): interpret mode on CPU, compiled on a Hopper GPU (``gpu`` marker).

Every case checks the kernel against an independent float64 NumPy token recurrence written here (the pool
semantics included) and against ``impl="xla"``.

Tolerances (RMSE of the difference / RMS of the oracle, over all of ``o`` and over every written slot):
the kernel feeds bf16 operands to the tensor cores (q̂, k̂, the decay-scaled tiles, W, U, A, E and the
state stash are rounded to bf16 once each, accumulation in f32), so its error against float64 is set by
bf16 rounding (2^-9 relative per operand, measured 3-4.5e-3 on these problems). With an f32 pool we
accept 1e-2 (vLLM's bar for its FlashKDA path); with a bf16 pool the state is additionally rounded at each
read/write (2^-9), measured about the same, and we accept 2e-2 (tighter than the 3e-2 of bf16-state paths).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import prefill_kernel
from pallas_kernels.testing import kda_gate_params, rel_rmse

SMALL = dict(lens=(70, 0, 30), H=1, K=64, V=64)
LARGE = dict(lens=(0, 1, 63, 64, 65, 1300), H=4, K=128, V=128)
TOL = {jnp.dtype(jnp.float32): 1e-2, jnp.dtype(jnp.bfloat16): 2e-2}
POISON = 1e30


def _problem(seed: int, lens, H: int, K: int, V: int, *, saturated: bool, state_dtype, lower_bound):
  """Realistic raw inputs: q/k/v/g_raw/beta_raw random, A_log = log U(1, 16), dt_bias from dt in
  [1e-3, 1e-1] (FLA's init); ``saturated`` pushes the gate to its extreme (lb per token, or a softplus
  decay of tens per token)."""
  rng = np.random.default_rng(seed)
  T = int(sum(lens))
  f = lambda *s: rng.normal(size=s).astype(np.float32)
  g_raw = f(T, H, K) * 2 + (3.0 if saturated else 0.0)
  x = dict(q=f(T, H, K), k=f(T, H, K), v=f(T, H, V), g_raw=g_raw, beta_raw=f(T, H))
  x["A_log"], x["dt_bias"] = kda_gate_params(rng, H, K)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  N = len(lens)
  # Slots: sequence n writes slot n + 1 (slot 0 stays untouched); the last non-empty sequence uses -1,
  # the first has no initial state; checkpoints at every multiple of 64 go to fresh slots, plus one
  # checkpoint with slot -1.
  slots = np.arange(1, N + 1, dtype=np.int32)
  nonempty = [n for n in range(N) if lens[n] > 0] or [0]
  slots[nonempty[-1]] = -1
  has = np.ones(N, bool)
  has[nonempty[0]] = False
  offsets, ck_slots, indptr = [], [], [0]
  nxt = N + 1
  for n in range(N):
    for off in range(64, lens[n] + 1, 64 * max(1, lens[n] // 192)):
      offsets.append(off)
      ck_slots.append(nxt)
      nxt += 1
    if lens[n] >= 64 and n == nonempty[0]:
      offsets.append(64)
      ck_slots.append(-1)
    indptr.append(len(offsets))
  P = nxt + 1
  pool = (rng.normal(size=(P, H, V, K)) * 0.3).astype(np.float32)
  written = set(slots[slots >= 0].tolist()) | set(c for c in ck_slots if c >= 0)
  for p in range(P):
    if p not in written:
      pool[p] = POISON
  for n in range(N):
    if lens[n] == 0 and slots[n] >= 0:
      pool[slots[n]] = rng.normal(size=(H, V, K))
  arrays = dict(cu_seqlens=cu, state_indices=slots, has_initial_state=has,
                checkpoint_indptr=np.asarray(indptr, np.int32), checkpoint_offsets=np.asarray(offsets, np.int32),
                checkpoint_slots=np.asarray(ck_slots, np.int32))
  config = dict(lower_bound=lower_bound, state_dtype=state_dtype)
  return x, pool, arrays, config


def _to_jax(x, pool, arrays, state_dtype, in_dtype=jnp.bfloat16):
  inputs = {n: jnp.asarray(a, in_dtype) for n, a in x.items() if n not in ("A_log", "dt_bias")}
  inputs.update(A_log=jnp.asarray(x["A_log"]), dt_bias=jnp.asarray(x["dt_bias"]))
  return inputs, jnp.asarray(pool, state_dtype), {n: jnp.asarray(a) for n, a in arrays.items()}


def _run(inputs, pool, arrays, impl: str, **config):
  args = [inputs[n] for n in ("q", "k", "v", "g_raw", "beta_raw")]
  return kda.kda_prefill(*args, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], state_pool=pool,
                         config=kda.KdaConfig(impl=impl, **config), **arrays)


def _oracle(inputs, pool, arrays, *, lower_bound, scale=None):
  """float64 token recurrence over the packed sequences, with the pool semantics."""
  x = {n: np.asarray(a, np.float64) for n, a in inputs.items()}
  pool = np.asarray(pool, np.float64)
  a = {n: np.asarray(v) for n, v in arrays.items()}
  T, H, K = x["q"].shape
  scale = K ** -0.5 if scale is None else scale
  l2 = lambda y: y / np.sqrt(np.sum(y * y, -1, keepdims=True) + 1e-6)
  q, k = l2(x["q"]), l2(x["k"])
  z = x["g_raw"] + x["dt_bias"]
  rate = np.exp(x["A_log"])[:, None]
  if lower_bound is None:
    g = -rate * np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))
  else:
    g = lower_bound / (1 + np.exp(-rate * z))
  beta = 1 / (1 + np.exp(-x["beta_raw"]))
  o = np.zeros(x["v"].shape)
  new = pool.copy()
  cu = a["cu_seqlens"]
  for n in range(len(cu) - 1):
    slot = a["state_indices"][n]
    S = pool[slot].copy() if slot >= 0 and a["has_initial_state"][n] else np.zeros(new.shape[1:])
    ck = {}
    for m in range(a["checkpoint_indptr"][n], a["checkpoint_indptr"][n + 1]):
      ck.setdefault(int(a["checkpoint_offsets"][m]), []).append(int(a["checkpoint_slots"][m]))
    for t in range(cu[n], cu[n + 1]):
      S = S * np.exp(g[t])[:, None, :]
      u = beta[t][:, None] * (x["v"][t] - np.einsum("hvk,hk->hv", S, k[t]))
      S = S + u[:, :, None] * k[t][:, None, :]
      o[t] = scale * np.einsum("hvk,hk->hv", S, q[t])
      for dst in ck.get(t + 1 - cu[n], []):
        if dst >= 0:
          new[dst] = S
    if slot >= 0 and (cu[n + 1] > cu[n] or not a["has_initial_state"][n]):
      new[slot] = S
  return o, new


def _check(o, new_pool, ref_o, ref_pool, pool_in, arrays, tol, T, H, V):
  assert o.shape == (T, H, V) and new_pool.shape == pool_in.shape and new_pool.dtype == pool_in.dtype
  o64, new64, in64 = (np.asarray(a, np.float64) for a in (o, new_pool, pool_in))
  assert np.isfinite(o64).all()
  assert rel_rmse(o64, ref_o) < tol, rel_rmse(o64, ref_o)
  slots = arrays["state_indices"]
  written = set(slots[(slots >= 0) & ((np.diff(arrays["cu_seqlens"]) > 0) | ~arrays["has_initial_state"])].tolist())
  written |= set(int(c) for c in arrays["checkpoint_slots"] if c >= 0)
  for p in range(pool_in.shape[0]):
    if p in written:
      assert rel_rmse(new64[p], ref_pool[p]) < tol, (p, rel_rmse(new64[p], ref_pool[p]))
    else:  # untouched (poisoned, or the slot of an empty sequence with an initial state): bitwise unchanged
      np.testing.assert_array_equal(np.asarray(new_pool[p]).view(np.uint8), np.asarray(pool_in[p]).view(np.uint8))


CASES = [pytest.param(SMALL, id="small"), pytest.param(LARGE, id="large", marks=pytest.mark.gpu)]
GATES = [pytest.param(-5.0, jnp.float32, False, id="lb-f32state"),
         pytest.param(None, jnp.bfloat16, True, id="softplus-bf16state-saturated")]
GATES_GPU = [pytest.param(-5.0, jnp.bfloat16, True, id="lb-bf16state-saturated", marks=pytest.mark.gpu),
             pytest.param(None, jnp.float32, False, id="softplus-f32state", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("lower_bound,state_dtype,saturated", GATES + GATES_GPU)
@pytest.mark.parametrize("sizes", CASES)
def test_prefill_matches_oracle_and_xla(kernel_impl, sizes, lower_bound, state_dtype, saturated):
  x, pool, arrays, config = _problem(0, saturated=saturated, state_dtype=state_dtype, lower_bound=lower_bound,
                                     **sizes)
  inputs, pool_j, arrays_j = _to_jax(x, pool, arrays, state_dtype)
  o, new_pool = _run(inputs, pool_j, arrays_j, kernel_impl, **config)
  assert o.dtype == jnp.bfloat16
  ref_o, ref_pool = _oracle(inputs, pool_j, arrays, lower_bound=lower_bound)
  T, H, _ = x["v"].shape
  tol = TOL[jnp.dtype(state_dtype)]
  _check(o, new_pool, ref_o, ref_pool, pool_j, arrays, tol, T, H, sizes["V"])
  xo, xpool = _run(inputs, pool_j, arrays_j, "xla", **config)
  _check(o, new_pool, np.asarray(xo, np.float64), np.asarray(xpool, np.float64), pool_j, arrays, tol, T, H,
         sizes["V"])


def test_deterministic_and_shorter_than_a_chunk(kernel_impl):
  """Two runs are bitwise equal; T < 64 (one partial chunk per sequence, an empty sequence in between)."""
  x, pool, arrays, config = _problem(1, lens=(5, 0, 20), H=1, K=64, V=64, saturated=False,
                                     state_dtype=jnp.float32, lower_bound=-5.0)
  inputs, pool_j, arrays_j = _to_jax(x, pool, arrays, jnp.float32)
  o1, p1 = _run(inputs, pool_j, arrays_j, kernel_impl, **config)
  o2, p2 = _run(inputs, pool_j, arrays_j, kernel_impl, **config)
  np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
  np.testing.assert_array_equal(np.asarray(p1), np.asarray(p2))
  ref_o, ref_pool = _oracle(inputs, pool_j, arrays, lower_bound=-5.0)
  _check(o1, p1, ref_o, ref_pool, pool_j, arrays, TOL[jnp.dtype(jnp.float32)], 25, 1, 64)


@pytest.mark.parametrize("lens", [(0, 70, 0), (0, 0, 0)], ids=["some-tokens", "no-tokens"])
def test_empty_sequences_write_zero_states(kernel_impl, lens):
  """A length-0 sequence without an initial state writes the state of zero tokens from a zero start (zeros)
  into its slot, one with an initial state leaves its slot bitwise unchanged; as impl="xla"."""
  x, pool, arrays, config = _problem(4, lens=lens, H=1, K=64, V=64, saturated=False, state_dtype=jnp.float32,
                                     lower_bound=None)
  arrays.update(state_indices=np.asarray([1, 2, 3], np.int32), has_initial_state=np.asarray([False, True, False]))
  pool[1:4] = np.random.default_rng(4).uniform(-4.0, 4.0, size=pool[1:4].shape)
  inputs, pool_j, arrays_j = _to_jax(x, pool, arrays, jnp.float32)
  o, new_pool = _run(inputs, pool_j, arrays_j, kernel_impl, **config)
  np.testing.assert_array_equal(np.asarray(new_pool[np.asarray([1, 3])]), 0.0)
  ref_o, ref_pool = _oracle(inputs, pool_j, arrays, lower_bound=None)
  _check(o, new_pool, ref_o, ref_pool, pool_j, arrays, TOL[jnp.dtype(jnp.float32)], sum(lens), 1, 64)
  xo, xpool = _run(inputs, pool_j, arrays_j, "xla", **config)
  np.testing.assert_array_equal(np.asarray(xpool[np.asarray([1, 3])]), 0.0)


def test_prefix_identity(kernel_impl):
  """prefill(tokens[:128]) with a checkpoint, then prefill(tokens[128:]) from that slot == prefill(tokens):
  chunk boundaries coincide and an f32 checkpoint is the exact state, so the match is bitwise."""
  x, pool, _, _ = _problem(2, lens=(150,), H=1, K=64, V=64, saturated=False, state_dtype=jnp.float32,
                           lower_bound=-5.0)
  pool[:] = 0.0
  inputs, pool_j, _ = _to_jax(x, pool, {}, jnp.float32)
  i32 = lambda *v: jnp.asarray(v, jnp.int32)
  full = dict(cu_seqlens=i32(0, 150), state_indices=i32(0), has_initial_state=jnp.asarray([False]),
              checkpoint_indptr=i32(0, 1), checkpoint_offsets=i32(128), checkpoint_slots=i32(1))
  o_full, pool_full = _run(inputs, pool_j, full, kernel_impl, lower_bound=-5.0)
  tail_inputs = {n: (a[128:] if a.ndim and a.shape[0] == 150 else a) for n, a in inputs.items()}
  tail = dict(cu_seqlens=i32(0, 22), state_indices=i32(1), has_initial_state=jnp.asarray([True]))
  o_tail, pool_tail = _run(tail_inputs, pool_full, tail, kernel_impl, lower_bound=-5.0)
  np.testing.assert_array_equal(np.asarray(o_tail, np.float32), np.asarray(o_full[128:], np.float32))
  np.testing.assert_array_equal(np.asarray(pool_tail[1]), np.asarray(pool_full[0]))


@pytest.mark.parametrize("K,V", [(96, 128), (128, 96)])
def test_unsupported_head_dims(K, V):
  z = jnp.zeros((64, 1, K), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="K must be|V must be"):
    prefill_kernel.kda_prefill_mosaic(z, z, jnp.zeros((64, 1, V), jnp.bfloat16), z, jnp.zeros((64, 1)),
                                      None, None, None, None, None, None, None, None, None,
                                      config=kda.KdaConfig(impl="interpret"), interpret=True)


@pytest.mark.parametrize("lower_bound,state_dtype,in_dtype", [
    (-5.0, jnp.float32, jnp.bfloat16), (None, jnp.bfloat16, jnp.float32)])
def test_lowers_for_cuda(lower_bound, state_dtype, in_dtype):
  """Mosaic GPU lowering and layout inference of both stages at the model's head size (K = V = 128),
  for sm_90a, on the CPU: catches layout, alignment and shared-memory-size errors without a GPU."""
  x, pool, arrays, config = _problem(3, lens=(130, 0, 70), H=2, K=128, V=128, saturated=False,
                                     state_dtype=state_dtype, lower_bound=lower_bound)
  inputs, pool_j, arrays_j = _to_jax(x, pool, arrays, state_dtype, in_dtype)
  args = [inputs[n] for n in ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias")]
  args += [arrays_j[n] for n in ("cu_seqlens",)] + [pool_j] + [
      arrays_j[n] for n in ("state_indices", "has_initial_state", "checkpoint_indptr", "checkpoint_offsets",
                            "checkpoint_slots")]
  f = functools.partial(prefill_kernel._prefill, config=kda.KdaConfig(impl="pallas", **config),
                        interpret=False)
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))

"""KDA kernel test support shared by the per-kernel tests and the randomized ones: the prefill runner and its
input conversion, the pool checks of both kernels and their tolerances (each derived next to it)."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import kda
from pallas_kernels.testing import rel_rmse

# Prefill tolerances (RMSE of the difference / RMS of the oracle, over all of ``o`` and over every written
# slot): the kernel feeds bf16 operands to the tensor cores (q̂, k̂, the decay-scaled tiles, W, U, A, E and the
# state stash are rounded to bf16 once each, accumulation in f32), so its error against float64 is set by
# bf16 rounding (2^-9 relative per operand, a few of them per output). With an f32 pool we accept 1e-2
# (vLLM's bar for its FlashKDA path); with a bf16 pool the state is additionally rounded at each read/write
# (2^-9), and we accept 2e-2 (tighter than the 3e-2 of bf16-state paths).
PREFILL_TOL = {jnp.dtype(jnp.float32): 1e-2, jnp.dtype(jnp.bfloat16): 2e-2}


def prefill_to_jax(x, pool, arrays, state_dtype, in_dtype=jnp.bfloat16):
  inputs = {n: jnp.asarray(a, in_dtype) for n, a in x.items() if n not in ("A_log", "dt_bias")}
  inputs.update(A_log=jnp.asarray(x["A_log"]), dt_bias=jnp.asarray(x["dt_bias"]))
  return inputs, jnp.asarray(pool, state_dtype), {n: jnp.asarray(a) for n, a in arrays.items()}


def run_prefill(inputs, pool, arrays, impl: str, **config):
  args = [inputs[n] for n in ("q", "k", "v", "g_raw", "beta_raw")]
  return kda.kda_prefill(*args, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], state_pool=pool,
                         config=kda.KdaConfig(impl=impl, **config), **arrays)


def check_prefill(o, new_pool, ref_o, ref_pool, pool_in, arrays, tol, T, H, V):
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


def check_decode(o, new_pool, o_ref, pool_ref, pool, *, vdim, dtype, state_dtype, untouched):
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

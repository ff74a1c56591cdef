"""Randomized differential tests of the short-convolution kernels against ``impl="xla"``.

``hypothesis`` draws whole batches: sequence lengths around the conv width (4) and 0, initial-state mixes,
-1 slots, checkpoints (some with slot -1), speculative rows with ``num_accepted`` and padding rows, and both
x / pool dtypes. The pool is filled with random values first; every slot a call does not name must come back
bitwise unchanged. Shapes are small on the CPU (interpret mode) and the model's channel count on a Hopper GPU.

Tolerances are ``F32_TOL`` / ``BF16_TOL`` of the per-kernel tests, from ``short_conv_support``, which derives
them next to each (the same f32 math in another order, rounded once to x's dtype); the pool rows are moved,
never computed, so they must match bitwise. Every comparison fails on NaN.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from pallas_kernels import util
from pallas_kernels.short_conv import ShortConvConfig, short_conv_update
from short_conv_support import (BF16, BF16_TOL, F32, F32_TOL, assert_bitwise_equal, check_prefill, inputs,
                                prefill_both, prefill_inputs)
from support import SEEDS, budget, decode_batches, decode_slots

ON_GPU = util.is_hopper_gpu()
CONV_D = 3 * 4 * 128 if ON_GPU else 256  # short conv channels (a multiple of the kernel's 128)


@st.composite
def conv_batches(draw):
  lens = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 17, 40]), min_size=1, max_size=4))
  N = len(lens)
  has = draw(st.lists(st.booleans(), min_size=N, max_size=N))
  no_slot = draw(st.lists(st.booleans(), min_size=N, max_size=N))
  ckpts = [(n, draw(st.integers(1, L)), draw(st.booleans())) for n, L in enumerate(lens)
           if L and draw(st.booleans())]
  return lens, has, no_slot, ckpts


@budget(cpu=4, gpu=8)
@given(batch=conv_batches(), seed=SEEDS, dtype=st.sampled_from([F32, BF16]), pool_dtype=st.sampled_from([F32, BF16]))
def test_short_conv_prefill(kernel_impl, batch, seed, dtype, pool_dtype):
  lens, has, no_slot, ckpts = batch
  rng = np.random.default_rng(seed)
  N, M = len(lens), len(ckpts)
  P = N + M + 2
  perm = rng.permutation(P)
  slots = [-1 if s else int(p) for s, p in zip(no_slot, perm[:N])]
  ck = [(n, off, -1 if minus_one else int(p)) for (n, off, minus_one), p in zip(ckpts, perm[N:])]
  x, weight, pool, cu = prefill_inputs(seed, lens, CONV_D, P, dtype, pool_dtype)
  written = {s for n, s in enumerate(slots) if s >= 0 and (lens[n] or not has[n])} | {c[2] for c in ck if c[2] >= 0}
  ref, out = prefill_both(x, weight, pool, cu, slots, has, ck or None, impl=kernel_impl)
  assert np.isfinite(out[0].astype(np.float32)).all()
  check_prefill(ref, out, dtype=dtype, untouched=[p for p in range(P) if p not in written], pool=pool)


@budget(cpu=4, gpu=8)
@given(batch=decode_batches(), seed=SEEDS, dtype=st.sampled_from([F32, BF16]), pool_dtype=st.sampled_from([F32, BF16]))
def test_short_conv_update(kernel_impl, batch, seed, dtype, pool_dtype):
  N, S, accepted, padding, skipped = batch
  rng = np.random.default_rng(seed)
  cols = 1 if S is None else 1 + S
  P, slots = decode_slots(rng, N, cols, accepted, padding, skipped)
  x, weight, pool = inputs(seed, N, cols, CONV_D, P, dtype, pool_dtype)
  squeeze = (lambda a: a[:, 0]) if S is None else (lambda a: a)
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray(squeeze(slots)),
            num_accepted=None if S is None else jnp.asarray(accepted, jnp.int32))
  (y_ref, p_ref), (y, p) = (short_conv_update(jnp.asarray(squeeze(x)), jnp.asarray(weight), **kw,
                                              config=ShortConvConfig(impl=impl)) for impl in ("xla", kernel_impl))
  y, y_ref = (np.asarray(a, np.float32) for a in (y, y_ref))
  assert np.isfinite(y).all() and np.isfinite(y_ref).all()
  np.testing.assert_allclose(y, y_ref, **(F32_TOL if dtype == F32 else BF16_TOL))
  assert_bitwise_equal(p, p_ref)
  read = slots[np.arange(N), np.asarray(accepted) - 1]
  written = set(slots[read >= 0].reshape(-1).tolist())
  untouched = [s for s in range(P) if s not in written]
  assert_bitwise_equal(np.asarray(p)[untouched], pool[untouched])

"""Randomized differential tests of the KDA and short-convolution kernels against ``impl="xla"``.

``hypothesis`` draws whole batches: sequence lengths around the chunk (64) and sub-block (16) edges and 0,
initial-state mixes, -1 slots, checkpoint CSR patterns, speculative rows with ``num_accepted`` and padding
rows, both gates (Kimi-Linear softplus and the K3 lower bound), both state dtypes, and extreme but valid
gates (``A_log`` up to 20, spiky ``g_raw``). Inputs are realistic (never zeros; q/k are L2-normalised
inside the ops). The pool is filled with random values first; every slot a call does not name must come
back bitwise unchanged, every written slot must match the reference. Shapes are small on the CPU
(interpret mode) and the model's head size on a Hopper GPU.

Tolerances are those of the per-kernel tests, whose module docstrings derive them: ``PREFILL_TOL`` (RMSE
ratio; the prefill kernel feeds bf16 operands to the tensor cores), the decode kernel's ``_check`` (f32
arithmetic as the reference; one bf16 rounding per token with a bf16 state) and the short convolution's
``F32_TOL`` / ``BF16_TOL`` (the same f32 math in another order, rounded once to x's dtype; its pool rows
are moved, never computed, so they must match bitwise). Every comparison fails on NaN.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, strategies as st

from pallas_kernels import util
from pallas_kernels.kda import KdaConfig, kda_decode
from pallas_kernels.kda.short_conv import short_conv_update
from pallas_kernels.testing import kda_gate_params
from support import budget
from test_kda_decode_kernel import _check as _check_decode
from test_kda_prefill_kernel import TOL as PREFILL_TOL, _check as _check_prefill_pool, _run as _run_prefill, _to_jax
from test_short_conv_kernel import (BF16, BF16_TOL, F32, F32_TOL, _assert_bitwise_equal, _check_prefill, _inputs,
                                    _prefill_both, _prefill_inputs)

ON_GPU = util.is_hopper_gpu()
# (H, K = V): small in interpret mode, the model's head size compiled.
HEADS, HEAD_DIM = (4, 128) if ON_GPU else (1, 64)
CONV_D = 3 * 4 * 128 if ON_GPU else 256  # short conv channels (a multiple of the kernel's 128)
C = 64
# Around 0, the 16-token sub-block and the 64-token chunk; longer ones only where they are cheap.
LENGTHS = [0, 1, 2, 15, 16, 17, 63, 64, 65] + ([127, 128, 129, 300] if ON_GPU else [100])
SEEDS = st.integers(0, 2**31 - 1)


def _gate_params(rng: np.random.Generator, kind: str, H: int, K: int) -> tuple[np.ndarray, np.ndarray]:
  """``A_log [H]`` and ``dt_bias [H, K]``: the model's init, or an extreme rate (``A_log`` 16 or 20: decays
  of 1e4 per token and more with the softplus gate)."""
  return kda_gate_params(rng, H, K, A_log={"init": None, "A_log=16": 16.0, "A_log=20": 20.0}[kind])


def _raw_tokens(rng: np.random.Generator, lead: tuple[int, ...], H: int, K: int, V: int, spiky: bool) -> dict:
  """Raw q, k, v, g_raw, beta_raw (f32, unit normal); ``spiky``: a few tokens with g_raw = 1e5."""
  f = lambda *s: rng.standard_normal(lead + s).astype(np.float32)
  x = dict(q=f(H, K), k=f(H, K), v=f(H, V), g_raw=f(H, K), beta_raw=f(H))
  flat = x["g_raw"].reshape((-1, H, K))
  if spiky and flat.shape[0]:
    flat[rng.choice(flat.shape[0], size=min(3, flat.shape[0]), replace=False)] = 1e5
  return x


GATES = st.sampled_from([None, -5.0, -1.0])
GATE_KINDS = st.sampled_from(["init", "init", "A_log=16", "A_log=20"])
STATE_DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])


@st.composite
def prefill_batches(draw):
  """A varlen batch: lengths, slots (distinct, some -1), initial-state flags and checkpoints."""
  lens = draw(st.lists(st.sampled_from(LENGTHS), min_size=1, max_size=3))
  N = len(lens)
  has = draw(st.lists(st.booleans(), min_size=N, max_size=N))
  no_slot = draw(st.lists(st.booleans(), min_size=N, max_size=N).map(lambda b: [x and not h for x, h in
                                                                               zip(b, has)]))
  ckpts = [(n, off) for n, L in enumerate(lens) for off in range(C, L + 1, C) if draw(st.booleans())]
  ck_minus_one = draw(st.lists(st.booleans(), min_size=len(ckpts), max_size=len(ckpts)))
  return lens, has, no_slot, ckpts, ck_minus_one


@budget(cpu=4, gpu=8)
@given(batch=prefill_batches(), seed=SEEDS, lower_bound=GATES, gate_kind=GATE_KINDS, spiky=st.booleans(),
       state_dtype=STATE_DTYPES)
# Found by this test: g = -1e13 per token (A_log = 20, g_raw = 1e5) once made the kernel's chunk cumulative
# sums lose every digit of later tokens' gates (NaN and 77% error), until the per-token gate got a floor.
@example(batch=([2, 16, 63], [False, True, False], [True, False, False], [], []), seed=15806, lower_bound=None,
         gate_kind="A_log=20", spiky=True, state_dtype=jnp.bfloat16)
def test_kda_prefill(kernel_impl, batch, seed, lower_bound, gate_kind, spiky, state_dtype):
  lens, has, no_slot, ckpts, ck_minus_one = batch
  rng = np.random.default_rng(seed)
  H, K = HEADS, HEAD_DIM
  N, M = len(lens), len(ckpts)
  P = N + M + 2  # two slots no one names
  perm = rng.permutation(P).astype(np.int32)
  slots = np.where(no_slot, -1, perm[:N]).astype(np.int32)
  ck_slots = np.where(ck_minus_one, -1, perm[N:N + M]).astype(np.int32)
  x = _raw_tokens(rng, (sum(lens),), H, K, K, spiky)
  x["A_log"], x["dt_bias"] = _gate_params(rng, gate_kind, H, K)
  # Random values everywhere: initial states of the size a unit-norm delta rule produces, the rest poison
  # that must not move.
  pool = (rng.standard_normal((P, H, K, K)) * 0.3).astype(np.float32)
  arrays = dict(cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), state_indices=slots,
                has_initial_state=np.asarray(has),
                checkpoint_indptr=np.searchsorted([c[0] for c in ckpts], np.arange(N + 1)).astype(np.int32),
                checkpoint_offsets=np.asarray([c[1] for c in ckpts], np.int32), checkpoint_slots=ck_slots)
  inputs, pool_j, arrays_j = _to_jax(x, pool, arrays, state_dtype)
  config = dict(lower_bound=lower_bound, state_dtype=state_dtype)
  o, new_pool = _run_prefill(inputs, pool_j, arrays_j, kernel_impl, **config)
  xo, xpool = _run_prefill(inputs, pool_j, arrays_j, "xla", **config)
  T = sum(lens)
  xo64, xpool64 = np.asarray(xo, np.float64), np.asarray(xpool, np.float64)
  tol = PREFILL_TOL[jnp.dtype(state_dtype)]
  # The reference itself: finite, its unnamed slots bitwise unchanged; then the kernel against it.
  _check_prefill_pool(xo, xpool, xo64, xpool64, pool_j, arrays, tol, T, H, K)
  _check_prefill_pool(o, new_pool, xo64, xpool64, pool_j, arrays, tol, T, H, K)


@st.composite
def decode_batches(draw):
  """Rows of the one-token (S = None) or speculative (1 + S tokens) form: slots, num_accepted, padding rows."""
  N = draw(st.integers(1, 4))
  S = draw(st.sampled_from([None, 1, 3]))
  cols = 1 if S is None else 1 + S
  accepted = [draw(st.integers(1, cols)) for _ in range(N)]
  padding = draw(st.lists(st.booleans(), min_size=N, max_size=N))  # read slot -1: nothing read or written
  skipped = [[draw(st.booleans()) for _ in range(cols)] for _ in range(N)]  # -1 columns (not the read one)
  return N, S, accepted, padding, skipped


def _decode_slots(rng: np.random.Generator, N: int, cols: int, accepted: list[int], padding: list[bool],
                  skipped: list[list[bool]]) -> tuple[int, np.ndarray]:
  """Pool size ``P`` (two slots more than named) and distinct slots ``[N, cols]``: -1 at padding rows' read
  column and at skipped columns other than the read one."""
  P = N * cols + 2
  slots = rng.permutation(P)[:N * cols].reshape(N, cols).astype(np.int32)
  for n in range(N):
    for t in range(cols):
      if padding[n] and t == accepted[n] - 1 or skipped[n][t] and t != accepted[n] - 1:
        slots[n, t] = -1
  return P, slots


@budget(cpu=4, gpu=8)
@given(batch=decode_batches(), seed=SEEDS, lower_bound=GATES, gate_kind=GATE_KINDS, spiky=st.booleans(),
       state_dtype=STATE_DTYPES)
def test_kda_decode(kernel_impl, batch, seed, lower_bound, gate_kind, spiky, state_dtype):
  N, S, accepted, padding, skipped = batch
  rng = np.random.default_rng(seed)
  H, K = HEADS, HEAD_DIM
  cols = 1 if S is None else 1 + S
  P, slots = _decode_slots(rng, N, cols, accepted, padding, skipped)
  x = _raw_tokens(rng, (N, cols), H, K, K, spiky)
  A_log, dt_bias = _gate_params(rng, gate_kind, H, K)
  pool = jnp.asarray(rng.standard_normal((P, H, K, K)) / np.sqrt(K), state_dtype)
  squeeze = (lambda a: a[:, 0]) if S is None else (lambda a: a)
  args = [jnp.asarray(squeeze(x[n])) for n in ("q", "k", "v", "g_raw", "beta_raw")]
  kw = dict(A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias), state_pool=pool,
            state_indices=jnp.asarray(squeeze(slots)),
            num_accepted=None if S is None else jnp.asarray(accepted, jnp.int32))
  outs = {impl: kda_decode(*args, **kw, config=KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl=impl))
          for impl in ("xla", kernel_impl)}
  (xo, xpool), (o, new_pool) = outs["xla"], outs[kernel_impl]
  read = slots[np.arange(N), np.asarray(accepted) - 1]
  written = set(slots[read >= 0].reshape(-1).tolist()) - {-1}
  untouched = [p for p in range(P) if p not in written]
  as_rows = lambda a: np.asarray(a, np.float32).reshape(N, cols, H, K)
  for got, got_pool in ((xo, xpool), (o, new_pool)):
    assert np.isfinite(as_rows(got)).all() and np.isfinite(np.asarray(got_pool, np.float32)[sorted(written)]).all()
    _check_decode(as_rows(got), got_pool, as_rows(xo), np.asarray(xpool, np.float32), pool, vdim=K,
                  dtype=jnp.float32, state_dtype=state_dtype, untouched=untouched)
  np.testing.assert_array_equal(as_rows(o)[np.asarray(padding) & (read < 0)], 0.0)


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
  x, weight, pool, cu = _prefill_inputs(seed, lens, CONV_D, P, dtype, pool_dtype)
  written = {s for n, s in enumerate(slots) if s >= 0 and (lens[n] or not has[n])} | {c[2] for c in ck if c[2] >= 0}
  ref, out = _prefill_both(x, weight, pool, cu, slots, has, ck or None, impl=kernel_impl)
  assert np.isfinite(out[0].astype(np.float32)).all()
  _check_prefill(ref, out, dtype=dtype, untouched=[p for p in range(P) if p not in written], pool=pool)


@budget(cpu=4, gpu=8)
@given(batch=decode_batches(), seed=SEEDS, dtype=st.sampled_from([F32, BF16]), pool_dtype=st.sampled_from([F32, BF16]))
def test_short_conv_update(kernel_impl, batch, seed, dtype, pool_dtype):
  N, S, accepted, padding, skipped = batch
  rng = np.random.default_rng(seed)
  cols = 1 if S is None else 1 + S
  P, slots = _decode_slots(rng, N, cols, accepted, padding, skipped)
  x, weight, pool = _inputs(seed, N, cols, CONV_D, P, dtype, pool_dtype)
  squeeze = (lambda a: a[:, 0]) if S is None else (lambda a: a)
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray(squeeze(slots)),
            num_accepted=None if S is None else jnp.asarray(accepted, jnp.int32))
  (y_ref, p_ref), (y, p) = (short_conv_update(jnp.asarray(squeeze(x)), jnp.asarray(weight), **kw, impl=impl)
                            for impl in ("xla", kernel_impl))
  y, y_ref = (np.asarray(a, np.float32) for a in (y, y_ref))
  assert np.isfinite(y).all() and np.isfinite(y_ref).all()
  np.testing.assert_allclose(y, y_ref, **(F32_TOL if dtype == F32 else BF16_TOL))
  _assert_bitwise_equal(p, p_ref)
  read = slots[np.arange(N), np.asarray(accepted) - 1]
  written = set(slots[read >= 0].reshape(-1).tolist())
  untouched = [s for s in range(P) if s not in written]
  _assert_bitwise_equal(np.asarray(p)[untouched], pool[untouched])

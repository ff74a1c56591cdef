"""short_conv_prefill / short_conv_update against a float64 NumPy oracle, and against each other; the config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import util
from pallas_kernels.short_conv import (ShortConvConfig, ShortConvTuning, default_tuning, short_conv_prefill,
                                      short_conv_update)
from pallas_kernels.short_conv.config import resolve_tuning

W, D, P = 4, 24, 12
# D = 24 is below the kernel's widths (D % 128): the tests here that name no backend run the XLA one; the
# kernel's are in test_short_conv_kernel.py and the ones parametrized over impl.
XLA = ShortConvConfig(impl="xla")
POISON = 1e30


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _oracle(x, weight, lengths, pool, slots, has_init, ckpts=(), activation="silu"):
  """Float64 loop over sequences. ``ckpts``: (sequence, offset, slot). Returns (y, new pool)."""
  x, w, pool = np.asarray(x, np.float64), np.asarray(weight, np.float64), np.asarray(pool, np.float64)
  new_pool, y, start = pool.copy(), np.zeros_like(x), 0
  hists = []
  for n, length in enumerate(lengths):
    prefix = pool[slots[n]] if has_init[n] and slots[n] >= 0 else np.zeros((W - 1, x.shape[1]))
    hist = np.concatenate([prefix, x[start:start + length]])
    hists.append(hist)
    for t in range(length):
      acc = sum(w[:, i] * hist[t + i] for i in range(W))
      y[start + t] = _silu(acc) if activation == "silu" else acc
    # A length-0 sequence with an initial state keeps its slot; without one it writes its zero history.
    if slots[n] >= 0 and (length > 0 or not has_init[n]):
      new_pool[slots[n]] = hist[length:length + W - 1]
    start += length
  for n, offset, slot in ckpts:
    if slot >= 0:
      new_pool[slot] = hists[n][offset:offset + W - 1]
  return y, new_pool


def _normal(seed, *shape):
  # NumPy draws: eager jax.random compiles one XLA program per shape (seconds per test on CPU).
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _random(seed, t, d=D, dtype=jnp.float32, pool_dtype=jnp.float32):
  # Projection outputs of unit scale; taps of a short conv are O(1/sqrt(W)).
  x = _normal(seed, t, d).astype(dtype)
  weight = (_normal(seed + 100, d, W) / 2).astype(dtype)
  pool = _normal(seed + 200, P, W - 1, d).astype(pool_dtype)
  return x, weight, pool


def _cu(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


# f32 inputs: the only rounding is the f32 sum of W products and the SiLU, ~1e-6 relative at |y| ~ 3.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype, impl", [(jnp.float32, "xla"), (jnp.bfloat16, "xla"),
                                             (jnp.float32, "kernel"), (jnp.bfloat16, "kernel")])
def test_prefill_matches_oracle_varlen_with_checkpoints(pool_dtype, impl, kernel_impl):
  """``impl="kernel"``: the Mosaic GPU kernel (``kernel_impl``: compiled on Hopper, interpret mode elsewhere) at
  D = 256, two channel blocks of 128."""
  lengths = [0, 1, 2, 3, 5, 17, 9]
  slots = [3, 5, -1, 0, 7, 1, 2]
  has_init = [True, True, True, False, True, True, True]
  # (sequence, offset, slot): offsets < W - 1 combine state and new rows; offset == L equals the final state.
  ckpts = [(1, 1, 9), (3, 2, 10), (5, 16, 11), (5, 4, -1), (6, 9, 4)]
  x, weight, pool = _random(1, sum(lengths), d=D if impl == "xla" else 256, pool_dtype=pool_dtype)
  pool = pool.at[jnp.asarray([6, 8])].set(POISON)
  indptr = np.searchsorted([c[0] for c in ckpts], np.arange(len(lengths) + 1), side="left")
  y, new_pool = short_conv_prefill(
      x, weight, cu_seqlens=_cu(lengths), conv_pool=pool, state_indices=jnp.asarray(slots, jnp.int32),
      has_initial_state=jnp.asarray(has_init), checkpoint_indptr=jnp.asarray(indptr, jnp.int32),
      checkpoint_offsets=jnp.asarray([c[1] for c in ckpts], jnp.int32),
      checkpoint_slots=jnp.asarray([c[2] for c in ckpts], jnp.int32),
      config=ShortConvConfig(impl=kernel_impl if impl == "kernel" else impl))
  y_ref, pool_ref = _oracle(x, weight, lengths, np.asarray(pool.astype(jnp.float32)), slots, has_init, ckpts)
  assert y.shape == x.shape and y.dtype == x.dtype
  assert new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
  # The state enters in the pool dtype and is exact in f32 either way, so f32 tolerances hold for bf16 too.
  np.testing.assert_allclose(np.asarray(y), y_ref, **F32_TOL)
  # Conv states are raw rows moved around (rounded once to the pool dtype): exact. The slot of the
  # length-0 sequence (3) and the poisoned untouched slots (6, 8) are bitwise unchanged.
  np.testing.assert_array_equal(np.asarray(new_pool), np.asarray(jnp.asarray(pool_ref, pool_dtype)))
  np.testing.assert_array_equal(np.asarray(new_pool[3]), np.asarray(pool[3]))  # length-0 sequence
  np.testing.assert_array_equal(np.asarray(new_pool[jnp.asarray([6, 8])]), np.asarray(pool[jnp.asarray([6, 8])]))


@pytest.mark.parametrize("lengths", [(0, 5, 0), (0, 0, 0)], ids=["some-tokens", "no-tokens"])
@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_prefill_empty_sequences_write_zero_states(impl, lengths, kernel_impl):
  """A length-0 sequence without an initial state writes the conv state of zero tokens from a zero history
  (zeros) into its slot, as ``kda_prefill``; one with an initial state leaves its slot bitwise unchanged."""
  x, weight, pool = _random(7, sum(lengths), d=256)
  slots, has_init = [1, 2, 3], [False, True, False]
  y, new_pool = short_conv_prefill(x, weight, cu_seqlens=_cu(lengths), conv_pool=pool,
                                   state_indices=jnp.asarray(slots, jnp.int32), has_initial_state=jnp.asarray(has_init),
                                   config=ShortConvConfig(impl=kernel_impl if impl == "kernel" else impl))
  y_ref, pool_ref = _oracle(x, weight, lengths, pool, slots, has_init)
  np.testing.assert_allclose(np.asarray(y), y_ref, **F32_TOL)
  np.testing.assert_array_equal(np.asarray(new_pool[jnp.asarray([1, 3])]), 0.0)
  np.testing.assert_array_equal(np.asarray(new_pool), pool_ref.astype(np.float32))


def test_conv_states_are_the_raw_input_rows_bitwise():
  lengths = [7, 2]
  x, weight, pool = _random(2, 9, dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16)
  _, new_pool = short_conv_prefill(
      x, weight, cu_seqlens=_cu(lengths), conv_pool=pool, state_indices=jnp.asarray([4, 5], jnp.int32),
      has_initial_state=jnp.asarray([True, True]), checkpoint_indptr=jnp.asarray([0, 1, 1], jnp.int32),
      checkpoint_offsets=jnp.asarray([5], jnp.int32), checkpoint_slots=jnp.asarray([6], jnp.int32), config=XLA)
  np.testing.assert_array_equal(np.asarray(new_pool[4]), np.asarray(x[4:7]))
  np.testing.assert_array_equal(np.asarray(new_pool[6]), np.asarray(x[2:5]))
  # Length 2 < W - 1: the newest old row of slot 5 then the two new rows.
  np.testing.assert_array_equal(np.asarray(new_pool[5]),
                                np.concatenate([np.asarray(pool[5, 2:]), np.asarray(x[7:9])]))


def test_prefill_without_activation_and_under_jit():
  lengths = [6, 3]
  x, weight, pool = _random(3, 9)
  slots, has_init = [2, 8], [True, False]
  f = jax.jit(lambda x, cu, s, h: short_conv_prefill(x, weight, cu_seqlens=cu, conv_pool=pool, state_indices=s,
                                                       has_initial_state=h,
                                                       config=ShortConvConfig(activation=None, impl="xla")))
  y, new_pool = f(x, _cu(lengths), jnp.asarray(slots, jnp.int32), jnp.asarray(has_init))
  y_ref, pool_ref = _oracle(x, weight, lengths, pool, slots, has_init, activation=None)
  np.testing.assert_allclose(np.asarray(y), y_ref, **F32_TOL)
  np.testing.assert_array_equal(np.asarray(new_pool), pool_ref.astype(np.float32))


@pytest.mark.parametrize("j", [1, 2, 5])
def test_prefill_equals_shorter_prefill_then_updates(j):
  lengths = [11, 8]
  x, weight, pool = _random(4, sum(lengths))
  slots = jnp.asarray([1, 6], jnp.int32)
  has_init = jnp.asarray([True, False])
  y_full, pool_full = short_conv_prefill(x, weight, cu_seqlens=_cu(lengths), conv_pool=pool,
                                         state_indices=slots, has_initial_state=has_init, config=XLA)
  short = [length - j for length in lengths]
  keep = np.concatenate([np.arange(0, short[0]), np.arange(lengths[0], lengths[0] + short[1])])
  y_part, p = short_conv_prefill(x[keep], weight, cu_seqlens=_cu(short), conv_pool=pool,
                                 state_indices=slots, has_initial_state=has_init, config=XLA)
  ys = [y_part]
  for i in range(j):
    rows = jnp.asarray([short[0] + i, lengths[0] + short[1] + i])
    y_step, p = short_conv_update(x[rows], weight, conv_pool=p, state_indices=slots, config=XLA)
    ys.append(y_step)
  # Same f32 arithmetic on the same rows in both paths: bitwise equal.
  np.testing.assert_array_equal(np.asarray(p), np.asarray(pool_full))
  order = np.concatenate([keep, [short[0] + i for i in range(j)] + [lengths[0] + short[1] + i for i in range(j)]])
  stepped = np.concatenate([np.asarray(ys[0])] + [np.asarray(s)[0:1] for s in ys[1:]]
                           + [np.asarray(s)[1:2] for s in ys[1:]])
  got = np.empty_like(stepped)
  got[order] = stepped
  np.testing.assert_allclose(got, np.asarray(y_full), rtol=1e-6, atol=1e-6)


def test_update_matches_oracle_slot_minus_one_and_poison():
  x, weight, pool = _random(5, 4, pool_dtype=jnp.bfloat16)
  pool = pool.at[jnp.asarray([0, 11])].set(POISON)
  slots = [3, -1, 7, 2]
  y, new_pool = short_conv_update(x, weight, conv_pool=pool, state_indices=jnp.asarray(slots, jnp.int32), config=XLA)
  assert y.shape == (4, D) and y.dtype == jnp.float32 and new_pool.dtype == jnp.bfloat16
  pf = np.asarray(pool.astype(jnp.float32))
  y_ref, pool_ref = _oracle(x, weight, [1] * 4, pf, slots, [True] * 4)
  y_ref[1] = 0.0  # decode: a slot -1 row outputs exactly 0 (prefill instead convolves a zero history)
  np.testing.assert_allclose(np.asarray(y), y_ref, **F32_TOL)
  np.testing.assert_array_equal(np.asarray(new_pool), np.asarray(jnp.asarray(pool_ref, jnp.bfloat16)))
  untouched = jnp.asarray([0, 1, 4, 5, 6, 8, 9, 10, 11])
  np.testing.assert_array_equal(np.asarray(new_pool[untouched]), np.asarray(pool[untouched]))


def test_speculative_rollback_equals_replay_of_accepted_prefix():
  n, steps = 3, 4  # 1 + S = 4
  _, weight, pool = _random(6, 1)
  draft = _normal(60, n, steps, D)
  cols = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], jnp.int32)
  start = jnp.asarray([1, 2, 4], jnp.int32)  # first verify: read column 0, 1, 3
  pool = pool.at[cols[:, 0]].set(pool[cols[0, 0]])  # any valid states in the read columns
  y, p1 = short_conv_update(draft, weight, conv_pool=pool, state_indices=cols, num_accepted=start, config=XLA)
  assert y.shape == draft.shape and y.dtype == draft.dtype
  # Oracle: replay every draft row after the read column's state.
  pf = np.asarray(pool, np.float64)
  for r in range(n):
    read = int(cols[r, start[r] - 1])
    y_ref, replay = _oracle(draft[r], weight, [steps], pf, [read], [True])
    np.testing.assert_allclose(np.asarray(y[r]), y_ref, **F32_TOL)
    np.testing.assert_array_equal(np.asarray(p1[cols[r, -1]]), replay[read].astype(np.float32))
  # Accept a prefix of length a; the next verify reads column a - 1 and must equal a replay of the first a
  # draft tokens followed by the next draft tokens, bitwise.
  accepted = jnp.asarray([1, 3, 4], jnp.int32)
  nxt = _normal(61, n, steps, D)
  y2, p2 = short_conv_update(nxt, weight, conv_pool=p1, state_indices=cols, num_accepted=accepted, config=XLA)
  for r in range(n):
    a = int(accepted[r])
    one = jnp.asarray([cols[r, start[r] - 1]], jnp.int32)
    q = pool
    for t in range(a):
      _, q = short_conv_update(draft[r:r + 1, t], weight, conv_pool=q, state_indices=one, config=XLA)
    ys = []
    for t in range(steps):
      yt, q = short_conv_update(nxt[r:r + 1, t], weight, conv_pool=q, state_indices=one, config=XLA)
      ys.append(yt[0])
    np.testing.assert_allclose(np.asarray(y2[r]), np.stack(ys), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(p2[cols[r, -1]]), np.asarray(q[one[0]]))


def test_speculative_minus_one_read_slot_and_skipped_columns():
  x, weight, pool = _random(7, 1)
  pool = pool.at[:].set(POISON)
  draft = _normal(8, 2, 3, D)
  cols = jnp.asarray([[-1, 1, 2], [3, -1, 5]], jnp.int32)
  pool = pool.at[3].set(x[0, 0])
  y, new_pool = short_conv_update(draft, weight, conv_pool=pool, state_indices=cols,
                                  num_accepted=jnp.asarray([1, 1], jnp.int32), config=XLA)
  np.testing.assert_array_equal(np.asarray(y[0]), 0.0)  # read slot -1: output 0, nothing written
  assert np.isfinite(np.asarray(y[1])).all()
  changed = [3, 5]
  unchanged = [i for i in range(P) if i not in changed]
  np.testing.assert_array_equal(np.asarray(new_pool[jnp.asarray(unchanged)]), np.asarray(pool[jnp.asarray(unchanged)]))
  np.testing.assert_array_equal(np.asarray(new_pool[5]), np.asarray(draft[1]))


def _prefill_args(**over):
  x, weight, pool = _random(9, 6)
  args = dict(x=x, weight=weight, cu_seqlens=_cu([4, 2]), conv_pool=pool,
              state_indices=jnp.asarray([0, 1], jnp.int32), has_initial_state=jnp.asarray([True, True]),
              checkpoint_indptr=jnp.asarray([0, 1, 1], jnp.int32), checkpoint_offsets=jnp.asarray([2], jnp.int32),
              checkpoint_slots=jnp.asarray([5], jnp.int32))
  args.update(over)
  return args


def _call_prefill(args):
  args = dict(args)
  return short_conv_prefill(args.pop("x"), args.pop("weight"), **args)


@pytest.mark.parametrize("over, match", [
    (dict(x=jnp.zeros((6,), jnp.float32)), r"x must have shape \[T, D\], got \(6,\)"),
    (dict(x=jnp.zeros((6, D), jnp.int32)), r"x must have dtype"),
    (dict(weight=jnp.zeros((D, 1))), r"weight must have shape \(24, W\) with W >= 2"),
    (dict(weight=jnp.zeros((D + 1, W))), r"weight must have shape"),
    (dict(conv_pool=jnp.zeros((P, W, D))), r"conv_pool must have shape \(\*, 3, 24\)"),
    (dict(conv_pool=jnp.zeros((P, W - 1, D), jnp.int32)), r"conv_pool must have dtype"),
    (dict(cu_seqlens=jnp.asarray([0, 4, 6], jnp.float32)), r"cu_seqlens must have dtype"),
    (dict(cu_seqlens=jnp.asarray([0, 4, 5], jnp.int32)),
     r"cu_seqlens must be non-decreasing from 0 to T = 6, got \[0, 4, 5\]"),
    (dict(cu_seqlens=jnp.asarray([1, 4, 6], jnp.int32)),
     r"cu_seqlens must be non-decreasing from 0 to T = 6, got \[1, 4, 6\]"),
    (dict(cu_seqlens=jnp.asarray([0, 7, 6], jnp.int32)),
     r"cu_seqlens must be non-decreasing from 0 to T = 6, got \[0, 7, 6\]"),
    (dict(state_indices=jnp.asarray([0], jnp.int32)), r"state_indices must have shape \(2,\)"),
    (dict(state_indices=jnp.asarray([0, P], jnp.int32)),
     r"state_indices must be pool slots in \[-1, 12\) \(-1: none, 12 = conv_pool.shape\[0\]\), "
     r"got values in \[0, 12\]"),
    (dict(state_indices=jnp.asarray([-2, 1], jnp.int32)),
     r"state_indices must be pool slots in \[-1, 12\) .*got values in \[-2, 1\]"),
    (dict(state_indices=jnp.asarray([1, 1], jnp.int32)),
     r"destination slots in state_indices and checkpoint_slots must be distinct \(-1 excepted\), got slots \[1\] "
     r"written more than once"),
    (dict(checkpoint_slots=jnp.asarray([0], jnp.int32)),
     r"destination slots in state_indices and checkpoint_slots must be distinct .*got slots \[0\] written more"),
    (dict(has_initial_state=jnp.asarray([1, 1], jnp.int32)), r"has_initial_state must have dtype"),
    (dict(has_initial_state=jnp.asarray([True])), r"has_initial_state must have shape"),
    (dict(checkpoint_slots=None), r"must be given together, got indptr=True, offsets=True, slots=False"),
    (dict(checkpoint_indptr=jnp.asarray([0, 1], jnp.int32)), r"checkpoint_indptr must have shape \(3,\)"),
    (dict(checkpoint_indptr=jnp.asarray([0, 1, 2], jnp.int32)),
     r"checkpoint_indptr must be non-decreasing from 0 to M = 1 \(len\(checkpoint_offsets\)\), "
     r"got \[0, 1, 2\]"),
    (dict(checkpoint_offsets=jnp.asarray([[2]], jnp.int32)),
     r"checkpoint_offsets must have shape \(\*,\), got \(1, 1\)"),
    (dict(checkpoint_offsets=jnp.asarray([2.0])), r"checkpoint_offsets must have dtype"),
    (dict(checkpoint_offsets=jnp.asarray([5], jnp.int32)),
     r"checkpoint_offsets must be in \(0, L_n\], got offset 5 for a sequence of length 4 \(checkpoint 0\)"),
    (dict(checkpoint_offsets=jnp.asarray([0], jnp.int32)),
     r"checkpoint_offsets must be in \(0, L_n\], got offset 0 for a sequence of length 4"),
    (dict(checkpoint_slots=jnp.asarray([5, 6], jnp.int32)), r"checkpoint_slots must have shape \(1,\)"),
    (dict(checkpoint_slots=jnp.asarray([P], jnp.int32)),
     r"checkpoint_slots must be pool slots in \[-1, 12\) .*got values in \[12, 12\]"),
])
def test_prefill_validation(over, match):
  with pytest.raises(ValueError, match=match):
    _call_prefill(_prefill_args(**over))


@pytest.mark.parametrize("make, match", [
    (lambda: ShortConvConfig(activation="relu"), r"activation must be one of \('silu', None\), got 'relu'"),
    (lambda: ShortConvConfig(impl="triton"), r"impl must be one of \('xla', 'pallas', 'interpret'\), got 'triton'"),
    (lambda: ShortConvConfig(tuning=(1024, 4)), r"tuning must be a ShortConvTuning or None, got \(1024, 4\)"),
    (lambda: ShortConvTuning(block=100), r"block must be one of \(1024, 512, 256, 128\) or None, got 100"),
    (lambda: ShortConvTuning(block=True), r"block must be one of .* or None, got True"),
    (lambda: ShortConvTuning(rows=0), r"rows must be an int >= 1 or None, got 0"),
    (lambda: ShortConvTuning(rows=1.5), r"rows must be an int >= 1 or None, got 1.5"),
    (lambda: ShortConvTuning(rows=True), r"rows must be an int >= 1 or None, got True"),
    (lambda: ShortConvTuning(token_block=24), r"token_block must be one of \(64, 32, 16, 8\) or None, got 24"),
    (lambda: default_tuning(num_rows=-1, channels=D), r"num_rows must be an int >= 0, got -1"),
    (lambda: default_tuning(num_rows=4, channels=0), r"channels must be an int >= 1, got 0"),
    (lambda: default_tuning(num_rows=4.0, channels=D), r"num_rows must be an int >= 0, got 4.0"),
], ids=["activation", "impl", "tuning", "block", "block-bool", "rows-0", "rows-float", "rows-bool", "token_block",
        "num_rows", "channels", "num_rows-float"])
def test_config_validation(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_config_is_a_static_argument():
  """Equal configs hash alike (jit caches on them); the default impl is ``util.default_impl``'s."""
  a = ShortConvConfig(activation=None, impl="xla", tuning=ShortConvTuning(block=256, rows=2))
  b = ShortConvConfig(activation=None, impl="xla", tuning=ShortConvTuning(block=256, rows=2))
  assert a == b and hash(a) == hash(b)
  assert ShortConvConfig().impl == ShortConvConfig(impl=None).impl == util.default_impl()


def test_default_tuning_and_the_fields_a_tuning_sets():
  """Every field set; a tuning's set fields are kept and the others sized for its block (64 rows of 36864
  channels: 36 programs of 1024 channels fill the SMs, one row each; 128-channel blocks need 4 rows each)."""
  assert default_tuning(num_rows=64, channels=36864) == ShortConvTuning(block=1024, rows=1, token_block=8)
  assert resolve_tuning(ShortConvTuning(block=128), num_rows=64, channels=36864) == ShortConvTuning(
      block=128, rows=4, token_block=8)
  assert resolve_tuning(ShortConvTuning(rows=3, token_block=32), num_rows=64, channels=36864) == ShortConvTuning(
      block=1024, rows=3, token_block=32)
  assert resolve_tuning(None, num_rows=64, channels=36864) == default_tuning(num_rows=64, channels=36864)


@pytest.mark.parametrize("x_shape, idx, acc, match", [
    ((3, D), [[0], [1], [2]], None, r"state_indices must have shape \(3,\)"),
    ((3, D), [0, 1, 2], [1, 1, 1],
     r"num_accepted is only for the speculative form \(x of shape \[N, 1 \+ S, \.\.\.\]\), got x of shape \(3, 24\)"),
    ((3, D), [0, 1, P], None, r"state_indices must be pool slots in \[-1, 12\) .*got values in \[0, 12\]"),
    ((3, D), [0, 1, 1], None, r"destination slots in state_indices must be distinct .*got slots \[1\] written more"),
    ((3, 2, D), [[0, 1], [2, 3], [4, 5]], None,
     r"num_accepted \(\[N\] int32/int64\) is required with the speculative form, got x of shape \(3, 2, 24\)"),
    ((2, 2, D), [[0, 1], [1, 3]], [1, 1],
     r"destination slots in state_indices must be distinct .*got slots \[1\] written"),
    ((3, 2, D), [[0, 1], [2, 3], [4, 5]], [1, 2, 3],
     r"num_accepted must be in \[1, 1 \+ S\] = \[1, 2\], got values in \[1, 3\]"),
    ((3, 2, D), [[0, 1], [2, 3], [4, 5]], [1, 2], r"num_accepted must have shape \(3,\)"),
    ((3, 2, D), [0, 1, 2], [1, 1, 1], r"state_indices must have shape \(3, 2\)"),
    ((3, 2, 2, D), [0, 1, 2], None, r"x must have shape \[N, D\] or \[N, 1 \+ S, D\]"),
])
def test_update_validation(x_shape, idx, acc, match):
  _, weight, pool = _random(10, 1)
  acc = None if acc is None else jnp.asarray(acc, jnp.int32)
  with pytest.raises(ValueError, match=match):
    short_conv_update(jnp.ones(x_shape, jnp.float32), weight, conv_pool=pool,
                      state_indices=jnp.asarray(idx, jnp.int32), num_accepted=acc)


def test_update_num_accepted_dtype_validation():
  _, weight, pool = _random(11, 1)
  with pytest.raises(ValueError, match=r"num_accepted must have dtype"):
    short_conv_update(jnp.ones((1, 2, D)), weight, conv_pool=pool, state_indices=jnp.asarray([[0, 1]], jnp.int32),
                      num_accepted=jnp.asarray([1.0]))


def test_update_padding_rows_may_share_slots():
  """A row whose read slot is -1 writes nothing, so its other columns do not count as writes."""
  _, weight, pool = _random(12, 1)
  y, new_pool = short_conv_update(jnp.ones((2, 2, D)), weight, conv_pool=pool,
                                  state_indices=jnp.asarray([[0, 1], [-1, 1]], jnp.int32),
                                  num_accepted=jnp.asarray([1, 1], jnp.int32), config=XLA)
  np.testing.assert_array_equal(np.asarray(y[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(new_pool[2:]), np.asarray(pool[2:]))


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_update_empty_batch(impl, speculative, kernel_impl):
  """N = 0 (an empty decode batch) returns an empty y and the pool bitwise unchanged."""
  _, weight, pool = _random(8, 1, d=256)
  x = jnp.zeros((0, 3, 256) if speculative else (0, 256))
  kw = dict(num_accepted=jnp.zeros((0,), jnp.int32)) if speculative else {}
  y, new_pool = short_conv_update(x, weight, conv_pool=pool, state_indices=jnp.zeros(x.shape[:-1], jnp.int32),
                                  config=ShortConvConfig(impl=kernel_impl if impl == "kernel" else impl), **kw)
  assert y.shape == x.shape and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(new_pool), np.asarray(pool))


def test_empty_pool_is_rejected():
  x, weight, _ = _random(9, 2)
  pool = jnp.zeros((0, W - 1, D))
  match = r"conv_pool must have at least one slot \(shape\[0\] = P >= 1\), got P = 0"
  with pytest.raises(ValueError, match=match):
    short_conv_update(x, weight, conv_pool=pool, state_indices=jnp.asarray([-1, -1], jnp.int32))
  with pytest.raises(ValueError, match=match):
    short_conv_prefill(x, weight, conv_pool=pool, cu_seqlens=_cu([2]), state_indices=jnp.asarray([-1], jnp.int32),
                       has_initial_state=jnp.asarray([False]))

"""The short conv Mosaic GPU kernels through the public API (interpret mode on CPU, compiled on a Hopper GPU: the
``kernel_impl`` fixture): decode vs a float64 oracle and vs the pure-JAX ``impl="xla"``; prefill vs the pure-JAX
``impl="xla"`` (itself checked against a float64 oracle in ``test_short_conv.py``, which also runs the prefill
kernel against that oracle). Grids other than the heuristic's are run through ``ShortConvTuning``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import util
from pallas_kernels.short_conv import (ShortConvConfig, ShortConvTuning, default_tuning, short_conv_prefill,
                                      short_conv_update)
from pallas_kernels.short_conv import config as sc_config, kernel as sc_kernel

from short_conv_support import (BF16, BF16_TOL, F32, F32_TOL, W, assert_bitwise_equal, check_prefill, inputs,
                                prefill_both, prefill_inputs)


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


def _kernel(x, weight, pool, slots, accepted, *, impl, activation="silu", tuning=None, single=False):
  """``short_conv_update`` with the kernel (``impl`` pallas or interpret) and ``tuning``, on one device
  (interpret mode keeps per-device barrier state)."""
  put = functools.partial(jax.device_put, device=jax.devices()[0])
  slots = put(np.asarray(slots, np.int32))
  if single:
    x, slots, accepted = x[:, 0], slots[:, 0], None
  else:
    accepted = put(np.asarray(accepted, np.int32))
  y, new_pool = short_conv_update(put(x), put(weight), conv_pool=put(pool), state_indices=slots, num_accepted=accepted,
                                  config=ShortConvConfig(activation=activation, impl=impl, tuning=tuning))
  assert y.shape == x.shape and y.dtype == x.dtype
  assert new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
  return np.asarray(y).reshape(x.shape[0], -1, x.shape[-1]), np.asarray(new_pool)


def _check_two_donated_calls(op, kernel_impl: str, x, pool, untouched: list[int], **kw) -> None:
  """``op(x, conv_pool=..., config=...)`` twice in a row under jit with the pool donated, the kernel against
  impl="xla": outputs within one bf16 ulp, pools bitwise equal, ``untouched`` slots bitwise unchanged."""
  outs = {}
  for impl in ("xla", kernel_impl):
    step = jax.jit(functools.partial(op, **kw, config=ShortConvConfig(impl=impl)), donate_argnames="conv_pool")
    p, ys = jnp.asarray(pool), []
    for _ in range(2):
      y, p = step(jnp.asarray(x), conv_pool=p)
      ys.append(np.asarray(y, np.float32))
    outs[impl] = ys, np.asarray(p)
  (ys_ref, p_ref), (ys, p) = outs["xla"], outs[kernel_impl]
  for y, y_ref in zip(ys, ys_ref):
    # The same f32 math in a different order, both rounded to bf16: at most one ulp apart.
    np.testing.assert_allclose(y, y_ref, **BF16_TOL)
  assert_bitwise_equal(p, p_ref)
  assert_bitwise_equal(p[untouched], pool[untouched])


def _check(y, new_pool, y_ref, pool_ref, *, dtype, dead_rows, untouched, pool):
  np.testing.assert_allclose(y.astype(np.float64), y_ref, **(F32_TOL if dtype == F32 else BF16_TOL))
  np.testing.assert_array_equal(y[dead_rows], 0.0)
  # Windows are raw rows moved around, rounded once to the pool dtype: exact, as in the oracle. Untouched
  # slots (NaN-poisoned, some of them never read) keep their bits.
  assert_bitwise_equal(new_pool, pool_ref)
  assert_bitwise_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("dtype, pool_dtype, d, tuning", [
    (F32, F32, 512, ShortConvTuning(block=128, rows=1)),
    # 3 rows per program: the second program has one row, two past the end; a last block of 128 channels.
    (BF16, BF16, 640, ShortConvTuning(block=256, rows=3)),
    (BF16, F32, 1536, ShortConvTuning(block=512, rows=2)),
    (F32, BF16, 384, None),
])
def test_one_token_matches_oracle(kernel_impl, dtype, pool_dtype, d, tuning):
  n, num_slots = 4, 8
  untouched = [1, 3, 4, 6, 7]
  x, weight, pool = inputs(0, n, 1, d, num_slots, dtype, pool_dtype, poison=untouched)
  slots = np.asarray([[5], [-1], [0], [2]])  # the -1 row outputs 0 and touches nothing
  y, new_pool = _kernel(x, weight, pool, slots, None, impl=kernel_impl, tuning=tuning, single=True)
  y_ref, pool_ref = _oracle(x, weight, pool, slots, [1] * n)
  _check(y, new_pool, y_ref, pool_ref, dtype=dtype, dead_rows=[1], untouched=untouched, pool=pool)


@pytest.mark.parametrize("dtype, pool_dtype, activation, d, tuning", [
    (F32, F32, "silu", 1024, ShortConvTuning(block=256, rows=1)),
    (BF16, BF16, None, 1024, ShortConvTuning(block=128, rows=2)),
    # x rows rounded to the pool dtype when written; a last block of 512
    (F32, BF16, "silu", 1536, ShortConvTuning(block=1024, rows=2)),
])
def test_speculative_matches_oracle(kernel_impl, dtype, pool_dtype, activation, d, tuning):
  n, steps, num_slots = 3, 3, 12
  # Row 0 resumes from its 2nd column (slot 1, also written by it); row 1's read slot is -1 (padding: its
  # other slots stay untouched); row 2 skips writing column 1. Slot 10 is NaN and never read or written.
  slots = np.asarray([[0, 1, 2], [-1, 4, 5], [6, -1, 8]])
  accepted = [2, 1, 3]
  untouched = [3, 4, 5, 7, 9, 10, 11]
  x, weight, pool = inputs(1, n, steps, d, num_slots, dtype, pool_dtype, poison=untouched)
  y, new_pool = _kernel(x, weight, pool, slots, accepted, impl=kernel_impl, activation=activation, tuning=tuning)
  y_ref, pool_ref = _oracle(x, weight, pool, slots, accepted, activation=activation)
  _check(y, new_pool, y_ref, pool_ref, dtype=dtype, dead_rows=[1], untouched=untouched, pool=pool)


@pytest.mark.parametrize("speculative", [False, True])
def test_public_api_matches_xla(kernel_impl, speculative):
  """``short_conv_update`` with the kernel vs ``impl="xla"``, two steps in a row under jit (pool donated)."""
  n, steps, d, num_slots = 3, 2 if speculative else 1, 256, 8
  x, weight, pool = inputs(2, n, steps, d, num_slots, BF16, BF16, poison=[6])
  slots = jnp.asarray([[0, 1], [-1, 2], [4, 5]] if speculative else [[1], [-1], [4]], jnp.int32)
  accepted = jnp.asarray([2, 1, 1], jnp.int32) if speculative else None
  if not speculative:
    x, slots = x[:, 0], slots[:, 0]
  _check_two_donated_calls(short_conv_update, kernel_impl, x, pool, [6], weight=jnp.asarray(weight),
                           state_indices=slots, num_accepted=accepted)


def test_rejects_unsupported_channels_and_bad_impl():
  x, weight, pool = inputs(3, 1, 1, 96, 2, F32, F32)
  args = (jnp.asarray(x[:, 0]), jnp.asarray(weight))
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray([0], jnp.int32))
  with pytest.raises(NotImplementedError, match="D % 128 == 0, got D=96"):
    short_conv_update(*args, **kw, config=ShortConvConfig(impl="interpret"))
  with pytest.raises(ValueError, match="impl must be one of"):
    short_conv_update(*args, **kw, config=ShortConvConfig(impl="triton"))


def test_empty_batch(kernel_impl):
  _, weight, pool = inputs(3, 1, 1, 256, 2, F32, F32)
  y, new_pool = short_conv_update(jnp.zeros((0, 256)), jnp.asarray(weight), conv_pool=jnp.asarray(pool),
                                  state_indices=jnp.zeros((0,), jnp.int32), config=ShortConvConfig(impl=kernel_impl))
  assert y.shape == (0, 256) and y.dtype == jnp.float32
  assert_bitwise_equal(new_pool, pool)


@pytest.mark.parametrize("n, d", [(1, 36864), (256, 36864), (8, 4224), (256, 4224), (3, 384)])
def test_plan_fills_the_gpu(n, d):
  tuning = default_tuning(num_rows=n, channels=d)
  block, rows = tuning.block, tuning.rows
  assert 1 <= rows <= sc_config.MAX_ROWS
  programs = -(-d // block) * -(-n // rows)
  # Enough programs for every SM when there are enough channels; 16-byte bf16 accesses for big batches.
  assert programs >= min(util.NUM_SMS, n * d // 128)
  if n * d >= 1024 * sc_config.TARGET_PROGRAMS:
    assert block == 1024 and programs >= sc_config.TARGET_PROGRAMS


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
  f = lambda x, weight, pool, slots, accepted: short_conv_update(
      x, weight, conv_pool=pool, state_indices=slots, num_accepted=accepted, config=ShortConvConfig(impl="pallas"))
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
  x, weight, pool = inputs(4, n, steps, d, num_slots, BF16, BF16, poison=untouched)
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray(slots if steps > 1 else slots[:, 0], jnp.int32),
            num_accepted=jnp.asarray(accepted, jnp.int32) if steps > 1 else None)
  xs = jnp.asarray(x if steps > 1 else x[:, 0])
  y_ref, p_ref = short_conv_update(xs, jnp.asarray(weight), **kw, config=ShortConvConfig(impl="xla"))
  y, p = short_conv_update(xs, jnp.asarray(weight), **kw, config=ShortConvConfig(impl="pallas"))
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), **BF16_TOL)
  assert_bitwise_equal(np.asarray(p), np.asarray(p_ref))
  assert_bitwise_equal(np.asarray(p)[untouched], pool[untouched])


@pytest.mark.parametrize("dtype, pool_dtype, activation, d, tuning", [
    # a last channel block of 256; 16-byte bf16 accesses
    (BF16, BF16, "silu", 1280, ShortConvTuning(block=1024, token_block=8)),
    # x rows rounded to the pool dtype when written
    (F32, BF16, None, 384, ShortConvTuning(block=256, token_block=16)),
    # the largest token block: one token program, its tail past T
    (BF16, F32, "silu", 256, ShortConvTuning(block=128, token_block=64)),
])
def test_prefill_matches_xla(kernel_impl, dtype, pool_dtype, activation, d, tuning):
  """Varlen with empty sequences (also first and last), sequences shorter than W - 1, a sequence starting and
  one ending inside a token block, with and without history, slot -1, checkpoints (offsets below W - 1, at the
  end, a -1 slot), NaN-poisoned slots never read or written."""
  lengths = [0, 2, 1, 19, 0, 3, 9, 5, 0]
  slots = [0, 1, 2, 3, 4, -1, 5, 6, 7]
  has_init = [True, True, False, True, True, True, True, False, False]
  ckpts = [(1, 1, 8), (3, 2, 9), (3, 8, 10), (3, 19, -1), (6, 9, 11), (7, 4, 12)]
  num_slots = 16
  # The slots of the empty sequences with an initial state, and spares; slot 7 (empty, no initial state) is
  # never read but takes zeros.
  untouched = [0, 4, 13, 14, 15]
  x, weight, pool, cu = prefill_inputs(5, lengths, d, num_slots, dtype, pool_dtype, poison=untouched + [7])
  ref, out = prefill_both(x, weight, pool, cu, slots, has_init, ckpts, impl=kernel_impl, activation=activation,
                          tuning=tuning)
  check_prefill(ref, out, dtype=dtype, untouched=untouched, pool=pool)


def test_prefill_one_sequence_without_checkpoints(kernel_impl):
  """The default plan, one long sequence resuming from its own slot (read, then overwritten), no checkpoints."""
  x, weight, pool, cu = prefill_inputs(6, [37], 256, 3, BF16, BF16, poison=[2])
  ref, out = prefill_both(x, weight, pool, cu, [1], [True], None, impl=kernel_impl)
  check_prefill(ref, out, dtype=BF16, untouched=[0, 2], pool=pool)


def test_prefill_public_api_matches_xla(kernel_impl):
  """``short_conv_prefill`` with the kernel vs ``impl="xla"``, two calls in a row under jit (pool donated): the
  second resumes from the states the first wrote."""
  lengths, d = [5, 0, 2, 11], 256
  x, weight, pool, cu = prefill_inputs(7, lengths, d, 8, BF16, BF16, poison=[6])
  kw = dict(cu_seqlens=jnp.asarray(cu), state_indices=jnp.asarray([0, 1, 2, 3], jnp.int32),
            has_initial_state=jnp.asarray([True, True, False, True]),
            checkpoint_indptr=jnp.asarray([0, 1, 1, 1, 2], jnp.int32),
            checkpoint_offsets=jnp.asarray([3, 11], jnp.int32), checkpoint_slots=jnp.asarray([4, 5], jnp.int32))
  _check_two_donated_calls(short_conv_prefill, kernel_impl, x, pool, [6, 7], weight=jnp.asarray(weight), **kw)


def test_prefill_empty_tokens_and_rejects(kernel_impl):
  _, weight, pool, _ = prefill_inputs(8, [1], 256, 2, F32, F32)
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray([0, 1], jnp.int32),
            has_initial_state=jnp.asarray([True, True]), cu_seqlens=jnp.zeros((3,), jnp.int32))
  y, new_pool = short_conv_prefill(jnp.zeros((0, 256)), jnp.asarray(weight), **kw,
                                   config=ShortConvConfig(impl=kernel_impl))
  assert y.shape == (0, 256) and y.dtype == jnp.float32
  assert_bitwise_equal(new_pool, pool)
  x96, w96, p96, cu = prefill_inputs(8, [3], 96, 2, F32, F32)
  with pytest.raises(NotImplementedError, match="D % 128 == 0, got D=96"):
    short_conv_prefill(jnp.asarray(x96), jnp.asarray(w96), conv_pool=jnp.asarray(p96), cu_seqlens=jnp.asarray(cu),
                       state_indices=jnp.asarray([0], jnp.int32), has_initial_state=jnp.asarray([True]),
                       config=ShortConvConfig(impl=kernel_impl))
  with pytest.raises(ValueError, match=r"token_block must be one of \(64, 32, 16, 8\) or None, got 24"):
    ShortConvTuning(block=1024, token_block=24)


@pytest.mark.parametrize("t, d", [(8192, 36864), (8192, 4224), (512, 36864), (37, 384)])
def test_prefill_plan_fills_the_gpu(t, d):
  tuning = default_tuning(num_rows=t, channels=d)
  block, tokens = tuning.block, tuning.token_block
  assert block in sc_config.BLOCKS and tokens % sc_config.UNROLL == 0
  programs = -(-d // block) * -(-t // tokens)
  assert programs >= min(sc_config.TARGET_PROGRAMS, -(-d // block) * -(-t // sc_config.UNROLL))
  if t * d >= 1024 * 64 * sc_config.TARGET_PROGRAMS:
    assert (block, tokens) == (1024, 64)


@pytest.mark.parametrize("op", ["update", "prefill"])
def test_tuning_reaches_the_kernel(kernel_impl, monkeypatch, op):
  """A ``ShortConvTuning`` other than the heuristic's reaches the kernel's grid (a spy on its jitted body records
  the static grid arguments) and gives the results of the default grid: the per-channel f32 arithmetic is the
  same whatever the program that owns a channel. D = 384: a last block of 128 channels at block 256."""
  body = {"update": "_update", "prefill": "_prefill"}[op]
  real, seen = getattr(sc_kernel, body), []

  def spy(*args, **kw):
    seen.append({k: kw[k] for k in ("block", "rows", "token_block") if k in kw})
    return real(*args, **kw)

  monkeypatch.setattr(sc_kernel, body, spy)
  d = 384
  if op == "update":
    x, weight, pool = inputs(11, 3, 2, d, 8, BF16, BF16, poison=[7])
    slots, accepted = np.asarray([[0, 1], [-1, 2], [4, 5]]), [2, 1, 1]
    run = lambda tuning: _kernel(x, weight, pool, slots, accepted, impl=kernel_impl, tuning=tuning)
    grids = [dict(block=128, rows=1), dict(block=256, rows=2)]
    tuned = ShortConvTuning(block=256, rows=2)
  else:
    x, weight, pool, cu = prefill_inputs(12, [0, 2, 1, 19, 5], d, 8, BF16, BF16, poison=[7])
    run = lambda tuning: prefill_both(x, weight, pool, cu, [0, 1, 2, 3, 4], [True, False, True, True, False],
                                       [(3, 2, 5), (3, 19, 6)], impl=kernel_impl, tuning=tuning)[1]
    grids = [dict(block=128, token_block=8), dict(block=256, token_block=16)]
    tuned = ShortConvTuning(block=256, token_block=16)
  # The default grid of 3 rows (27 tokens) of 384 channels: the narrowest block, one row (8 tokens) per program.
  assert {k: getattr(default_tuning(num_rows=x.shape[0], channels=d), k) for k in grids[0]} == grids[0]
  (y, p), (y_tuned, p_tuned) = run(None), run(tuned)
  assert seen == grids
  assert_bitwise_equal(y_tuned, y)
  assert_bitwise_equal(p_tuned, p)


def _varlen(t: int, n: int, seed: int) -> np.ndarray:
  """``n`` random sequence lengths summing to ``t`` (one of them 0, one of them 2 when ``n > 2``)."""
  cuts = np.sort(np.random.default_rng(seed).integers(0, t, n - 1))
  lengths = np.diff(np.concatenate([[0], cuts, [t]]))
  if n > 2:
    lengths[0], lengths[1], lengths[-1] = 0, 2, lengths[-1] + lengths[0] + lengths[1] - 2
  return lengths


@pytest.mark.parametrize("t, n, d, dtype, pool_dtype, checkpoints", [
    (8192, 8, 3 * 96 * 128, BF16, BF16, True), (8192, 1, 3 * 96 * 128, BF16, BF16, False),
    (8192, 8, 3 * 11 * 128, BF16, F32, True), (8192, 8, 3 * 96 * 128, F32, BF16, False)])
def test_prefill_lowers_for_cuda(t, n, d, dtype, pool_dtype, checkpoints):
  """Mosaic GPU lowering and layout inference at the K3 sizes (D = 3 H K: 96 heads, and 11 heads per device at
  TP 9, where the last channel block is 128 channels), on the CPU."""
  i32 = jnp.int32
  s = jax.ShapeDtypeStruct
  ck = [s((n + 1,), i32), s((2 * n,), i32), s((2 * n,), i32)] if checkpoints else [None] * 3
  shapes = [s((t, d), dtype), s((d, W), dtype), s((n + 1,), i32), s((4 * n, W - 1, d), pool_dtype), s((n,), i32),
            s((n,), jnp.bool_), *ck]
  f = lambda x, weight, cu, pool, slots, has_init, ck_ptr, ck_off, ck_slots: short_conv_prefill(
      x, weight, cu_seqlens=cu, conv_pool=pool, state_indices=slots, has_initial_state=has_init,
      checkpoint_indptr=ck_ptr, checkpoint_offsets=ck_off, checkpoint_slots=ck_slots,
      config=ShortConvConfig(impl="pallas"))
  text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("t, n, d", [(8192, 1, 3 * 96 * 128), (8192, 8, 3 * 96 * 128), (8192, 8, 3 * 11 * 128)])
def test_prefill_real_sizes_on_gpu(t, n, d):
  """The compiled prefill kernel vs ``impl="xla"`` at K3 sizes: varlen (an empty and a 2-token sequence), every
  other sequence with history, a -1 slot, two checkpoints per sequence (one inside the first W - 1 tokens)."""
  lengths = _varlen(t, n, 9)
  num_slots = 3 * n + 4
  slots = list(range(n))
  if n > 2:
    slots[n // 2] = -1
  has_init = [i % 2 == 0 for i in range(n)]
  ckpts = [(i, off, n + 2 * i + j) for i in range(n) for j, off in enumerate((1, lengths[i])) if lengths[i] > 0]
  untouched = list(range(3 * n, num_slots))
  x, weight, pool, cu = prefill_inputs(10, lengths, d, num_slots, BF16, BF16, poison=untouched)
  ref, out = prefill_both(x, weight, pool, cu, slots, has_init, ckpts, impl="pallas")
  check_prefill(ref, out, dtype=BF16, untouched=untouched, pool=pool)

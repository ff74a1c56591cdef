"""The short conv Mosaic GPU kernels (interpret mode on CPU, compiled on a Hopper GPU: the ``kernel_impl``
fixture): decode vs a float64 oracle and vs the pure-JAX ``short_conv_update(impl="xla")``; prefill vs the pure-JAX
``short_conv_prefill(impl="xla")`` (itself checked against a float64 oracle in ``test_short_conv.py``, which also
runs the prefill kernel against that oracle)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import util
from pallas_kernels.kda import short_conv_kernel
from pallas_kernels.kda.short_conv import short_conv_prefill, short_conv_update

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


def _check_two_donated_calls(op, kernel_impl: str, x, pool, untouched: list[int], **kw) -> None:
  """``op(x, conv_pool=..., impl=...)`` twice in a row under jit with the pool donated, the kernel against
  impl="xla": outputs within one bf16 ulp, pools bitwise equal, ``untouched`` slots bitwise unchanged."""
  outs = {}
  for impl in ("xla", kernel_impl):
    step = jax.jit(functools.partial(op, **kw, impl=impl), donate_argnames="conv_pool")
    p, ys = jnp.asarray(pool), []
    for _ in range(2):
      y, p = step(jnp.asarray(x), conv_pool=p)
      ys.append(np.asarray(y, np.float32))
    outs[impl] = ys, np.asarray(p)
  (ys_ref, p_ref), (ys, p) = outs["xla"], outs[kernel_impl]
  for y, y_ref in zip(ys, ys_ref):
    # The same f32 math in a different order, both rounded to bf16: at most one ulp apart.
    np.testing.assert_allclose(y, y_ref, **BF16_TOL)
  _assert_bitwise_equal(p, p_ref)
  _assert_bitwise_equal(p[untouched], pool[untouched])


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
  _check_two_donated_calls(short_conv_update, kernel_impl, x, pool, [6], weight=jnp.asarray(weight),
                           state_indices=slots, num_accepted=accepted)


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
  assert programs >= min(util.NUM_SMS, n * d // 128)
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


def _prefill_inputs(seed, lengths, d, num_slots, dtype, pool_dtype, poison=()):
  """x [T, d], weight, pool (slots in ``poison`` NaN) and cu_seqlens for sequences of ``lengths``."""
  x, weight, pool = _inputs(seed, sum(lengths), 1, d, num_slots, dtype, pool_dtype, poison=poison)
  return x[:, 0], weight, pool, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _prefill_both(x, weight, pool, cu, slots, has_init, ckpts, *, impl, activation="silu", blocks=None):
  """``short_conv_prefill(impl="xla")`` and the kernel (``impl``, on one device, with ``blocks``); ``ckpts``:
  (sequence, offset, slot) sorted by sequence, or None. Returns ((y, pool) xla, (y, pool) kernel) as NumPy."""
  put = functools.partial(jax.device_put, device=jax.devices()[0])
  n = len(slots)
  args = dict(cu_seqlens=put(cu), state_indices=put(np.asarray(slots, np.int32)),
              has_initial_state=put(np.asarray(has_init)), checkpoint_indptr=None, checkpoint_offsets=None,
              checkpoint_slots=None)
  if ckpts is not None:
    args.update(checkpoint_indptr=put(np.searchsorted([c[0] for c in ckpts], np.arange(n + 1)).astype(np.int32)),
                checkpoint_offsets=put(np.asarray([c[1] for c in ckpts], np.int32).reshape(-1)),
                checkpoint_slots=put(np.asarray([c[2] for c in ckpts], np.int32).reshape(-1)))
  xs, ws, ps = put(x), put(weight), put(pool)
  ref = short_conv_prefill(xs, ws, conv_pool=ps, **args, activation=activation, impl="xla")
  out = short_conv_kernel.short_conv_prefill_mosaic(xs, ws, args["cu_seqlens"], ps, args["state_indices"],
                                                    args["has_initial_state"], args["checkpoint_indptr"],
                                                    args["checkpoint_offsets"], args["checkpoint_slots"],
                                                    activation=activation, interpret=impl == "interpret",
                                                    blocks=blocks)
  assert out[0].shape == x.shape and out[0].dtype == x.dtype
  assert out[1].shape == pool.shape and out[1].dtype == pool.dtype
  return [tuple(np.asarray(a) for a in r) for r in (ref, out)]


def _check_prefill(ref, out, *, dtype, untouched, pool):
  (y_ref, p_ref), (y, p) = ref, out
  # The same f32 math in a different order, rounded once to x's dtype.
  np.testing.assert_allclose(y.astype(np.float32), y_ref.astype(np.float32),
                             **(F32_TOL if dtype == F32 else BF16_TOL))
  _assert_bitwise_equal(p, p_ref)
  _assert_bitwise_equal(p[untouched], pool[untouched])


@pytest.mark.parametrize("dtype, pool_dtype, activation, d, blocks", [
    (BF16, BF16, "silu", 1280, (1024, 8)),  # a last channel block of 256; 16-byte bf16 accesses
    (F32, BF16, None, 384, (256, 16)),  # x rows rounded to the pool dtype when written
    (BF16, F32, "silu", 256, (128, 64)),  # the largest token block: one token program, its tail past T
])
def test_prefill_matches_xla(kernel_impl, dtype, pool_dtype, activation, d, blocks):
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
  x, weight, pool, cu = _prefill_inputs(5, lengths, d, num_slots, dtype, pool_dtype, poison=untouched + [7])
  ref, out = _prefill_both(x, weight, pool, cu, slots, has_init, ckpts, impl=kernel_impl, activation=activation,
                           blocks=blocks)
  _check_prefill(ref, out, dtype=dtype, untouched=untouched, pool=pool)


def test_prefill_one_sequence_without_checkpoints(kernel_impl):
  """The default plan, one long sequence resuming from its own slot (read, then overwritten), no checkpoints."""
  x, weight, pool, cu = _prefill_inputs(6, [37], 256, 3, BF16, BF16, poison=[2])
  ref, out = _prefill_both(x, weight, pool, cu, [1], [True], None, impl=kernel_impl)
  _check_prefill(ref, out, dtype=BF16, untouched=[0, 2], pool=pool)


def test_prefill_public_api_matches_xla(kernel_impl):
  """``short_conv_prefill(impl=kernel)`` vs ``impl="xla"``, two calls in a row under jit (pool donated): the
  second resumes from the states the first wrote."""
  lengths, d = [5, 0, 2, 11], 256
  x, weight, pool, cu = _prefill_inputs(7, lengths, d, 8, BF16, BF16, poison=[6])
  kw = dict(cu_seqlens=jnp.asarray(cu), state_indices=jnp.asarray([0, 1, 2, 3], jnp.int32),
            has_initial_state=jnp.asarray([True, True, False, True]),
            checkpoint_indptr=jnp.asarray([0, 1, 1, 1, 2], jnp.int32),
            checkpoint_offsets=jnp.asarray([3, 11], jnp.int32), checkpoint_slots=jnp.asarray([4, 5], jnp.int32))
  _check_two_donated_calls(short_conv_prefill, kernel_impl, x, pool, [6, 7], weight=jnp.asarray(weight), **kw)


def test_prefill_empty_tokens_and_rejects(kernel_impl):
  _, weight, pool, _ = _prefill_inputs(8, [1], 256, 2, F32, F32)
  kw = dict(conv_pool=jnp.asarray(pool), state_indices=jnp.asarray([0, 1], jnp.int32),
            has_initial_state=jnp.asarray([True, True]), cu_seqlens=jnp.zeros((3,), jnp.int32))
  y, new_pool = short_conv_prefill(jnp.zeros((0, 256)), jnp.asarray(weight), **kw, impl=kernel_impl)
  assert y.shape == (0, 256) and y.dtype == jnp.float32
  _assert_bitwise_equal(new_pool, pool)
  x96, w96, p96, cu = _prefill_inputs(8, [3], 96, 2, F32, F32)
  with pytest.raises(NotImplementedError, match="D % 128 == 0, got D=96"):
    short_conv_prefill(jnp.asarray(x96), jnp.asarray(w96), conv_pool=jnp.asarray(p96), cu_seqlens=jnp.asarray(cu),
                       state_indices=jnp.asarray([0], jnp.int32), has_initial_state=jnp.asarray([True]),
                       impl=kernel_impl)
  with pytest.raises(ValueError, match=r"blocks must be \(BD, BT\) with BD in .* and BT in .*, got \(1024, 24\)"):
    short_conv_kernel.short_conv_prefill_mosaic(*(jnp.zeros((8, 256)), jnp.asarray(weight), jnp.asarray([0, 8]),
                                                  jnp.asarray(pool), jnp.asarray([0]), jnp.asarray([True])),
                                                None, None, None, activation="silu", interpret=True,
                                                blocks=(1024, 24))


@pytest.mark.parametrize("t, d", [(8192, 36864), (8192, 4224), (512, 36864), (37, 384)])
def test_prefill_plan_fills_the_gpu(t, d):
  block, tokens = short_conv_kernel.prefill_plan(t, d)
  assert block in short_conv_kernel.BLOCKS and tokens % short_conv_kernel.UNROLL == 0
  programs = -(-d // block) * -(-t // tokens)
  assert programs >= min(short_conv_kernel.TARGET_PROGRAMS, -(-d // block) * -(-t // short_conv_kernel.UNROLL))
  if t * d >= 1024 * 64 * short_conv_kernel.TARGET_PROGRAMS:
    assert (block, tokens) == (1024, 64)


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
  f = functools.partial(short_conv_kernel.short_conv_prefill_mosaic, activation="silu", interpret=False)
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
  x, weight, pool, cu = _prefill_inputs(10, lengths, d, num_slots, BF16, BF16, poison=untouched)
  ref, out = _prefill_both(x, weight, pool, cu, slots, has_init, ckpts, impl="pallas")
  _check_prefill(ref, out, dtype=BF16, untouched=untouched, pool=pool)

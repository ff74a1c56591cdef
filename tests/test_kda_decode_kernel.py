"""The KDA decode Mosaic GPU kernel through ``kda_decode`` (interpret mode on CPU, compiled on a Hopper GPU) on
every ``KdaTuning.decode_state_io`` path, against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import KdaConfig, KdaTuning, default_tuning, kda_decode, kda_prefill
from pallas_kernels.kda.config import DECODE_STATE_IO
from pallas_kernels.testing import kda_decode_oracle, kda_gate_params, kda_inputs

from kda_support import check_decode

POISON = 1e30
LB = -3.0  # a K3 lower-bound gate inside FLA's accepted [-5, 0)
TOKEN_ARGS = ("q", "k", "v", "g_raw", "beta_raw")


@pytest.fixture(params=DECODE_STATE_IO)
def state_io(request) -> str:
  """Every kernel check runs on each state / IO path (TMA through SMEM; direct global loads and stores on
  16-, 64- and 128-row blocks)."""
  return request.param


def _config(state_io: str | None, **kw) -> KdaConfig:
  return KdaConfig(tuning=KdaTuning(decode_state_io=state_io), **kw)


def _inputs(seed, n, steps, heads, kdim, vdim, num_slots, dtype=jnp.float32, state_dtype=jnp.float32):
  """Raw tokens ``[n, steps, ...]`` in ``dtype`` and gate parameters (a centred ``dt_bias`` of std 0.5: strong
  decays), as a list in ``kda_decode``'s argument order, and a pool of ``num_slots`` states."""
  # NumPy draws: eager jax.random would compile one XLA program per shape (seconds per test on CPU).
  rng = np.random.default_rng(seed)
  x = kda_inputs(rng, (n, steps), heads, kdim, vdim)
  A_log, dt_bias = kda_gate_params(rng, heads, kdim, dt_bias_std=0.5)
  args = [jnp.asarray(x[name], dtype) for name in TOKEN_ARGS] + [jnp.asarray(A_log), jnp.asarray(dt_bias)]
  # States of the size a unit-norm delta rule produces: entries O(1 / sqrt(K)).
  pool = rng.standard_normal((num_slots, heads, vdim, kdim)).astype(np.float32) / np.sqrt(kdim)
  return args, jnp.asarray(pool, state_dtype)


def _oracle(args, pool, slots, accepted, *, lower_bound):
  """``kda_decode_oracle`` on the speculative form (``slots [N, 1 + S]``): ``o`` and the new pool."""
  o, new_pool, _ = kda_decode_oracle(*args[:5], A_log=args[5], dt_bias=args[6], state_pool=pool, state_indices=slots,
                                     num_accepted=accepted, lower_bound=lower_bound)
  return o, new_pool


def _run(args, pool, slots, accepted, *, config, single=False):
  """``kda_decode`` on one device (interpret mode keeps per-device barrier state) with a fresh pool copy."""
  dev = jax.devices()[0]
  args = [jax.device_put(a, dev) for a in args]
  slots = jax.device_put(jnp.asarray(slots, jnp.int32), dev)
  accepted = jax.device_put(jnp.asarray(accepted, jnp.int32), dev)
  if single:
    args = [a[:, 0] if i < 5 else a for i, a in enumerate(args)]
    slots, accepted = slots[:, 0], None
  pool = jax.device_put(jnp.array(pool, copy=True), dev)
  o, new_pool = kda_decode(*args[:5], A_log=args[5], dt_bias=args[6], state_pool=pool, state_indices=slots,
                           num_accepted=accepted, config=config)
  if single:
    o = o[:, None]
  return np.asarray(o.astype(jnp.float32)), new_pool


@pytest.mark.parametrize("lower_bound, state_dtype, dtype, kdim, vdim", [
    (None, jnp.float32, jnp.float32, 64, 128),  # V = 128: every path's block divides it
    (LB, jnp.bfloat16, jnp.bfloat16, 32, 128),  # a 64-byte-row bf16 state tile
])
def test_single_token_matches_oracle(kernel_impl, state_io, lower_bound, state_dtype, dtype, kdim, vdim):
  heads, num_slots = 2, 6
  args, pool = _inputs(0, 3, 1, heads, kdim, vdim, num_slots, dtype, state_dtype)
  slots = np.asarray([[4], [-1], [1]])  # the -1 row outputs 0 and touches nothing
  pool = pool.at[jnp.asarray([0, 2, 3, 5])].set(POISON)
  config = _config(state_io, lower_bound=lower_bound, state_dtype=state_dtype, impl=kernel_impl)
  o, new_pool = _run(args, pool, slots, [1, 1, 1], config=config, single=True)
  o_ref, pool_ref = _oracle(args, pool, slots, [1, 1, 1], lower_bound=lower_bound)
  np.testing.assert_array_equal(o[1], 0.0)
  check_decode(o, new_pool, o_ref, pool_ref, pool, vdim=vdim, dtype=dtype, state_dtype=state_dtype,
               untouched=[0, 2, 3, 5])


@pytest.mark.parametrize("lower_bound, state_dtype", [(LB, jnp.float32), (None, jnp.bfloat16)])
def test_speculative_matches_oracle(kernel_impl, state_io, lower_bound, state_dtype):
  heads, kdim, vdim, num_slots = 2, 64, 128, 12
  args, pool = _inputs(1, 3, 3, heads, kdim, vdim, num_slots, state_dtype=state_dtype)
  # Row 0 resumes from its 2nd column; row 1's read slot is -1 (padding); row 2 skips writing column 1.
  slots = np.asarray([[0, 1, 2], [-1, 4, 5], [6, -1, 8]])
  accepted = [2, 1, 3]
  untouched = [3, 4, 5, 7, 9, 10, 11]
  pool = pool.at[jnp.asarray(untouched)].set(POISON)
  config = _config(state_io, lower_bound=lower_bound, state_dtype=state_dtype, impl=kernel_impl)
  o, new_pool = _run(args, pool, slots, accepted, config=config)
  o_ref, pool_ref = _oracle(args, pool, slots, accepted, lower_bound=lower_bound)
  np.testing.assert_array_equal(o[1], 0.0)
  check_decode(o, new_pool, o_ref, pool_ref, pool, vdim=vdim, dtype=jnp.float32, state_dtype=state_dtype,
               untouched=untouched)


@pytest.mark.parametrize("n", [1, 256])
@pytest.mark.parametrize("single, lower_bound, state_dtype, dtype", [
    (True, None, jnp.float32, jnp.bfloat16), (False, LB, jnp.bfloat16, jnp.bfloat16),
    (True, LB, jnp.bfloat16, jnp.float32), (False, None, jnp.float32, jnp.float32)])
def test_lowers_for_cuda(state_io, n, single, lower_bound, state_dtype, dtype):
  """Mosaic GPU lowering and layout inference of each config at the real sizes (H = 96, K = V = 128), on the
  CPU. Abstract arguments: a pool of N * (1 + S) real slots would take gigabytes."""
  heads, kdim = 96, 128  # V = K: q, k, v and g_raw share one shape
  lead = (n,) if single else (n, 3)
  spec = jax.ShapeDtypeStruct
  args = [spec((*lead, heads, kdim), dtype)] * 4 + [spec((*lead, heads), dtype), spec((heads,), jnp.float32),
                                                    spec((heads, kdim), jnp.float32)]
  pool = spec((2, heads, kdim, kdim), state_dtype)
  slots = spec(lead, jnp.int32)
  accepted = None if single else spec((n,), jnp.int32)
  config = _config(state_io, lower_bound=lower_bound, state_dtype=state_dtype, impl="pallas")

  def f(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots, accepted):
    return kda_decode(q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, state_pool=pool, state_indices=slots,
                      num_accepted=accepted, config=config)

  text = jax.jit(f).trace(*args, pool, slots, accepted).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def _one_token_call(kdim: int, vdim: int, state_io: str | None = None):
  """``kda_decode`` in interpret mode on one sequence x one token of one head, pool slot 0."""
  args, pool = _inputs(4, 1, 1, 1, kdim, vdim, 2)
  return _run(args, pool, [[0]], [1], config=_config(state_io, impl="interpret"), single=True)


def test_default_tuning_rule():
  """``default_tuning`` (``decode_kernel.choose_state_io``) on ``N * H`` heads, K and V, the state dtype."""
  def rule(heads: int, kdim: int, vdim: int, state_dtype) -> str:
    return default_tuning(num_seqs=heads, num_heads=1, key_dim=kdim, value_dim=vdim,
                          state_dtype=state_dtype).decode_state_io

  assert [rule(heads, 128, 128, jnp.float32) for heads in (11, 1024, 1025, 4096, 4097)] == [
      "direct16", "direct16", "direct64", "direct64", "direct128"]
  assert [rule(heads, 128, 128, jnp.bfloat16) for heads in (96, 128, 129, 4096, 4097)] == [
      "direct16", "direct16", "direct64", "direct64", "direct128"]
  assert rule(4097, 128, 192, jnp.float32) == "direct64"  # V is not a multiple of 128
  assert rule(1, 48, 128, jnp.float32) == rule(1, 288, 128, jnp.bfloat16) == "tma"
  # Only the product N * H counts.
  assert default_tuning(num_seqs=8, num_heads=128, key_dim=128, value_dim=128,
                        state_dtype="float32").decode_state_io == rule(1024, 128, 128, jnp.float32)


@pytest.mark.parametrize("make, match", [
    (lambda: KdaTuning(decode_state_io="smem"),
     r"decode_state_io must be None or one of \('tma', 'direct16', 'direct64', 'direct128'\), got 'smem'"),
    (lambda: KdaConfig(tuning="direct16"), r"tuning must be a KdaTuning or None, got 'direct16'"),
    (lambda: KdaTuning(prefill_v_blocks=3), r"prefill_v_blocks must be None, 1 or 2, got 3"),
    (lambda: KdaTuning(prefill_v_blocks=True), r"prefill_v_blocks must be None, 1 or 2, got True"),
    (lambda: KdaTuning(prefill_segments=0), r"prefill_segments must be None or an int >= 1, got 0"),
    (lambda: KdaTuning(prefill_segments=True), r"prefill_segments must be None or an int >= 1, got True"),
    (lambda: KdaTuning(prefill_segments=2.0), r"prefill_segments must be None or an int >= 1, got 2.0"),
    (lambda: default_tuning(num_seqs=1, num_heads=0, key_dim=128, value_dim=128, state_dtype=jnp.float32),
     r"num_heads must be an int >= 1, got 0"),
    (lambda: default_tuning(num_seqs=-1, num_heads=1, key_dim=128, value_dim=128, state_dtype=jnp.float32),
     r"num_seqs must be an int >= 0, got -1"),
    (lambda: default_tuning(num_seqs=1, num_heads=1, key_dim=128, value_dim=128, state_dtype=jnp.float16),
     r"state_dtype must be one of \['float32', 'bfloat16'\], got float16"),
])
def test_tuning_validation(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_tuning_is_part_of_the_static_config():
  """Equal tunings give equal, equally hashed configs (one jit cache entry); different ones do not."""
  a = KdaConfig(impl="interpret", tuning=KdaTuning(decode_state_io="tma"))
  b = KdaConfig(impl="interpret", tuning=KdaTuning(decode_state_io="tma"))
  assert a == b and hash(a) == hash(b)
  assert a != KdaConfig(impl="interpret", tuning=KdaTuning(decode_state_io="direct16"))


def test_rejects_unsupported_head_sizes():
  with pytest.raises(NotImplementedError, match="V % 64 == 0 and K % 8 == 0, got V=32, K=64"):
    _one_token_call(64, 32)
  with pytest.raises(NotImplementedError, match='"direct16" needs K % 32 == 0, K <= 256 and V % 16 == 0, '
                                               'got K=48, V=64'):
    _one_token_call(48, 64, "direct16")
  with pytest.raises(NotImplementedError, match='"direct128" needs .* V % 128 == 0, got K=64, V=64'):
    _one_token_call(64, 64, "direct128")


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("lower_bound, state_dtype", [(None, jnp.float32), (LB, jnp.bfloat16)])
def test_real_sizes_on_gpu(state_io, steps, lower_bound, state_dtype):
  n, heads, num_slots = 8, 11, 40
  args, pool = _inputs(5, n, steps, heads, 128, 128, num_slots, jnp.bfloat16, state_dtype)
  slots = np.arange(n * steps).reshape(n, steps)
  slots[3] = -1
  accepted = np.minimum(np.arange(n) % steps + 1, steps)
  untouched = list(range(n * steps, num_slots))
  pool = pool.at[jnp.asarray(untouched)].set(POISON)
  config = _config(state_io, lower_bound=lower_bound, state_dtype=state_dtype, impl="pallas")
  o, new_pool = _run(args, pool, slots, accepted, config=config, single=steps == 1)
  o_ref, pool_ref = _oracle(args, pool, slots, accepted, lower_bound=lower_bound)
  check_decode(o, new_pool, o_ref, pool_ref, pool, vdim=128, dtype=jnp.bfloat16, state_dtype=state_dtype,
               untouched=untouched)


def _on_device0(*xs):
  dev = jax.devices()[0]
  return [jax.device_put(x, dev) for x in xs]


@pytest.mark.parametrize("lower_bound, state_dtype", [(None, jnp.bfloat16), (LB, jnp.float32)])
def test_public_api_matches_reference(kernel_impl, lower_bound, state_dtype):
  """``kda_decode(impl=kernel)`` vs ``kda_decode(impl="xla")`` (``kda_decode_reference``), speculative form."""
  args, pool = _inputs(6, 3, 2, 2, 64, 64, 8, jnp.bfloat16, state_dtype)
  args = _on_device0(*args)
  slots = jnp.asarray([[0, 1], [-1, 3], [4, 5]], jnp.int32)
  accepted = jnp.asarray([2, 1, 1], jnp.int32)
  pool = pool.at[jnp.asarray([2, 3, 6, 7])].set(POISON)
  outs = {}
  for impl in ("xla", kernel_impl):
    config = KdaConfig(lower_bound=lower_bound, state_dtype=state_dtype, impl=impl)
    (p,) = _on_device0(pool)
    outs[impl] = kda_decode(*args[:5], A_log=args[5], dt_bias=args[6], state_pool=p, state_indices=slots,
                            num_accepted=accepted, config=config)
  (o_ref, p_ref), (o, p) = outs["xla"], outs[kernel_impl]
  assert o.shape == o_ref.shape and o.dtype == o_ref.dtype == jnp.bfloat16 and p.dtype == p_ref.dtype
  # Same f32 math in a different order; both round o to bf16 (and the state to bf16 for that pool), so
  # they may land one bf16 ulp apart: 2^-8 of O(1) values.
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=8e-3, atol=8e-3)
  np.testing.assert_allclose(np.asarray(p, np.float32), np.asarray(p_ref, np.float32), rtol=8e-3, atol=8e-3)
  untouched = jnp.asarray([2, 3, 6, 7])
  np.testing.assert_array_equal(np.asarray(p[untouched]), np.asarray(pool[untouched]))


@pytest.mark.parametrize("lower_bound", [None, LB])
def test_prefill_then_decode_steps_equal_longer_prefill(kernel_impl, lower_bound):
  """``kda_prefill(T - j)`` then j kernel decode steps equals ``kda_prefill(T)``: outputs and final state."""
  total, j, heads, kdim, vdim = 7, 2, 2, 64, 64
  args, pool = _inputs(7, 1, total, heads, kdim, vdim, 4)
  # Slices are taken in NumPy: every eager jnp slice of a new shape would be one more XLA compile.
  q, k, v, g_raw, beta_raw = (np.asarray(a[0]) for a in args[:5])
  A_log, dt_bias = _on_device0(*args[5:])
  pool = pool.at[jnp.asarray([0, 3])].set(POISON).at[2].set(pool[1])  # both sequences resume one state
  # One packed prefill (one compile): the whole sequence into slot 1, its first T - j tokens into slot 2.
  packed = _on_device0(*(np.concatenate([x, x[:total - j]]) for x in (q, k, v, g_raw, beta_raw)))
  o_full, p = kda_prefill(*packed, A_log=A_log, dt_bias=dt_bias,
                          cu_seqlens=jnp.asarray([0, total, 2 * total - j], jnp.int32), state_pool=pool,
                          state_indices=jnp.asarray([1, 2], jnp.int32), has_initial_state=jnp.asarray([True, True]),
                          config=KdaConfig(lower_bound=lower_bound, impl="xla"))
  config = KdaConfig(lower_bound=lower_bound, impl=kernel_impl)
  (p,) = _on_device0(p)
  for t in range(total - j, total):
    step = _on_device0(*(x[t:t + 1] for x in (q, k, v, g_raw, beta_raw)))
    o, p = kda_decode(*step, A_log=A_log, dt_bias=dt_bias, state_pool=p, state_indices=jnp.asarray([2], jnp.int32),
                      config=config)
    # Chunked (WY) prefill vs token recurrence, both f32 with O(1) values over 7 tokens: ~1e-6 apart.
    np.testing.assert_allclose(np.asarray(o[0]), np.asarray(o_full[t]), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(p[2]), np.asarray(p[1]), rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(p[jnp.asarray([0, 3])]), np.asarray(pool[jnp.asarray([0, 3])]))

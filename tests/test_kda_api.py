"""Public ``kda_prefill`` (impl="xla"): varlen, pool slots, checkpoints, state dtypes, jit, dispatch, and every
validation error of ``kda_prefill`` / ``kda_decode``."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.kda import KdaConfig, KdaTuning, api, default_tuning, kda_decode, kda_prefill, reference
from pallas_kernels.kda.config import DECODE_STATE_IO
from pallas_kernels.testing import bits, kda_gate_params, kda_inputs, kda_prefill_oracle, rel_rmse

H, K, V, P = 2, 16, 16, 16
LENS = (0, 1, 63, 64, 65, 200)
# Per sequence of LENS: pool slot, has_initial_state, and (offset, slot) checkpoints. Slot 3: a length-0
# sequence with an initial state (must stay bitwise). Slot 5: no initial state, poisoned with NaN (must not
# be read). Sequence 2 has no slot. A checkpoint at offset == L, one with slot -1, three in one sequence.
SLOTS = (3, 5, -1, 7, 9, 11)
HAS = (True, False, True, True, True, False)
CKPTS = ((), (), (), ((64, 12),), ((64, -1),), ((64, 13), (128, 14), (192, 2)))
NAN_SLOTS = (0, 5)


def make_prefill(seed, lens=LENS, slots=SLOTS, has=HAS, ckpts=CKPTS, *, dtype=jnp.float32,
                 state_dtype=jnp.float32):
  """``kda_prefill``'s arguments: realistic raw inputs (``kda_inputs``, gate parameters with a small centred
  ``dt_bias``) and a pool poisoned with 1e30 (NaN in NAN_SLOTS) except the initial states."""
  rng = np.random.default_rng(seed)
  T = sum(lens)
  pool = np.full((P, H, V, K), 1e30, np.float32)
  pool[list(NAN_SLOTS)] = np.nan
  for s, h in zip(slots, has):
    if h and s >= 0:
      pool[s] = rng.standard_normal((H, V, K))
  offsets = [o for c in ckpts for o, _ in c]
  x = kda_inputs(rng, (T,), H, K, V)
  A_log, dt_bias = kda_gate_params(rng, H, K, dt_bias_std=0.1)
  return dict(
      q=jnp.asarray(x["q"], dtype), k=jnp.asarray(x["k"], dtype), v=jnp.asarray(x["v"], dtype),
      g_raw=jnp.asarray(x["g_raw"]), beta_raw=jnp.asarray(x["beta_raw"]), A_log=jnp.asarray(A_log),
      dt_bias=jnp.asarray(dt_bias), cu_seqlens=jnp.asarray(np.cumsum((0,) + tuple(lens)), jnp.int32),
      state_pool=jnp.asarray(pool, state_dtype), state_indices=jnp.asarray(slots, jnp.int32),
      has_initial_state=jnp.asarray(has),
      checkpoint_indptr=jnp.asarray(np.cumsum([0] + [len(c) for c in ckpts]), jnp.int32),
      checkpoint_offsets=jnp.asarray(offsets, jnp.int32),
      checkpoint_slots=jnp.asarray([s for c in ckpts for _, s in c], jnp.int32))


def expected_prefill(a, lower_bound, scale=None):
  """``kda_prefill_oracle`` of the arguments ``a``: outputs, and every slot the call must write with its state."""
  o, pool, written = kda_prefill_oracle(**a, lower_bound=lower_bound, scale=scale)
  return o, {s: pool[s] for s in written}


def check_untouched(old_pool, new_pool, written):
  for s in range(P):
    if s not in written:
      np.testing.assert_array_equal(bits(new_pool[s]), bits(old_pool[s]), err_msg=f"slot {s} changed")


# RMSE ratios vs the float64 oracle, of o and of every written state. Bound 5e-5: f32 rounding of the chunked
# WY form (see test_kda_reference), still 200x tighter than the 0.01 f32-state orientation.
# ``chunk_heads``: the reference's batches of (chunk, head) pairs; None: its default, one batch of the 12 chunks
# here; 10: five chunks a batch, three batches of which the last is padded, the state carried across them.
@pytest.mark.parametrize("chunk_heads", [None, 5 * H])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prefill_varlen_pool_checkpoints(lower_bound, chunk_heads, monkeypatch):
  if chunk_heads is not None:
    monkeypatch.setattr(reference, "PREP_CHUNK_HEADS", chunk_heads)
    jax.clear_caches()  # kda_prefill's jit would otherwise reuse a trace made with the default
  a = make_prefill(0)
  o, pool = kda_prefill(**a, config=KdaConfig(lower_bound=lower_bound, impl="xla"))
  assert o.shape == a["v"].shape and o.dtype == jnp.float32
  assert pool.shape == a["state_pool"].shape and pool.dtype == jnp.float32
  o_want, writes = expected_prefill(a, lower_bound)
  assert rel_rmse(o, o_want) < 5e-5
  for s, want in writes.items():
    assert rel_rmse(pool[s], want) < 5e-5, s
  assert set(writes) == {5, 7, 9, 11, 12, 13, 14, 2}
  check_untouched(a["state_pool"], pool, writes)
  if chunk_heads is not None:
    jax.clear_caches()  # no later test gets this trace


def test_prefill_xla_memory_at_32k_tokens_and_32_heads():
  """The pure-JAX prefill of one 32K-token prompt at 32 heads (the softplus gate, whose per-pair exponents are the
  largest temporaries) compiles to a working set of a few times its 1 GiB of arguments: vectorising the
  chunk-parallel stage over every chunk at once took several times the bound (benchmarks/RESULTS.md, session
  41)."""
  T, Hs, D = 32768, 32, 128
  sd = jax.ShapeDtypeStruct
  args = [sd((T, Hs, D), jnp.bfloat16)] * 4 + [sd((T, Hs), jnp.bfloat16)]
  kw = dict(A_log=sd((Hs,), jnp.float32), dt_bias=sd((Hs, D), jnp.float32), cu_seqlens=sd((2,), jnp.int32),
            state_pool=sd((4, Hs, D, D), jnp.float32), state_indices=sd((1,), jnp.int32),
            has_initial_state=sd((1,), jnp.bool_))
  fn = jax.jit(lambda *a, **k: kda_prefill(*a, **k, config=KdaConfig(impl="xla")))
  memory = fn.trace(*args, **kw).lower().compile().memory_analysis()
  assert memory.argument_size_in_bytes < 1.1 * 2 ** 30
  assert memory.temp_size_in_bytes < 5 * 2 ** 30, memory.temp_size_in_bytes / 2 ** 30


# Extreme but valid Kimi-Linear gates (unbounded below): with FLA's dt_bias init (softplus of 1e-3 .. 1e-1)
# A_log = 16 / 20 decays by 1e4 .. 5e7 per token, and three spiky tokens (g_raw = 1e5) cut some chunks
# short. The chunked form must stay finite and as accurate as for realistic gates: same bound as above.
@pytest.mark.parametrize("A_log, spiky", [(16.0, False), (20.0, False), (None, True)],
                         ids=["A_log=16", "A_log=20", "spiky"])
def test_prefill_extreme_gates(A_log, spiky):
  a = make_prefill(2)
  a["dt_bias"] = jnp.asarray(kda_gate_params(np.random.default_rng(2), H, K)[1])
  if A_log is not None:
    a["A_log"] = jnp.full((H,), A_log, jnp.float32)
  if spiky:
    a["g_raw"] = a["g_raw"].at[jnp.asarray([10, 70, 170])].set(1e5)
  o, pool = kda_prefill(**a, config=KdaConfig(impl="xla"))
  o_want, writes = expected_prefill(a, None)
  assert rel_rmse(o, o_want) < 5e-5
  for s, want in writes.items():
    assert rel_rmse(pool[s], want) < 5e-5, s
  check_untouched(a["state_pool"], pool, writes)


# bf16 q/k/v, bf16 pool (state rounded once per write), o in bf16. The oracle gets the same bf16-rounded
# inputs and initial states, so only output rounding is compared: one bf16 rounding is an RMSE ratio of
# roughly 2^-9 (~2e-3). Bound 4e-3: about twice that, 7x tighter than the 0.03 bf16-state orientation.
def test_prefill_bf16_state():
  a = make_prefill(1, dtype=jnp.bfloat16, state_dtype=jnp.bfloat16)
  o, pool = kda_prefill(**a, config=KdaConfig(lower_bound=-5.0, state_dtype=jnp.bfloat16, impl="xla"))
  assert o.shape == a["v"].shape and o.dtype == jnp.bfloat16
  assert pool.shape == a["state_pool"].shape and pool.dtype == jnp.bfloat16
  o_want, writes = expected_prefill(a, -5.0)
  assert rel_rmse(o, o_want) < 4e-3
  for s, want in writes.items():
    assert rel_rmse(pool[s], want) < 4e-3, s
  check_untouched(a["state_pool"], pool, writes)


def test_prefill_traced_indices_under_jit():
  """The model calls kda_prefill inside jax.jit: traced cu_seqlens/slots skip the value checks and give the
  same result as the eager call (which checks them). No checkpoints here (the default-argument path)."""
  lens, slots, has = (5, 0, 70), (4, 6, 1), (True, True, False)
  a = make_prefill(2, lens, slots, has, ((), (), ()))
  for key in ("checkpoint_indptr", "checkpoint_offsets", "checkpoint_slots"):
    del a[key]
  cfg = KdaConfig(scale=0.3, impl="xla")
  o, pool = kda_prefill(**a, config=cfg)
  idx = ("cu_seqlens", "state_indices", "has_initial_state")

  @jax.jit
  def run(cu_seqlens, state_indices, has_initial_state):
    return kda_prefill(**{**a, "cu_seqlens": cu_seqlens, "state_indices": state_indices,
                          "has_initial_state": has_initial_state}, config=cfg)

  o_jit, pool_jit = run(*(a[k] for k in idx))
  # Inlined into the outer jit, XLA fuses differently: f32 rounding differences only; poisoned slots must
  # still match bitwise (assert_array_equal on NaN/1e30).
  np.testing.assert_allclose(np.asarray(o_jit), np.asarray(o), rtol=1e-4, atol=2e-5)
  np.testing.assert_allclose(np.asarray(pool_jit), np.asarray(pool), rtol=1e-4, atol=2e-5)
  check_untouched(pool, pool_jit, {4, 1})
  o_want, writes = expected_prefill(a, None, scale=0.3)
  assert rel_rmse(o, o_want) < 5e-5  # as test_prefill_varlen_pool_checkpoints
  assert set(writes) == {4, 1}  # slot 6: length 0 with an initial state
  for s, want in writes.items():
    assert rel_rmse(pool[s], want) < 5e-5
  check_untouched(a["state_pool"], pool, writes)


@pytest.mark.parametrize("impl", ["pallas", "interpret"])
def test_kernel_dispatch(impl, monkeypatch):
  """impl "pallas"/"interpret" hand the validated inputs to the kernel entry points (stubbed here; the
  kernels are tested in their own files), with empty checkpoint arrays when none are given, the prefill
  kernel its ``KdaTuning.prefill_v_blocks`` and the decode kernel its ``decode_state_io``, the
  ``default_tuning`` of the call's shapes where that is None."""
  seen = {}

  def fake(*args, config, interpret, **tuning):
    seen.update(args=args, config=config, interpret=interpret, tuning=tuning)
    return "sentinel"

  monkeypatch.setattr(api.prefill_kernel, "kda_prefill_mosaic", fake)
  monkeypatch.setattr(api.decode_kernel, "kda_decode_mosaic", fake)
  a = make_prefill(3, (3, 4), (0, 1), (False, True), ((), ()))
  for key in ("checkpoint_indptr", "checkpoint_offsets", "checkpoint_slots"):
    del a[key]
  cfg = KdaConfig(impl=impl)
  assert kda_prefill(**a, config=cfg) == "sentinel"
  assert seen["config"] is cfg and seen["interpret"] == (impl == "interpret")
  indptr, offsets, slots = seen["args"][-3:]
  np.testing.assert_array_equal(np.asarray(indptr), np.zeros(3))
  assert indptr.dtype == offsets.dtype == slots.dtype == jnp.int32
  assert offsets.shape == slots.shape == (0,)
  prefill_heuristic = default_tuning(num_seqs=2, num_heads=H, key_dim=K, value_dim=V, state_dtype=jnp.float32)
  assert seen["tuning"] == {"v_blocks": prefill_heuristic.prefill_v_blocks, "segments": 1}
  for v_blocks in (1, 2):
    assert kda_prefill(**a, config=KdaConfig(impl=impl, tuning=KdaTuning(prefill_v_blocks=v_blocks))) == "sentinel"
    assert seen["tuning"] == {"v_blocks": v_blocks, "segments": 1}
  # With segments the value-block rule counts the segments as sequences (a stand-in rule that takes 2 only for
  # more than 40 sequences shows it), unless the value blocks are given.
  monkeypatch.setattr(api.prefill_state, "choose_v_blocks", lambda num_seqs, num_heads, vdim: 2 if num_seqs > 40 else 1)
  assert kda_prefill(**a, config=KdaConfig(impl=impl, tuning=KdaTuning(prefill_segments=40))) == "sentinel"
  assert seen["tuning"] == {"v_blocks": 2, "segments": 40}
  assert kda_prefill(**a, config=KdaConfig(impl=impl, tuning=KdaTuning(prefill_segments=40,
                                                                       prefill_v_blocks=1))) == "sentinel"
  assert seen["tuning"] == {"v_blocks": 1, "segments": 40}
  d = decode_args()
  assert kda_decode(**d, config=cfg) == "sentinel"
  assert seen["interpret"] == (impl == "interpret") and seen["args"][-1] is None
  heuristic = default_tuning(num_seqs=3, num_heads=H, key_dim=K, value_dim=V, state_dtype=jnp.float32)
  assert seen["tuning"] == {"state_io": heuristic.decode_state_io}
  assert kda_decode(**d, config=KdaConfig(impl=impl, tuning=KdaTuning())) == "sentinel"
  assert seen["tuning"] == {"state_io": heuristic.decode_state_io}
  for state_io in DECODE_STATE_IO:
    assert kda_decode(**d, config=KdaConfig(impl=impl, tuning=KdaTuning(decode_state_io=state_io))) == "sentinel"
    assert seen["tuning"] == {"state_io": state_io}


# ------------------------------------------------------------------------------------------------------
# Validation: every error, with the argument named.

def decode_args(spec=False):
  rng = np.random.default_rng(4)
  N, S1 = 3, 3
  lead = (N, S1) if spec else (N,)
  d = {n: jnp.asarray(x) for n, x in kda_inputs(rng, lead, H, K, V).items()}
  d.update(A_log=jnp.zeros((H,), jnp.float32), dt_bias=jnp.zeros((H, K), jnp.float32),
           state_pool=jnp.zeros((P, H, V, K), jnp.float32))
  if spec:
    d.update(state_indices=jnp.asarray([[0, 1, 2], [3, 4, 5], [-1, -1, -1]], jnp.int32),
             num_accepted=jnp.asarray([1, 3, 2], jnp.int32))
  else:
    d.update(state_indices=jnp.asarray([0, 1, -1], jnp.int32))
  return d


def _set(**kw):
  return lambda a: {**a, **kw}


def _map(key, fn):
  return lambda a: {**a, key: fn(a[key])}


i32 = lambda *x: jnp.asarray(x, jnp.int32)

# T = 266, cu_seqlens = [0, 0, 1, 64, 128, 261, 266], checkpoints (64 -> 12) for sequence 3 and
# (64 -> -1), (128 -> 13) for sequence 4: indptr [0, 0, 0, 0, 1, 3, 3].
VAL_LENS = (0, 1, 63, 64, 133, 5)
VAL_CKPTS = ((), (), (), ((64, 12),), ((64, -1), (128, 13)), ())

PREFILL_ERRORS = [
    ("q-ndim", _map("q", lambda x: x[None]), r"q must have shape \(\*, \*, \*\), got \(1, 266, 2, 16\)"),
    ("q-dtype", _map("q", lambda x: x.astype(jnp.int32)), r"q must have dtype in .*got int32"),
    ("k-shape", _map("k", lambda x: x[:, :, :8]), r"k must have shape \(266, 2, 16\), got \(266, 2, 8\)"),
    ("k-dtype", _map("k", lambda x: x.astype(jnp.bfloat16)), r"k must have the dtype of q \(float32\), got bfloat16"),
    ("v-shape", _map("v", lambda x: x[:, :1]), r"v must have shape \(266, 2, \*\), got \(266, 1, 16\)"),
    ("v-dtype", _map("v", lambda x: x.astype(jnp.float16)), r"v must have the dtype of q"),
    ("g_raw-shape", _map("g_raw", lambda x: x[:-1]), r"g_raw must have shape \(266, 2, 16\)"),
    ("g_raw-dtype", _map("g_raw", lambda x: x.astype(jnp.int32)), r"g_raw must have dtype"),
    ("beta_raw-shape", _map("beta_raw", lambda x: x[..., None]), r"beta_raw must have shape \(266, 2\)"),
    ("beta_raw-dtype", _map("beta_raw", lambda x: x.astype(jnp.int32)), r"beta_raw must have dtype"),
    ("A_log-shape", _map("A_log", lambda x: x[None]), r"A_log must have shape \(2,\)"),
    ("A_log-dtype", _map("A_log", lambda x: x.astype(jnp.bfloat16)), r"A_log must have dtype in \['float32'\]"),
    ("dt_bias-shape", _map("dt_bias", lambda x: x.reshape(-1)), r"dt_bias must have shape \(2, 16\)"),
    ("dt_bias-dtype", _map("dt_bias", lambda x: x.astype(jnp.bfloat16)), r"dt_bias must have dtype"),
    ("pool-shape", _map("state_pool", lambda x: x[..., :8]), r"state_pool must have shape \(\*, 2, 16, 16\)"),
    ("pool-dtype", _map("state_pool", lambda x: x.astype(jnp.bfloat16)),
     r"state_pool must have config.state_dtype \(float32\), got bfloat16"),
    ("cu-ndim", _map("cu_seqlens", lambda x: x[None]), r"cu_seqlens must have shape \(\*,\)"),
    ("cu-len", _set(cu_seqlens=i32(0)), r"cu_seqlens must have shape \(N \+ 1,\) with N >= 1, got \(1,\)"),
    ("cu-dtype", _map("cu_seqlens", lambda x: x.astype(jnp.float32)), r"cu_seqlens must have dtype in \['int32'\]"),
    ("cu-start", _set(cu_seqlens=i32(1, 1, 1, 64, 128, 261, 266)),
     r"cu_seqlens must be non-decreasing from 0 to T = 266"),
    ("cu-decreasing", _set(cu_seqlens=i32(0, 0, 1, 64, 63, 261, 266)), r"cu_seqlens must be non-decreasing"),
    ("cu-end", _set(cu_seqlens=i32(0, 0, 1, 64, 128, 261, 265)),
     r"from 0 to T = 266, got \[0, 0, 1, 64, 128, 261, 265\]"),
    ("indices-shape", _map("state_indices", lambda x: x[:-1]), r"state_indices must have shape \(6,\), got \(5,\)"),
    ("indices-dtype", _map("state_indices", lambda x: x.astype(jnp.int16)), r"state_indices must have dtype"),
    ("indices-high", _set(state_indices=i32(3, 5, -1, 7, 9, 16)),
     r"state_indices must be pool slots in \[-1, 16\).*\[-1, 16\]"),
    ("indices-low", _set(state_indices=i32(3, 5, -2, 7, 9, 11)), r"state_indices must be pool slots in \[-1, 16\)"),
    ("has-shape", _map("has_initial_state", lambda x: x[:2]), r"has_initial_state must have shape \(6,\)"),
    ("has-dtype", _map("has_initial_state", lambda x: x.astype(jnp.int32)),
     r"has_initial_state must have dtype in \['bool'\]"),
    ("ckpt-partial", _set(checkpoint_slots=None),
     r"must be given together, got indptr=True, offsets=True, slots=False"),
    ("indptr-shape", _map("checkpoint_indptr", lambda x: x[:-1]), r"checkpoint_indptr must have shape \(7,\)"),
    ("indptr-dtype", _map("checkpoint_indptr", lambda x: x.astype(jnp.uint32)), r"checkpoint_indptr must have dtype"),
    ("offsets-dtype", _map("checkpoint_offsets", lambda x: x.astype(jnp.float32)),
     r"checkpoint_offsets must have dtype"),
    ("ckslots-shape", _map("checkpoint_slots", lambda x: x[:-1]),
     r"checkpoint_slots must have shape \(3,\), got \(2,\)"),
    ("indptr-values", _set(checkpoint_indptr=i32(0, 0, 0, 0, 1, 2, 2)),
     r"checkpoint_indptr must be non-decreasing from 0 to M = 3"),
    ("offset-multiple", _set(checkpoint_offsets=i32(64, 64, 100)),
     r"multiples of chunk_size \(64\) in \(0, L_n\], got offset 100 for a sequence of length 133 \(checkpoint 2\)"),
    ("offset-zero", _set(checkpoint_offsets=i32(0, 64, 128)), r"got offset 0 for a sequence of length 64"),
    ("offset-past-end", _set(checkpoint_offsets=i32(128, 64, 128)), r"got offset 128 for a sequence of length 64"),
    ("ckslot-range", _set(checkpoint_slots=i32(12, -1, 99)), r"checkpoint_slots must be pool slots in \[-1, 16\)"),
    ("dup-final", _set(state_indices=i32(3, 5, -1, 7, 7, 11)),
     r"destination slots in state_indices and checkpoint_slots must be distinct \(-1 excepted\), "
     r"got slots \[7\] written more than once"),
    ("dup-final-ckpt", _set(checkpoint_slots=i32(12, -1, 11)),
     r"destination slots in state_indices and checkpoint_slots must be distinct .*got slots \[11\] written"),
    ("pool-empty", _set(state_pool=jnp.zeros((0, H, V, K)), state_indices=i32(-1, -1, -1, -1, -1, -1),
                        checkpoint_slots=i32(-1, -1, -1)),
     r"state_pool must have at least one slot \(shape\[0\] = P >= 1\), got P = 0"),
]


@pytest.mark.parametrize("mutate, match", [pytest.param(m, r, id=i) for i, m, r in PREFILL_ERRORS])
def test_prefill_validation(mutate, match):
  a = make_prefill(5, VAL_LENS, SLOTS, HAS, VAL_CKPTS)
  with pytest.raises(ValueError, match=match):
    kda_prefill(**mutate(a), config=KdaConfig(impl="xla"))


DECODE_ERRORS = [
    (False, "q-ndim", _map("q", lambda x: x[0]),
     r"q must have shape \(N, H, K\) or \(N, 1 \+ S, H, K\), got \(2, 16\)"),
    (False, "k-shape", _map("k", lambda x: x[:2]), r"k must have shape \(3, 2, 16\), got \(2, 2, 16\)"),
    (False, "pool-dtype", _map("state_pool", lambda x: x.astype(jnp.bfloat16)),
     r"state_pool must have config.state_dtype"),
    (False, "pool-empty", _set(state_pool=jnp.zeros((0, H, V, K)), state_indices=i32(-1, -1, -1)),
     r"state_pool must have at least one slot \(shape\[0\] = P >= 1\), got P = 0"),
    (False, "indices-shape", _map("state_indices", lambda x: x[:, None]),
     r"state_indices must have shape \(3,\), got \(3, 1\)"),
    (False, "indices-dtype", _map("state_indices", lambda x: x.astype(jnp.float32)), r"state_indices must have dtype"),
    (False, "indices-range", _set(state_indices=i32(0, 16, 1)), r"state_indices must be pool slots in \[-1, 16\)"),
    (False, "accepted-unexpected", _set(num_accepted=i32(1, 1, 1)),
     r"num_accepted is only for the speculative form \(q of shape \[N, 1 \+ S, \.\.\.\]\), "
     r"got q of shape \(3, 2, 16\)"),
    (False, "dup", _set(state_indices=i32(4, -1, 4)),
     r"destination slots in state_indices must be distinct .*got slots \[4\] written more than once"),
    (True, "spec-indices-shape", _map("state_indices", lambda x: x[:, :2]),
     r"state_indices must have shape \(3, 3\), got \(3, 2\)"),
    (True, "accepted-missing", _set(num_accepted=None),
     r"num_accepted \(\[N\] int32\) is required with the speculative form, got q of shape \(3, 3, 2, 16\)"),
    (True, "accepted-shape", _map("num_accepted", lambda x: x[:2]), r"num_accepted must have shape \(3,\)"),
    (True, "accepted-dtype", _map("num_accepted", lambda x: x.astype(jnp.float32)), r"num_accepted must have dtype"),
    (True, "accepted-low", _set(num_accepted=i32(0, 1, 1)),
     r"num_accepted must be in \[1, 1 \+ S\] = \[1, 3\], got values in \[0, 1\]"),
    (True, "accepted-high", _set(num_accepted=i32(1, 4, 1)), r"num_accepted must be in \[1, 1 \+ S\] = \[1, 3\]"),
    (True, "spec-dup", _set(state_indices=i32([0, 1, 2], [3, 4, 1], [-1, -1, -1])),
     r"destination slots in state_indices must be distinct .*got slots \[1\] written more"),
]


@pytest.mark.parametrize("spec, mutate, match", [pytest.param(s, m, r, id=i) for s, i, m, r in DECODE_ERRORS])
def test_decode_validation(spec, mutate, match):
  with pytest.raises(ValueError, match=match):
    kda_decode(**mutate(decode_args(spec)), config=KdaConfig(impl="xla"))


def test_decode_padding_rows_are_not_checked_for_duplicates():
  """Rows whose read slot is -1 write nothing, so their other columns may repeat live slots."""
  d = decode_args(spec=True)
  d["state_indices"] = i32([0, 1, 2], [3, 4, 5], [0, 1, -1])
  d["num_accepted"] = i32(1, 1, 3)
  o, pool = kda_decode(**d, config=KdaConfig(impl="xla"))
  assert o.shape == (3, 3, H, V) and pool.shape == (P, H, V, K)
  np.testing.assert_array_equal(np.asarray(o[2]), 0.0)


def test_ml_dtypes_bf16_round_trip_is_exact():
  """check_untouched compares bf16 slots by bits: bf16 -> f32 -> bf16 must be the identity."""
  x = np.random.default_rng(6).standard_normal(1000).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(bits(x.astype(np.float32).astype(ml_dtypes.bfloat16)), bits(x))


@pytest.mark.parametrize("field, value, match", [
    ("scale", float("inf"), r"scale must be a finite float > 0 or None, got inf"),
    ("scale", float("nan"), r"scale must be a finite float > 0 or None, got nan"),
    ("scale", 0.0, r"scale must be a finite float > 0 or None, got 0.0"),
    ("scale", -1.0, r"scale must be a finite float > 0 or None, got -1.0"),
    ("scale", "x", r"scale must be a float or None, got 'x'"),
    ("lower_bound", "x", r"lower_bound must be a float or None, got 'x'"),
    ("lower_bound", float("nan"), r"lower_bound must be in \[-5, 0\) or None, got nan"),
    ("lower_bound", -6.0, r"lower_bound must be in \[-5, 0\) or None, got -6.0"),
])
def test_config_validation(field, value, match):
  with pytest.raises(ValueError, match=match):
    KdaConfig(**{field: value})

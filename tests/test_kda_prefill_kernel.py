"""KDA prefill kernel (Pallas Mosaic GPU): interpret mode on CPU, compiled on a Hopper GPU (``gpu`` marker).

Every case checks the kernel against the float64 token recurrence ``testing.kda_prefill_oracle`` (the pool
semantics included) and against ``impl="xla"``, with the tolerances ``kda_support.PREFILL_TOL`` (RMSE of the
difference / RMS of the oracle, over all of ``o`` and over every written slot; derived next to them).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import prefill_combine, prefill_kernel, prefill_state
from pallas_kernels.mosaic_interpret import interpret_mode
from pallas_kernels.testing import kda_gate_params, kda_inputs, kda_prefill_oracle, rel_rmse

from kda_support import PREFILL_TOL, check_prefill, prefill_to_jax, run_prefill

SMALL = dict(lens=(70, 0, 30), H=1, K=64, V=64)
SMALL_PAIR = dict(lens=(70, 0, 30), H=1, K=64, V=128)  # two V-blocks: one program or two
SMALL_WIDE = dict(lens=(70, 0, 30), H=1, K=128, V=128)  # the model's head size, also in interpret mode
LARGE = dict(lens=(0, 1, 63, 64, 65, 1300), H=4, K=128, V=128)
# A checkpoint after every chunk of long sequences: the state pass stages a state for its slot and reuses that
# memory at every chunk, so a store that has not read its staging before the next chunk overwrites it shows here
# (on the GPU only: interpret mode does not alias SMEM).
EVERY_CHUNK = dict(lens=(1300, 1, 640, 700), H=8, K=128, V=128, ck_step=64)
POISON = 1e30


def _problem(seed: int, lens, H: int, K: int, V: int, *, saturated: bool, state_dtype, lower_bound,
             ck_step: int | None = None, shuffled: bool = False):
  """Realistic raw inputs (``kda_inputs`` with ``g_raw`` of std 2, the model's gate parameters); ``saturated``
  shifts ``g_raw`` by 3, pushing the gate to its extreme (lb per token, or a softplus decay of tens per token).
  ``ck_step``: tokens between checkpoints (default: a multiple of 64 that gives each sequence about three).
  ``shuffled``: each sequence's checkpoints in a random order, one of them twice (to another slot)."""
  rng = np.random.default_rng(seed)
  T = int(sum(lens))
  x = kda_inputs(rng, (T,), H, K, V, g_scale=2.0, g_shift=3.0 if saturated else 0.0)
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
    seq_offsets = list(range(64, lens[n] + 1, ck_step or 64 * max(1, lens[n] // 192)))
    if shuffled and seq_offsets:
      seq_offsets = [int(o) for o in rng.permutation(seq_offsets)] + [int(rng.choice(seq_offsets))]
    for off in seq_offsets:
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


def _oracle(inputs, pool, arrays, *, lower_bound):
  """``kda_prefill_oracle``: float64 ``o`` and new pool."""
  o, new_pool, _ = kda_prefill_oracle(**inputs, state_pool=pool, **arrays, lower_bound=lower_bound)
  return o, new_pool


# (sizes, value blocks per state-pass program): the heuristic, which takes 1 at these batch sizes, and 2.
CASES = [pytest.param(SMALL, None, id="small"), pytest.param(SMALL_PAIR, 2, id="small-pair"),
         pytest.param(SMALL_WIDE, None, id="small-wide"),
         pytest.param(LARGE, None, id="large", marks=pytest.mark.gpu),
         pytest.param(LARGE, 2, id="large-pair", marks=pytest.mark.gpu),
         pytest.param(EVERY_CHUNK, 1, id="every-chunk", marks=pytest.mark.gpu),
         pytest.param(EVERY_CHUNK, 2, id="every-chunk-pair", marks=pytest.mark.gpu)]
GATES = [pytest.param(-5.0, jnp.float32, False, id="lb-f32state"),
         pytest.param(None, jnp.bfloat16, True, id="softplus-bf16state-saturated")]
GATES_GPU = [pytest.param(-5.0, jnp.bfloat16, True, id="lb-bf16state-saturated", marks=pytest.mark.gpu),
             pytest.param(None, jnp.float32, False, id="softplus-f32state", marks=pytest.mark.gpu)]


def crossed(cases, gates=GATES, gpu_gates=GATES_GPU) -> list:
  """Every case with every gate. The GPU runs the whole product; interpret mode (seconds to a minute a case)
  runs each case with one of ``gates`` in turn, so that both gates still meet small, paired and wide cases."""
  params = []
  for i, case in enumerate(cases):
    for j, gate in enumerate(gates + gpu_gates):
      turn = () if j >= len(gates) or j == i % len(gates) else (pytest.mark.gpu,)
      params.append(pytest.param(*case.values, *gate.values, id=f"{case.id}-{gate.id}",
                                 marks=(*case.marks, *gate.marks, *turn)))
  return params


@pytest.mark.parametrize("sizes,v_blocks,lower_bound,state_dtype,saturated", crossed(CASES))
def test_prefill_matches_oracle_and_xla(kernel_impl, sizes, v_blocks, lower_bound, state_dtype, saturated):
  _check_against_oracle_and_xla(kernel_impl, 0, sizes, kda.KdaTuning(prefill_v_blocks=v_blocks), lower_bound,
                                state_dtype, saturated)


def _check_against_oracle_and_xla(kernel_impl, seed, sizes, tuning, lower_bound, state_dtype, saturated):
  """One ``_problem`` through the kernel with ``tuning``, against the float64 oracle and ``impl="xla"``."""
  x, pool, arrays, config = _problem(seed, saturated=saturated, state_dtype=state_dtype, lower_bound=lower_bound,
                                     **sizes)
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, state_dtype)
  o, new_pool = run_prefill(inputs, pool_j, arrays_j, kernel_impl, tuning=tuning, **config)
  assert o.dtype == jnp.bfloat16
  ref_o, ref_pool = _oracle(inputs, pool_j, arrays, lower_bound=lower_bound)
  T, H, _ = x["v"].shape
  tol = PREFILL_TOL[jnp.dtype(state_dtype)]
  check_prefill(o, new_pool, ref_o, ref_pool, pool_j, arrays, tol, T, H, sizes["V"])
  xo, xpool = run_prefill(inputs, pool_j, arrays_j, "xla", **config)
  check_prefill(o, new_pool, np.asarray(xo, np.float64), np.asarray(xpool, np.float64), pool_j, arrays, tol, T, H,
                sizes["V"])


# The shapes benchmarks/kda_prefill.py times against FlashKDA, with the model's gate (softplus, std-2 g_raw)
# and a few checkpoints a sequence (8 x 1024: four, as in its overheads): one 32K sequence at H = 32 (one pass),
# T = 8192 at H = 11 (K3's heads per GPU under TP9: the default splits it into segments) and eight 1024-token
# sequences at H = 96 (two value blocks a program).
REAL_SIZES = [pytest.param(dict(lens=(32768,), H=32, K=128, V=128), id="T32768-H32"),
              pytest.param(dict(lens=(8192,), H=11, K=128, V=128), id="T8192-H11"),
              pytest.param(dict(lens=(1024,) * 8, H=96, K=128, V=128, ck_step=256), id="8x1024-H96-ckpt4")]
# Tokens at the start of the first sequence that the float64 oracle recomputes (it runs token by token).
ORACLE_PREFIX = 320


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", REAL_SIZES)
def test_gpu_prefill_at_real_sizes(sizes, state_dtype):
  """The compiled kernel at the benchmark's sizes with the default tuning, poisoned untouched slots and
  checkpoints: against ``impl="xla"`` over every output and written slot (``check_prefill``, which also requires
  the untouched slots bitwise unchanged), and against the float64 oracle over the first sequence's first
  ``ORACLE_PREFIX`` tokens (which depend on nothing after them)."""
  x, pool, arrays, config = _problem(41, saturated=False, state_dtype=state_dtype, lower_bound=None, **sizes)
  if len(sizes["lens"]) == 1:  # _problem gives the last sequence slot -1: one sequence alone writes slot 1 instead
    arrays["state_indices"][0] = 1
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, state_dtype)
  o, new_pool = run_prefill(inputs, pool_j, arrays_j, "pallas", **config)
  assert o.dtype == jnp.bfloat16
  T, H = sum(sizes["lens"]), sizes["H"]
  tol = PREFILL_TOL[jnp.dtype(state_dtype)]
  xo, xpool = run_prefill(inputs, pool_j, arrays_j, "xla", **config)
  check_prefill(o, new_pool, np.asarray(xo, np.float64), np.asarray(xpool, np.float64), pool_j, arrays, tol, T, H,
                sizes["V"])
  n = ORACLE_PREFIX
  prefix = {name: a[:n] for name, a in inputs.items() if name not in ("A_log", "dt_bias")}
  ref_o, _, _ = kda_prefill_oracle(**prefix, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                                   cu_seqlens=np.array([0, n], np.int32),
                                   state_pool=np.zeros((1, H, sizes["V"], sizes["K"])),
                                   state_indices=np.array([-1], np.int32), has_initial_state=np.array([False]),
                                   lower_bound=None)
  assert not arrays["has_initial_state"][0] and rel_rmse(np.asarray(o[:n], np.float64), ref_o) < tol


# (sizes, segments, value blocks): a sequence shorter than its segments (lens 30 and 1 at G = 3), empty ones,
# checkpoints inside and at the edges of segments (every chunk in EVERY_CHUNK), two value blocks with K = 64
# (the transition pass then takes one), the transition pass with two value blocks (small-wide-12: 144 one-block
# programs) and the second pass with one.
SEGMENT_CASES = [pytest.param(SMALL, 3, None, id="small-3"), pytest.param(SMALL_PAIR, 2, 2, id="small-pair-2"),
                 pytest.param(SMALL_WIDE, 12, None, id="small-wide-12"),
                 pytest.param(dict(lens=(70, 0, 200, 1), H=1, K=64, V=64), 3, None, id="ragged-3"),
                 pytest.param(LARGE, 3, None, id="large-3", marks=pytest.mark.gpu),
                 pytest.param(LARGE, 6, 2, id="large-6-pair", marks=pytest.mark.gpu),
                 pytest.param(EVERY_CHUNK, 6, None, id="every-chunk-6", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("sizes,segments,v_blocks,lower_bound,state_dtype,saturated",
                         crossed(SEGMENT_CASES, gpu_gates=[]))
def test_segmented_state_pass_matches_oracle_and_xla(kernel_impl, sizes, segments, v_blocks, lower_bound,
                                                     state_dtype, saturated):
  """``KdaTuning.prefill_segments``: the state pass over runs of chunks in parallel (two passes and a combine)
  gives the one-pass results within the same tolerances, untouched slots bitwise unchanged."""
  _check_against_oracle_and_xla(kernel_impl, 1, sizes, kda.KdaTuning(prefill_segments=segments,
                                                                     prefill_v_blocks=v_blocks),
                                lower_bound, state_dtype, saturated)


@pytest.mark.parametrize("lens", [(0,), (1,), (64,), (65, 0, 63), (0, 0, 1, 64, 128, 129), (127, 1, 1, 1, 300, 0, 64)])
def test_index_table_layout(lens):
  """``index_table``: every chunk of every sequence has a slot of its own inside the static table (its first token
  and rows as the sequence says); no two share one; every other slot has no rows; the per-sequence rows hold each
  sequence's first slot, chunks, first token, length, slot, initial-state flag and checkpoint range."""
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  T, N = int(cu[-1]), len(lens)
  num_slots = -(-T // 64) + N
  si, has = np.arange(N, dtype=np.int32)[::-1].copy(), np.arange(N) % 2 == 0
  indptr = np.arange(N + 1, dtype=np.int32) * 2
  table = np.asarray(prefill_kernel.index_table(jnp.asarray(cu), jnp.asarray(si), jnp.asarray(has),
                                                jnp.asarray(indptr), num_slots))
  assert table.shape == (prefill_state.SEQ_META_ROWS + 2, num_slots) and table.dtype == np.int32
  starts, nch, tok, rows = table[0, :N], table[1, :N], table[-2], table[-1]
  np.testing.assert_array_equal(table[2:9, :N], np.stack([cu[:-1], np.diff(cu), si, has, indptr[:-1], indptr[1:],
                                                          np.zeros(N)]))
  owner = np.full(num_slots, -1)
  for n, L in enumerate(lens):
    assert nch[n] == -(-L // 64)
    for c in range(nch[n]):
      s = starts[n] + c
      assert 0 <= s < num_slots and owner[s] == -1, (n, c, s)
      owner[s] = n
      assert tok[s] == cu[n] + 64 * c and rows[s] == min(64, L - 64 * c), (n, c)
  np.testing.assert_array_equal(rows[owner < 0], 0)


# A checkpoint after every chunk, each sequence's list in a random order with one offset twice (to two slots), and
# runs that split the sequences (segments 3): the state pass walks a sorted list and scans an unsorted one.
SHUFFLED = dict(lens=(200, 0, 70, 1, 330), H=1, K=64, V=64, ck_step=64, shuffled=True)
SHUFFLED_LARGE = dict(LARGE, ck_step=64, shuffled=True)


@pytest.mark.parametrize("sizes,segments", [(SHUFFLED, 1), (SHUFFLED, 3),
                                            pytest.param(SHUFFLED_LARGE, 1, marks=pytest.mark.gpu),
                                            pytest.param(SHUFFLED_LARGE, 6, marks=pytest.mark.gpu)])
def test_checkpoints_in_any_order(kernel_impl, sizes, segments):
  _, _, arrays, _ = _problem(2, saturated=False, state_dtype=jnp.float32, lower_bound=-5.0, **sizes)
  ind, off = arrays["checkpoint_indptr"], arrays["checkpoint_offsets"]
  runs = [off[a:b] for a, b in zip(ind[:-1], ind[1:])]
  assert any((np.diff(r) < 0).any() for r in runs) and any(len(set(r)) < len(r) for r in runs)
  _check_against_oracle_and_xla(kernel_impl, 2, sizes, kda.KdaTuning(prefill_segments=segments), -5.0,
                                jnp.float32, False)


@pytest.mark.parametrize("segments", [None, 2])
def test_deterministic_and_shorter_than_a_chunk(kernel_impl, segments):
  """Two runs are bitwise equal; T < 64 (one partial chunk per sequence, an empty sequence in between; with
  segments, every sequence shorter than its segments)."""
  x, pool, arrays, config = _problem(1, lens=(5, 0, 20), H=1, K=64, V=64, saturated=False,
                                     state_dtype=jnp.float32, lower_bound=-5.0)
  config["tuning"] = kda.KdaTuning(prefill_segments=segments)
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, jnp.float32)
  o1, p1 = run_prefill(inputs, pool_j, arrays_j, kernel_impl, **config)
  o2, p2 = run_prefill(inputs, pool_j, arrays_j, kernel_impl, **config)
  np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
  np.testing.assert_array_equal(np.asarray(p1), np.asarray(p2))
  ref_o, ref_pool = _oracle(inputs, pool_j, arrays, lower_bound=-5.0)
  check_prefill(o1, p1, ref_o, ref_pool, pool_j, arrays, PREFILL_TOL[jnp.dtype(jnp.float32)], 25, 1, 64)


@pytest.mark.parametrize("impl,segments", [("kernel", None), ("kernel", 2), ("xla", None)])
def test_a_nan_token_stays_in_its_sequence(kernel_impl, impl, segments):
  """NaN in every input of one sequence's first token reaches no other sequence. The previous sequence ends in a
  partial chunk, whose 64-row raw tiles hold that token too, and a 0 coefficient in a matmul does not drop a NaN
  (0 * NaN is NaN): the kernel must zero those rows, not only weight them by 0. The previous sequence's o and the
  whole pool are bitwise those of the same call with the token finite; the NaN sequence's own o is NaN (with
  segments too: the NaN crosses from its first segment into the second through the combine)."""
  impl = kernel_impl if impl == "kernel" else impl
  config_extra = dict(tuning=kda.KdaTuning(prefill_segments=segments))
  x, pool, arrays, config = _problem(6, lens=(40, 30), H=1, K=64, V=64, saturated=False, state_dtype=jnp.float32,
                                     lower_bound=-5.0)
  assert arrays["state_indices"][1] == -1 and not len(arrays["checkpoint_slots"])  # only sequence 0 writes
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, jnp.float32)
  o_ok, pool_ok = run_prefill(inputs, pool_j, arrays_j, impl, **config, **config_extra)
  bad = {n: a.at[40].set(jnp.nan) if n in ("q", "k", "v", "g_raw", "beta_raw") else a for n, a in inputs.items()}
  o_bad, pool_bad = run_prefill(bad, pool_j, arrays_j, impl, **config, **config_extra)
  np.testing.assert_array_equal(np.asarray(o_bad[:40], np.float32), np.asarray(o_ok[:40], np.float32))
  np.testing.assert_array_equal(np.asarray(pool_bad), np.asarray(pool_ok))
  assert np.isnan(np.asarray(o_bad[40:], np.float32)).all()


@pytest.mark.parametrize("segments", [None, 3])
@pytest.mark.parametrize("lens", [(0, 70, 0), (0, 0, 0)], ids=["some-tokens", "no-tokens"])
def test_empty_sequences_write_zero_states(kernel_impl, lens, segments):
  """A length-0 sequence without an initial state writes the state of zero tokens from a zero start (zeros)
  into its slot, one with an initial state leaves its slot bitwise unchanged; as impl="xla"; with segments too."""
  x, pool, arrays, config = _problem(4, lens=lens, H=1, K=64, V=64, saturated=False, state_dtype=jnp.float32,
                                     lower_bound=None)
  arrays.update(state_indices=np.asarray([1, 2, 3], np.int32), has_initial_state=np.asarray([False, True, False]))
  pool[1:4] = np.random.default_rng(4).uniform(-4.0, 4.0, size=pool[1:4].shape)
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, jnp.float32)
  o, new_pool = run_prefill(inputs, pool_j, arrays_j, kernel_impl, tuning=kda.KdaTuning(prefill_segments=segments),
                            **config)
  np.testing.assert_array_equal(np.asarray(new_pool[np.asarray([1, 3])]), 0.0)
  ref_o, ref_pool = _oracle(inputs, pool_j, arrays, lower_bound=None)
  check_prefill(o, new_pool, ref_o, ref_pool, pool_j, arrays, PREFILL_TOL[jnp.dtype(jnp.float32)], sum(lens), 1, 64)
  xo, xpool = run_prefill(inputs, pool_j, arrays_j, "xla", **config)
  np.testing.assert_array_equal(np.asarray(xpool[np.asarray([1, 3])]), 0.0)


def test_prefix_identity(kernel_impl):
  """prefill(tokens[:128]) with a checkpoint, then prefill(tokens[128:]) from that slot == prefill(tokens):
  chunk boundaries coincide and an f32 checkpoint is the exact state, so the match is bitwise."""
  x, pool, _, _ = _problem(2, lens=(150,), H=1, K=64, V=64, saturated=False, state_dtype=jnp.float32,
                           lower_bound=-5.0)
  pool[:] = 0.0
  inputs, pool_j, _ = prefill_to_jax(x, pool, {}, jnp.float32)
  i32 = lambda *v: jnp.asarray(v, jnp.int32)
  full = dict(cu_seqlens=i32(0, 150), state_indices=i32(0), has_initial_state=jnp.asarray([False]),
              checkpoint_indptr=i32(0, 1), checkpoint_offsets=i32(128), checkpoint_slots=i32(1))
  o_full, pool_full = run_prefill(inputs, pool_j, full, kernel_impl, lower_bound=-5.0)
  tail_inputs = {n: (a[128:] if a.ndim and a.shape[0] == 150 else a) for n, a in inputs.items()}
  tail = dict(cu_seqlens=i32(0, 22), state_indices=i32(1), has_initial_state=jnp.asarray([True]))
  o_tail, pool_tail = run_prefill(tail_inputs, pool_full, tail, kernel_impl, lower_bound=-5.0)
  np.testing.assert_array_equal(np.asarray(o_tail, np.float32), np.asarray(o_full[128:], np.float32))
  np.testing.assert_array_equal(np.asarray(pool_tail[1]), np.asarray(pool_full[0]))


@pytest.mark.parametrize("K,V,v_blocks", [(96, 128, 1), (128, 96, 1), (128, 64, 2), (128, 192, 2)])
def test_unsupported_head_dims(K, V, v_blocks):
  z = jnp.zeros((64, 1, K), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="K must be|V must be"):
    prefill_kernel.kda_prefill_mosaic(z, z, jnp.zeros((64, 1, V), jnp.bfloat16), z, jnp.zeros((64, 1)),
                                      None, None, None, None, None, None, None, None, None,
                                      config=kda.KdaConfig(impl="interpret"), interpret=True, v_blocks=v_blocks)


def test_v_blocks_rule():
  """``default_tuning``'s ``prefill_v_blocks``: 2 once the one-block state-pass programs (``V / 64`` per head
  and sequence) are more than one wave of the 132 SMs and ``V / 64`` is even, else 1."""
  rule = lambda N, H, V: kda.default_tuning(num_seqs=N, num_heads=H, key_dim=128, value_dim=V,
                                            state_dtype=jnp.float32).prefill_v_blocks
  assert [rule(1, 96, 128), rule(8, 96, 128), rule(1, 67, 128)] == [2, 2, 2]
  assert [rule(1, 32, 128), rule(1, 11, 128), rule(1, 66, 128), rule(200, 4, 192), rule(0, 96, 128)] == [1] * 5


def test_segments_rule():
  """``default_tuning``'s ``prefill_segments``: ``132 // (V / 64 · H · N)`` runs per sequence where that is at least
  3 and the runs keep at least 8 chunks on average, else 1; decode (no ``num_tokens``) takes 1."""
  rule = lambda N, H, T, V=128: kda.default_tuning(num_seqs=N, num_heads=H, key_dim=128, value_dim=V,
                                                   state_dtype=jnp.float32, num_tokens=T).prefill_segments
  assert [rule(1, 11, 8192), rule(1, 16, 8192), rule(1, 11, 1536), rule(2, 4, 32768, 64)] == [6, 4, 3, 16]
  assert [rule(1, 32, 32768), rule(1, 96, 8192), rule(8, 96, 8192), rule(1, 11, 1535), rule(0, 11, 8192)] == [1] * 5
  assert kda.default_tuning(num_seqs=1, num_heads=11, key_dim=128, value_dim=128,
                            state_dtype=jnp.float32).prefill_segments == 1
  with pytest.raises(ValueError, match="num_tokens"):
    kda.default_tuning(num_seqs=1, num_heads=11, key_dim=128, value_dim=128, state_dtype=jnp.float32, num_tokens=-1)


@pytest.mark.parametrize("K,V,G,pool_dtype", [(64, 64, 3, jnp.float32), (64, 128, 1, jnp.bfloat16),
                                               (128, 128, 4, jnp.bfloat16),
                                               pytest.param(128, 256, 6, jnp.float32, marks=pytest.mark.gpu)])
def test_segment_combine_matches_float64(kernel_impl, K, V, G, pool_dtype):
  """``prefill_combine.combine``: every segment's first state against float64, within 5e-5 (rel RMSE per
  segment), which its three-part bf16 products meet and a single bf16 or TF32 product (2^-9, 2^-11) does not;
  the initial state read only from a slot that has one (the others start at zero, NaN-poisoned slots unread)."""
  rng = np.random.default_rng(5)
  N, H, P = 3, 2, 5
  # M like a run's transition (decay times mixing, spectral radius below 1); B and the states of a state's size.
  m = rng.normal(size=(N, G, H, K, K)) * (0.9 / np.sqrt(K))
  b = rng.normal(size=(N, G, H, V, K)) * 0.3
  bm = np.concatenate([b, m], axis=3).reshape(N * G, H, V + K, K).astype(np.float32)
  pool = jnp.asarray(rng.normal(size=(P, H, V, K)), pool_dtype)
  slots, has = np.array([2, -1, 4], np.int32), np.array([1, 1, 0], np.int32)
  pool = pool.at[jnp.array([0, 1, 3, 4])].set(jnp.nan)  # slot 4 belongs to a sequence without an initial state
  interpret = kernel_impl == "interpret"
  with interpret_mode(interpret):
    meta = np.zeros((prefill_state.SEQ_META_ROWS, N), np.int32)
    meta[prefill_state.SLOT_ROW], meta[prefill_state.INIT_ROW] = slots, has
    out = jax.jit(functools.partial(prefill_combine.combine, G=G, interpret=interpret))(
        jnp.asarray(bm), pool, jnp.asarray(meta))
  assert out.shape == (N * G, H, V, K) and out.dtype == jnp.float32
  out = np.asarray(out, np.float64)
  bm64, pool64 = bm.astype(np.float64).reshape(N, G, H, V + K, K), np.asarray(pool, np.float64)
  for n in range(N):
    s = pool64[slots[n]] if slots[n] >= 0 and has[n] else np.zeros((H, V, K))
    for j in range(G):
      assert rel_rmse(out[n * G + j], s) < 5e-5 if s.any() else not out[n * G + j].any(), (n, j)
      s = s @ bm64[n, j, :, V:] + bm64[n, j, :, :V]


@pytest.mark.parametrize("lower_bound,state_dtype,in_dtype", [
    (-5.0, jnp.float32, jnp.bfloat16), (None, jnp.bfloat16, jnp.float32)])
def test_lowers_for_cuda(lower_bound, state_dtype, in_dtype):
  """Mosaic GPU lowering and layout inference of both stages at the model's head size (K = V = 128),
  for sm_90a, on the CPU: catches layout, alignment and shared-memory-size errors without a GPU."""
  x, pool, arrays, config = _problem(3, lens=(130, 0, 70), H=2, K=128, V=128, saturated=False,
                                     state_dtype=state_dtype, lower_bound=lower_bound)
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, state_dtype, in_dtype)
  args = [inputs[n] for n in ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias")]
  args += [arrays_j[n] for n in ("cu_seqlens",)] + [pool_j] + [
      arrays_j[n] for n in ("state_indices", "has_initial_state", "checkpoint_indptr", "checkpoint_offsets",
                            "checkpoint_slots")]
  for v_blocks, segments in ((1, 1), (2, 1), (2, 3)):
    f = functools.partial(prefill_kernel._prefill, config=kda.KdaConfig(impl="pallas", **config),
                          interpret=False, v_blocks=v_blocks, segments=segments)
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def _prep_smem_bytes(lower_bound, monkeypatch) -> int:
  """The prep's SMEM (K = 128, bf16 inputs) by Mosaic GPU's own estimate when it lowers the kernel for sm_90a:
  the lowering's resource estimator (a private function of the pinned jax), read at its outermost call (it
  calls itself through the module for nested bodies)."""
  from jax._src.pallas.mosaic_gpu import lowering
  from pallas_kernels.kda import prefill_prep

  real, depth, found = lowering._estimate_resources, [0], []

  def estimate(ctx, jaxpr):
    depth[0] += 1
    try:
      rs = real(ctx, jaxpr)
    finally:
      depth[0] -= 1
    if depth[0] == 0:
      found.append(rs.smem_scratch_bytes)
    return rs

  T, H, K = 128, 1, 128
  tokens = jnp.zeros((T, H, K), jnp.bfloat16)
  args = (tokens,) * 4 + (jnp.zeros((H, T + 64), jnp.float32), jnp.zeros((H,), jnp.float32),
                          jnp.zeros((H, K), jnp.float32), jnp.zeros((2, 3), jnp.int32))
  f = functools.partial(prefill_prep.prep, scale=K ** -0.5, lower_bound=lower_bound, smem_operands=False)
  monkeypatch.setattr(lowering, "_estimate_resources", estimate)
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  assert len(found) == 1, found
  return found[0]


@pytest.mark.parametrize("lower_bound", [
    -5.0,
    pytest.param(None, marks=pytest.mark.xfail(strict=True, reason="the softplus prep takes 132 KiB: its f32 copy "
                                               "of k for the pairwise diagonal leaves room for one program per SM")),
])
def test_prep_smem_leaves_room_for_two_programs_per_sm(lower_bound, monkeypatch):
  """The prep is latency bound and hides its latency only behind a second program on the SM (README.md, "SMEM"
  and "Code size"): two programs, each with the driver's 1 KiB per block, must fit an H200 SM's 196 KiB
  shared-memory configuration, the one that leaves 60 KiB of L1 for their register spills."""
  smem = _prep_smem_bytes(lower_bound, monkeypatch)
  assert 2 * (smem + 1024) <= 196 * 1024, f"prep SMEM {smem / 1024:.1f} KiB: not two programs in 196 KiB"


@pytest.mark.parametrize("lb", [-5.0, -3.0, -1.0, -0.01])
def test_prep_w_scale_parts_stay_normal(lb):
  """Each of W's anchor-factor parts is a normal f32 at the lowest anchor the bound allows (every gate at the
  bound up to the anchor row), and no more parts than that takes."""
  from pallas_kernels.kda import prefill_prep as pp

  for b in range(pp.C // pp.BOUNDED_BLOCK):
    nu_min = (b * pp.BOUNDED_BLOCK + pp.BOUNDED_BLOCK // 2 + 1) * lb * np.log2(np.e)
    parts = pp.w_scale_parts(b, lb)
    assert nu_min / parts >= pp.W_PART_MIN_EXP > -126
    assert parts == 1 or nu_min / (parts - 1) < pp.W_PART_MIN_EXP
  assert [pp.w_scale_parts(b, -5.0) for b in range(2)] == [1, 3]
  assert pp.w_scale_parts(1, None) == 1


def test_prep_w_where_the_anchor_factor_is_below_f32():
  """The prep's W at a lower-bound block whose anchor factor 2^ν is below f32's range while the block's first
  rows' 2^G are not (README.md, "W from Kd"): one key channel is 0 over block 0, decays slowly to row 32 (G = -30
  in log2) and at the bound after it, so that block 1 alone gives W's column (below 2^-30) and its anchor (row
  48) is G = -30 - 16 · 5 · log2(e) ≈ -145. W as a single factor 2^ν would lose that column (0 with flushed
  denormals, a few bits otherwise); the float64 computation of W is the truth. Interpret mode, one chunk."""
  from pallas_kernels.kda import prefill_prep
  from pallas_kernels.mosaic_interpret import interpret_mode

  lb, T, K, V = -5.0, 64, 64, 64
  rng = np.random.default_rng(5)
  k = rng.standard_normal((T, 1, K)).astype(np.float32)
  k[:32, 0, 0] = 0.0
  g_raw = rng.normal(0.0, 2.0, (T, 1, K)).astype(np.float32)
  slow = -30.0 / 33 / np.log2(np.e)  # nats per token, so that G[32] = -30 in log2 units
  g_raw[:33, 0, 0] = np.log(slow / lb / (1.0 - slow / lb))  # the gate lb * sigmoid(x) gives `slow` there
  g_raw[33:, 0, 0] = 30.0  # the gate at its bound
  beta_raw = rng.standard_normal((T, 1)).astype(np.float32)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  args = (bf(rng.standard_normal((T, 1, K))), bf(k), bf(rng.standard_normal((T, 1, V))), jnp.asarray(g_raw),
          jnp.pad(jnp.asarray(beta_raw), ((0, 64), (0, 0))), jnp.zeros((1,), jnp.float32),
          jnp.zeros((1, K), jnp.float32), jnp.asarray([[0], [T]], jnp.int32))
  with interpret_mode(True):
    neg_w = prefill_prep.prep(*args, scale=K ** -0.5, lower_bound=lb, smem_operands=True)[2]
  got = -np.asarray(neg_w[0, 0], np.float64)

  kn = np.asarray(args[1], np.float64)[:, 0]
  kn = kn / np.sqrt((kn * kn).sum(axis=1, keepdims=True) + 1e-6)
  G = np.cumsum(lb / (1.0 + np.exp(-g_raw[:, 0].astype(np.float64))), axis=0) * np.log2(np.e)
  beta = 1.0 / (1.0 + np.exp(-beta_raw[:, 0].astype(np.float64)))
  decay = np.exp2(np.minimum(G[:, None, :] - G[None, :, :], 0.0))  # [r, s, K]; only s < r is used
  L = np.tril(beta[:, None] * np.einsum("rj,sj,rsj->rs", kn, kn, decay), -1)
  want = np.linalg.solve(np.eye(T) + L, beta[:, None] * kn * np.exp2(G))
  assert 2.0 ** -40 < np.abs(want[32:, 0]).max() < 2.0 ** -30 and not want[:32, 0].any()
  assert not np.isnan(got).any()
  err = np.abs(got[:, 0] - want[:, 0]).max() / np.abs(want[:, 0]).max()
  assert err < 2.0 ** -6, f"W's column behind an anchor below f32: relative error {err:.3g}"
  # The other channels, with realistic gates, to bf16 accuracy.
  np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=0, atol=2.0 ** -7 * np.abs(want[:, 1:]).max())

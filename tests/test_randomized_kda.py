"""Randomized differential tests of the KDA kernels against ``impl="xla"``.

``hypothesis`` draws whole batches: sequence lengths around the chunk (64) and sub-block (16) edges and 0,
initial-state mixes, -1 slots, checkpoint CSR patterns, speculative rows with ``num_accepted`` and padding
rows, both gates (Kimi-Linear softplus and the K3 lower bound), both state dtypes, and extreme but valid
gates (``A_log`` up to 20, spiky ``g_raw``). Inputs are realistic (never zeros; q/k are L2-normalised
inside the ops). The pool is filled with random values first; every slot a call does not name must come
back bitwise unchanged, every written slot must match the reference. Shapes are small on the CPU
(interpret mode) and the model's head size on a Hopper GPU.

Tolerances are those of the per-kernel tests, from ``kda_support``, which derives them next to each:
``PREFILL_TOL`` (RMSE ratio; the prefill kernel feeds bf16 operands to the tensor cores) and ``check_decode``'s
(f32 arithmetic as the reference; one bf16 rounding per token with a bf16 state). Every comparison fails on NaN.
The short convolution's randomized tests are in ``test_randomized_short_conv.py``.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, strategies as st

from pallas_kernels import util
from pallas_kernels.kda import KdaConfig, KdaTuning, kda_decode
from pallas_kernels.kda.config import CHUNK_SIZE as C
from pallas_kernels.testing import kda_gate_params, kda_inputs
from kda_support import PREFILL_TOL, check_decode, check_prefill, prefill_to_jax, run_prefill
from support import SEEDS, budget, decode_batches, decode_slots

ON_GPU = util.is_hopper_gpu()
# (H, K = V): small in interpret mode, the model's head size compiled.
HEADS, HEAD_DIM = (4, 128) if ON_GPU else (1, 64)
# Around 0, the 16-token sub-block and the 64-token chunk; longer ones only where they are cheap.
LENGTHS = [0, 1, 2, 15, 16, 17, 63, 64, 65] + ([127, 128, 129, 300] if ON_GPU else [100])


def _gate_params(rng: np.random.Generator, kind: str, H: int, K: int) -> tuple[np.ndarray, np.ndarray]:
  """``A_log [H]`` and ``dt_bias [H, K]``: the model's init, or an extreme rate (``A_log`` 16 or 20: decays
  of 1e4 per token and more with the softplus gate)."""
  return kda_gate_params(rng, H, K, A_log={"init": None, "A_log=16": 16.0, "A_log=20": 20.0}[kind])


def _raw_tokens(rng: np.random.Generator, lead: tuple[int, ...], H: int, K: int, V: int, spiky: bool) -> dict:
  """Raw q, k, v, g_raw, beta_raw (``kda_inputs``); ``spiky``: a few tokens with g_raw = 1e5."""
  x = kda_inputs(rng, lead, H, K, V)
  flat = x["g_raw"].reshape((-1, H, K))
  if spiky and flat.shape[0]:
    flat[rng.choice(flat.shape[0], size=min(3, flat.shape[0]), replace=False)] = 1e5
  return x


GATES = st.sampled_from([None, -5.0, -1.0])
GATE_KINDS = st.sampled_from(["init", "init", "A_log=16", "A_log=20"])
STATE_DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])
# Value blocks per program of the prefill's state pass: the heuristic, or either value where V allows it.
V_BLOCKS = st.sampled_from([None, 1, 2] if HEAD_DIM % 128 == 0 else [None, 1])
# Runs of chunks per sequence carried in parallel by the state pass: one pass, or two passes and a combine.
SEGMENTS = st.sampled_from([None, 1, 2, 3])


@st.composite
def prefill_batches(draw):
  """A varlen batch: lengths, slots (distinct, some -1), initial-state flags and checkpoints (in any order within
  a sequence)."""
  lens = draw(st.lists(st.sampled_from(LENGTHS), min_size=1, max_size=3))
  N = len(lens)
  has = draw(st.lists(st.booleans(), min_size=N, max_size=N))
  no_slot = draw(st.lists(st.booleans(), min_size=N, max_size=N).map(lambda b: [x and not h for x, h in
                                                                               zip(b, has)]))
  ckpts = [(n, off) for n, L in enumerate(lens) for off in range(C, L + 1, C) if draw(st.booleans())]
  # Each sequence's checkpoints in any order (a stable sort by sequence of a permutation keeps them grouped).
  ckpts = sorted(draw(st.permutations(ckpts)), key=lambda c: c[0])
  ck_minus_one = draw(st.lists(st.booleans(), min_size=len(ckpts), max_size=len(ckpts)))
  return lens, has, no_slot, ckpts, ck_minus_one


@budget(cpu=4, gpu=8)
@given(batch=prefill_batches(), seed=SEEDS, lower_bound=GATES, gate_kind=GATE_KINDS, spiky=st.booleans(),
       state_dtype=STATE_DTYPES, v_blocks=V_BLOCKS, segments=SEGMENTS)
# Found by this test: g = -1e13 per token (A_log = 20, g_raw = 1e5) once made the kernel's chunk cumulative
# sums lose every digit of later tokens' gates (NaN and 77% error), until the per-token gate got a floor.
@example(batch=([2, 16, 63], [False, True, False], [True, False, False], [], []), seed=15806, lower_bound=None,
         gate_kind="A_log=20", spiky=True, state_dtype=jnp.bfloat16, v_blocks=None, segments=None)
def test_kda_prefill(kernel_impl, batch, seed, lower_bound, gate_kind, spiky, state_dtype, v_blocks, segments):
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
  inputs, pool_j, arrays_j = prefill_to_jax(x, pool, arrays, state_dtype)
  config = dict(lower_bound=lower_bound, state_dtype=state_dtype)
  o, new_pool = run_prefill(inputs, pool_j, arrays_j, kernel_impl,
                            tuning=KdaTuning(prefill_v_blocks=v_blocks, prefill_segments=segments), **config)
  xo, xpool = run_prefill(inputs, pool_j, arrays_j, "xla", **config)
  T = sum(lens)
  xo64, xpool64 = np.asarray(xo, np.float64), np.asarray(xpool, np.float64)
  tol = PREFILL_TOL[jnp.dtype(state_dtype)]
  # The reference itself: finite, its unnamed slots bitwise unchanged; then the kernel against it.
  check_prefill(xo, xpool, xo64, xpool64, pool_j, arrays, tol, T, H, K)
  check_prefill(o, new_pool, xo64, xpool64, pool_j, arrays, tol, T, H, K)


@budget(cpu=4, gpu=8)
@given(batch=decode_batches(), seed=SEEDS, lower_bound=GATES, gate_kind=GATE_KINDS, spiky=st.booleans(),
       state_dtype=STATE_DTYPES)
def test_kda_decode(kernel_impl, batch, seed, lower_bound, gate_kind, spiky, state_dtype):
  N, S, accepted, padding, skipped = batch
  rng = np.random.default_rng(seed)
  H, K = HEADS, HEAD_DIM
  cols = 1 if S is None else 1 + S
  P, slots = decode_slots(rng, N, cols, accepted, padding, skipped)
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
    check_decode(as_rows(got), got_pool, as_rows(xo), np.asarray(xpool, np.float32), pool, vdim=K,
                 dtype=jnp.float32, state_dtype=state_dtype, untouched=untouched)
  np.testing.assert_array_equal(as_rows(o)[np.asarray(padding) & (read < 0)], 0.0)

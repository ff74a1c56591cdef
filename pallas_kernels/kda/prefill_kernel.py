"""KDA chunked prefill as two Pallas Mosaic GPU kernels (Hopper, sm_90a).

Stage 1 (``prefill_prep``, chunk-parallel, grid = chunk slots × heads) turns the raw inputs of each
64-token chunk into bf16 per-chunk operands in chunk-padded workspaces; stage 2 (``prefill_state``, grid =
V-blocks × sequences × heads) runs the inter-chunk recurrence, writes ``o`` and reads/writes the state
pool slots in place (the pool enters as a ``jax.new_ref``; donate it in the enclosing ``jax.jit`` to avoid
a copy). Around the kernels there is only one index table (``index_table``: one XLA kernel) and a padded f32
copy of ``beta_raw``; no state is gathered or scattered outside the kernels (also with
``KdaTuning.prefill_segments`` > 1, ``_segmented_state_pass``: README.md, "Segments").

The chunk slot table has a static size ``cdiv(T, 64) + N`` (every sequence adds at most one partial chunk);
sequence n's chunks start at slot ``cu[n] // 64 + n`` (``index_table``); the slots between and past them have
length 0 and are skipped.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import util
from pallas_kernels.kda import prefill_combine, prefill_prep, prefill_state
from pallas_kernels.kda.config import CHUNK_SIZE as C, KdaConfig
from pallas_kernels.mosaic_interpret import interpret_mode


def _search(sorted_arr: jax.Array, queries: jax.Array, side: str) -> jax.Array:
  """``searchsorted`` as one comparison of every query with every entry: a single fused kernel, where the
  default binary search is a loop of small kernels whose launches cost more than these tables' work."""
  return jnp.searchsorted(sorted_arr, queries, side=side, method="compare_all").astype(jnp.int32)


def index_table(cu_seqlens: jax.Array, state_indices: jax.Array, has_initial_state: jax.Array,
                checkpoint_indptr: jax.Array, num_slots: int) -> jax.Array:
  """The call's one index table, ``[SEQ_META_ROWS + 2, num_slots]`` int32 (``num_slots = cdiv(T, C) + N``): in its
  first N columns ``prefill_state.state_pass``'s per-sequence rows of one pass (each sequence one run from its
  chunk 0; the columns past N repeat the last sequence's and are not read), then each chunk slot's first token and
  valid rows (``prefill_prep.prep``'s last two rows; slots that hold no chunk have none).

  Sequence n's chunks take the slots from ``cu[n] // C + n`` on: with ``cu[n] = qC + r`` its ``ceil(L / C)`` chunks
  end at or before ``(r + L) // C + 1`` slots further, the next sequence's first slot, and the last sequence's at
  ``T // C + N`` at most, inside the table. So every entry is an elementwise function of the arguments (no prefix
  sum), and computed from them directly (a gather from a computed array would be a kernel of its own): XLA builds
  the table in one kernel."""
  N = state_indices.shape[0]
  first_slot = lambda i: cu_seqlens[i] // C + i  # sequence i's first chunk slot
  length = lambda i: cu_seqlens[i + 1] - cu_seqlens[i]
  n = jnp.minimum(jnp.arange(num_slots, dtype=jnp.int32), N - 1)
  # Each slot's sequence: the last one starting at or before it, by a comparison with every sequence's first slot
  # (written (cu + i C) // C for the comparison: as first_slot there, XLA computes it in a kernel of its own).
  slots = jnp.arange(num_slots, dtype=jnp.int32)
  seq = jnp.maximum(_search((cu_seqlens[:-1] + jnp.arange(N, dtype=cu_seqlens.dtype) * C) // C, slots, "right") - 1,
                    0)
  local = slots - first_slot(seq)
  in_range = local < (length(seq) + C - 1) // C
  i32 = lambda x: x.astype(jnp.int32)
  return jnp.stack([i32(first_slot(n)), i32((length(n) + C - 1) // C), i32(cu_seqlens[n]), i32(length(n)),
                    i32(state_indices[n]), i32(has_initial_state[n]), i32(checkpoint_indptr[n]),
                    i32(checkpoint_indptr[n + 1]), jnp.zeros_like(n),
                    i32(jnp.where(in_range, cu_seqlens[seq] + local * C, 0)),
                    i32(jnp.where(in_range, jnp.clip(length(seq) - local * C, 0, C), 0))])


def _check_supported(K: int, V: int, v_blocks: int) -> None:
  if K not in (64, 128):
    raise NotImplementedError(f"kda_prefill kernel: K must be 64 or 128, got {K}")
  if V % (prefill_state.BV * v_blocks):
    raise NotImplementedError(f"kda_prefill kernel: V must be a multiple of {prefill_state.BV * v_blocks} "
                              f"(prefill_v_blocks={v_blocks}), got {V}")


@functools.partial(jax.jit, static_argnames=("config", "interpret", "v_blocks", "segments"))
def _prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, cu_seqlens, state_pool, state_indices,
             has_initial_state, checkpoint_indptr, checkpoint_offsets, checkpoint_slots, *, config: KdaConfig,
             interpret: bool, v_blocks: int, segments: int = 1):
  T, H, K = q.shape
  N = state_indices.shape[0]
  scale = K ** -0.5 if config.scale is None else config.scale
  # The kernels read 16-bit q/k/v (their matmul operands are bf16 anyway); 4-byte inputs are narrowed here
  # so stage 1's SMEM fits.
  if q.dtype.itemsize > 2:
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  table = index_table(cu_seqlens, state_indices, has_initial_state, checkpoint_indptr, util.cdiv(T, C) + N)
  beta_p = jnp.pad(beta_raw.astype(jnp.float32), ((0, C), (0, 0)))  # one fusion (a transpose is kernels of its own)
  with interpret_mode(interpret):
    work = prefill_prep.prep(q, k, v, g_raw, beta_p, A_log, dt_bias, table, scale=scale,
                             lower_bound=config.lower_bound, smem_operands=interpret)
    # The state pass reads the caller's checkpoint lists as they are: no table per chunk, no sort.
    ck = prefill_state.checkpoint_lists(checkpoint_offsets, checkpoint_slots)
    if segments > 1:
      return _segmented_state_pass(work, table, N, state_pool, ck, T=T, G=segments, out_dtype=q.dtype,
                                   v_blocks=v_blocks, interpret=interpret)
    pool_ref = jax.new_ref(state_pool)
    o = prefill_state.state_pass(*work, pool_ref, table, ck, T=T, out_dtype=q.dtype, v_blocks=v_blocks,
                                 interpret=interpret, num_seqs=N)
  return o, pool_ref[...]


def _segmented_state_pass(work, table, N: int, state_pool, ck, *, T: int, G: int, out_dtype, v_blocks: int,
                          interpret: bool) -> tuple[jax.Array, jax.Array]:
  """The state pass with every sequence cut into ``G`` runs of whole chunks ("segments") that run in parallel.

  In the kernel's V-first frame a chunk maps the state ``Sᵀ`` to ``Sᵀ (diag(γ) + Wnᵀ Kg) + Uᵀ Kg``, so a
  segment maps its first state to ``Sᵀ M + B``. The first pass (``prefill_state.transition_pass``) gives every
  segment's B and M; the combine (``prefill_combine.combine``) runs each sequence's segments in order from the
  sequence's initial state; the second pass runs the segments again from those states, writes ``o`` and, like
  one pass, the checkpoints and (from each sequence's last segment) the final states into their pool slots in
  place. Segment j of a sequence of ``nch`` chunks takes chunks ``[j nch // G, (j + 1) nch // G)``: the last one
  holds a chunk whenever the sequence does, so its final-state rule is the one-pass rule (a length-0 sequence
  writes the zero state without an initial state and leaves its slot untouched with one; -1 slots are written
  nowhere). An empty segment has M = I and B = 0. A segment reads its sequence's checkpoints and writes those
  after its own chunks. Args as ``prefill_state.state_pass`` (``table``: the call's ``index_table``, of N
  sequences).
  """
  qg, kg, neg_w, u, aqk, decay = work
  chunk_start, nch, t0, lens, slots, has_init, ck_lo, ck_hi, _ = table[:prefill_state.SEQ_META_ROWS, :N]
  _, H, _, K = qg.shape
  V = u.shape[-1]
  NS = N * G
  bounds = jnp.arange(G + 1, dtype=jnp.int32)[None, :] * nch[:, None] // G
  first, count = bounds[:, :-1], bounds[:, 1:] - bounds[:, :-1]
  last = jnp.arange(G, dtype=jnp.int32)[None, :] == G - 1
  runs = tuple(x.reshape(NS) for x in (chunk_start[:, None] + first, count, t0[:, None] + first * C,
                                        jnp.clip(lens[:, None] - first * C, 0, count * C)))
  # Second pass: every segment starts from its row of ``starts`` (a length-0 sequence's last segment only with an
  # initial state, as one pass decides); the last segment writes into the sequence's slot. The transition pass
  # reads the same table (not its slot, initial-state and checkpoint rows): one table, one XLA kernel.
  run_slots = jnp.where(last, slots[:, None], -1).reshape(NS)
  run_init = jnp.where(~last | (nch[:, None] > 0), 1, has_init[:, None]).reshape(NS)
  per_run = lambda x: jnp.broadcast_to(x[:, None], (N, G)).reshape(NS)
  run_meta = jnp.stack([*runs, run_slots, run_init, per_run(ck_lo), per_run(ck_hi), first.reshape(NS)])
  # The transition pass's value blocks follow the one-pass rule over its own V + K rows (``v_blocks``, the user's
  # or that rule over V, sizes the second pass).
  bm = prefill_state.transition_pass(qg, kg, neg_w, u, decay, run_meta,
                                     v_blocks=prefill_state.choose_v_blocks(NS, H, V + K), interpret=interpret)
  starts = prefill_combine.combine(bm, state_pool, table, G=G, interpret=interpret)
  pool_ref = jax.new_ref(state_pool)
  o = prefill_state.state_pass(qg, kg, neg_w, u, aqk, decay, pool_ref, run_meta, ck, T=T, out_dtype=out_dtype,
                               v_blocks=v_blocks, interpret=interpret, starts=starts)
  return o, pool_ref[...]


def kda_prefill_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array,
                       A_log: jax.Array, dt_bias: jax.Array, cu_seqlens: jax.Array, state_pool: jax.Array,
                       state_indices: jax.Array, has_initial_state: jax.Array, checkpoint_indptr: jax.Array,
                       checkpoint_offsets: jax.Array, checkpoint_slots: jax.Array, *, config: KdaConfig,
                       interpret: bool, v_blocks: int, segments: int = 1) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``kda_prefill``: inputs already validated by the public API (same shapes and meaning).

  Args:
    q, k: ``[T, H, K]`` raw. v: ``[T, H, V]``. g_raw: ``[T, H, K]``. beta_raw: ``[T, H]``.
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32. cu_seqlens: ``[N+1]`` int32.
    state_pool: ``[P, H, V, K]`` (V-first) in ``config.state_dtype``.
    state_indices: ``[N]`` int32 (-1: start from zero, write nothing). has_initial_state: ``[N]`` bool.
    checkpoint_indptr: ``[N+1]`` int32; checkpoint_offsets, checkpoint_slots: ``[M]`` int32.
    config: ``KdaConfig``. interpret: run the same kernels in Mosaic GPU interpret mode (CPU).
    v_blocks: V-blocks per program of the state pass (``KdaTuning.prefill_v_blocks``).
    segments: runs of whole chunks per sequence carried in parallel (``KdaTuning.prefill_segments``).

  Returns:
    ``o [T, H, V]`` in q's dtype and the new pool. Requires K in {64, 128} and V a multiple of 64 (128 with
    two V-blocks per program).
    Destination slots (final states and checkpoints) must not be another sequence's initial-state slot
    (the kernels update the pool in place while other sequences read it).
  """
  _check_supported(q.shape[-1], v.shape[-1], v_blocks)
  T = q.shape[0]
  if T < C:
    # TMA boxes are one chunk tall: give the token arrays at least one chunk of (unused) rows. T = 0 runs
    # too: its length-0 sequences still write zero states into the slots of those without an initial state.
    q, k, v, g_raw, beta_raw = (util.pad_rows(x, C) for x in (q, k, v, g_raw, beta_raw))
  o, pool = _prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, cu_seqlens, state_pool, state_indices,
                     has_initial_state, checkpoint_indptr, checkpoint_offsets, checkpoint_slots, config=config,
                     interpret=interpret, v_blocks=v_blocks, segments=segments)
  return o[:T], pool

"""KDA prefill, stage 2 (sequential over the chunks of a sequence): state passing, output, pool I/O.

One program per (``v_blocks`` V-blocks of 64, head, sequence; one or two), one warpgroup per V-block: each
carries its V-block of the f32 state through the sequence's chunks from the stage-1 workspaces, writes ``o`` and
reads / writes the pool slots (initial state, checkpoints, final state) by TMA; the chunk inputs that do not
depend on V are loaded once per program. See README.md, "Prefill stage 2".
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import util
from pallas_kernels.kda._mosaic import COLV, WG, bcast_cols, bf16, f32, tiled
from pallas_kernels.kda.config import CHUNK_SIZE as C

BV = 64  # V-block of one warpgroup
NBUF = 2  # prefetch depth (stages of the chunk-input ring)
SEQ_META_ROWS = 9  # rows of ``state_pass``'s per-sequence table
SLOT_ROW, INIT_ROW = 4, 5  # its pool-slot and has-initial-state rows
NO_CHECKPOINT = 2 ** 31 - 1  # "no further checkpoint": past every chunk count


def _state_body(*refs, K: int, wgs: int, interpret: bool, real_rows: int | None, starts: bool):
  (meta_ref, ck_off_ref, ck_slot_ref), refs = refs[:3], refs[3:]
  with_o = real_rows is None  # else the transition pass: no o, rows past real_rows start as the identity
  start_ref = None
  if with_o:
    (qg_ref, kg_ref, neg_w_ref, u_ref, aqk_ref, decay_ref, pool_ref), refs = refs[:7], refs[7:]
    if starts:
      start_ref, refs = refs[0], refs[1:]
    o_ref, (neg_w_b, kg_b, qg_b, u_b, aqk_b, decay_b, o_s), refs = refs[0], refs[1:8], refs[8:]
  else:  # the pool is the output; no qg, aqk or o
    (kg_ref, neg_w_ref, u_ref, decay_ref, pool_ref), (neg_w_b, kg_b, u_b, decay_b), refs = (
        refs[:5], refs[5:9], refs[9:])
    qg_ref = aqk_ref = qg_b = aqk_b = o_s = None
  wg_bufs, (bars, consumed, pool_bar) = refs[:wgs], refs[wgs:]
  vg = lax.axis_index("v")
  h = lax.axis_index("h")
  n = lax.axis_index("n")
  cs, nch, t0, seq_len, slot, init, ck_lo, ck_hi, run_chunk = (meta_ref[r, n] for r in range(SEQ_META_ROWS))
  if not with_o:  # the transition pass reads the second pass's table: it starts from zero, into its own row
    slot, init = n, 0
  # With starts, a sequence's initial state is its own row there, whatever its slot (where it only writes).
  has_init = (init != 0) if starts else (slot >= 0) & (init != 0)

  def issue(i, st):
    """Warpgroup 0 loads chunk i's inputs into stage st: the V-independent ones once, U per warpgroup."""
    gc = cs + i
    bar = bars.at[st]
    plgpu.copy_gmem_to_smem(neg_w_ref.at[gc, h], neg_w_b.at[st], bar)
    plgpu.copy_gmem_to_smem(kg_ref.at[gc, h], kg_b.at[st], bar)
    if with_o:
      plgpu.copy_gmem_to_smem(qg_ref.at[gc, h], qg_b.at[st], bar)
      plgpu.copy_gmem_to_smem(aqk_ref.at[gc, h], aqk_b.at[st], bar)
    plgpu.copy_gmem_to_smem(decay_ref.at[gc, h], decay_b.at[st], bar)
    for w in range(wgs):
      col = (vg * wgs + w) * BV
      if not with_o:  # an identity row block loads some U block it ignores (the stage's arrivals are fixed)
        col = lax.rem(col, u_ref.shape[-1])
      plgpu.copy_gmem_to_smem(u_ref.at[gc, h, :, pl.ds(col, BV)], u_b.at[st, w], bar)

  def warpgroup(w: int):
    """One V-block's recurrence. Its state stash, E stash and pool staging share one SMEM union: the staging
    is used before the first chunk, after a checkpoint chunk's matmuls and after the last chunk."""
    v0 = pl.multiple_of((vg * wgs + w) * BV, BV)
    (st_s, e_s), stg, *start_stg = wg_bufs[w]
    init_stg = start_stg[0] if starts else stg
    phases = util.Phases()  # named regions for the on-device profiler (util.compiler_params)
    phases.start("init")
    if w == 0:
      for j in range(NBUF):
        pl.when(nch > j)(functools.partial(issue, j, j))

    if with_o:
      # The sequence's checkpoints, in the caller's order: whether they are sorted by offset, the position of the
      # first past this run's start (where sorted) and the least chunk count past it. One pass over the list per
      # program; afterwards a chunk costs one comparison with that count.
      def survey(m, c):
        ordered, before, nxt, prev = c
        count = ck_off_ref[m] // C
        return (jnp.where(count >= prev, ordered, 0), before + (count <= run_chunk).astype(jnp.int32),
                jnp.where((count > run_chunk) & (count < nxt), count, nxt), count)

      ordered, before, nxt, _ = lax.fori_loop(ck_lo, ck_hi, survey,
                                              (jnp.int32(1), jnp.int32(0), jnp.int32(NO_CHECKPOINT), jnp.int32(0)))
      ck0 = (ck_lo + before, nxt)
    else:
      ck0 = ()

    @pl.when(has_init)
    def _():
      src = start_ref.at[n, h, pl.ds(v0, BV)] if starts else pool_ref.at[slot, h, pl.ds(v0, BV)]
      plgpu.copy_gmem_to_smem(src, init_stg, pool_bar.at[w])
      plgpu.barrier_wait(pool_bar.at[w])

    # Uninitialised SMEM may hold NaN: select, never multiply by 0.
    init_rows = plgpu.broadcasted_iota(jnp.int32, (BV, K), 0, layout=WG) < jnp.where(has_init, BV, 0)
    s0 = jnp.where(init_rows, plgpu.load(init_stg, layout=WG, optimized=False).astype(f32), 0.0)
    if not with_o:
      rows = plgpu.broadcasted_iota(jnp.int32, (BV, K), 0, layout=WG) + (v0 - real_rows)
      s0 = jnp.where(rows == plgpu.broadcasted_iota(jnp.int32, (BV, K), 1, layout=WG), 1.0, s0)
    plgpu.commit_smem()  # every warp has read the staging before the state stash (same memory) is written

    def write_state(s, dst):
      """``s`` into pool slot ``dst``; returns once the store has read the staging (the stashes' memory)."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      stg[...] = s.astype(stg.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(stg, pool_ref.at[dst, h, pl.ds(v0, BV)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def checkpoints(s, done, ck):
      """Writes ``s`` (the state after ``done`` chunks of the sequence) into the slots of the checkpoints at
      ``done`` chunks, if ``ck`` (the list position and the next checkpoint's chunk count) says there are any;
      returns ``ck`` for the next chunk. A sorted list is walked from the position; an unsorted one scanned whole,
      its next checkpoint the least count past ``done``."""
      def write(ck):
        pos, _ = ck
        first = jnp.where(ordered != 0, pos, ck_lo)

        def more(c):
          m, _ = c
          # Sorted: only while the position's count is done (clamped: a read at ck_hi would be out of range).
          return (m < ck_hi) & ((ordered == 0) | (ck_off_ref[jnp.minimum(m, ck_hi - 1)] // C == done))

        def one(c):
          m, nxt = c
          count, dst = ck_off_ref[m] // C, ck_slot_ref[m]
          pl.when((count == done) & (dst >= 0))(lambda: write_state(s, dst))
          return m + 1, jnp.where((count > done) & (count < nxt), count, nxt)

        m, nxt = lax.while_loop(more, one, (first, jnp.int32(NO_CHECKPOINT)))
        # Sorted: the walk stopped at the next checkpoint (or the list's end).
        after = jnp.where(m < ck_hi, ck_off_ref[jnp.minimum(m, ck_hi - 1)] // C, NO_CHECKPOINT)
        return jnp.where(ordered != 0, m, pos), jnp.where(ordered != 0, after, nxt)

      return lax.cond(ck[1] == done, write, lambda ck: ck, ck)

    def step(i, carry):
      s, *ck = carry
      st = lax.rem(i, NBUF)
      phases.start("inputs")
      plgpu.barrier_wait(bars.at[st])
      st_s[...] = s.astype(bf16)
      plgpu.commit_smem()

      def first(acc_e, *acc_o):
        plgpu.wgmma(acc_e, neg_w_b.at[st], st_s.T)
        for acc in acc_o:
          plgpu.wgmma(acc, qg_b.at[st], st_s.T)
        return tuple(acc[...] for acc in (acc_e, *acc_o))

      phases.start("e_o")
      e, *o = pl.run_scoped(first, *(plgpu.ACC((C, BV), f32) for _ in range(1 + with_o)))
      u = plgpu.load(u_b.at[st, w], layout=WG, optimized=False).astype(f32)
      if not with_o:  # identity rows: U = 0 (a select: the U block they loaded may hold anything)
        u = jnp.where(plgpu.broadcasted_iota(jnp.int32, (C, BV), 0, layout=WG) < real_rows - v0, u, 0.0)
      e = e + u
      chunk_decay = plgpu.load(decay_b.at[st], layout=COLV, optimized=False)
      e_s[...] = e.astype(bf16)
      plgpu.commit_smem()

      def second(acc_s, *acc_o):
        plgpu.wgmma(acc_s, e_s.T, kg_b.at[st])
        for acc in acc_o:
          plgpu.wgmma(acc, aqk_b.at[st], e_s)

      phases.start("state_o")
      # The new state and o accumulate onto the decayed state and the first o in place: a separate [BV, K]
      # product beside s would take 64 more registers a thread at the kernel's peak.
      s, *o = util.accumulate(second, s * bcast_cols(chunk_decay, (BV, K)), *o, from_inits=not interpret)

      # Every read of stage st by this warpgroup (wgmma and register loads) is complete; warpgroup 0 refills
      # it once all have said so (an arrival only when a refill follows: every phase is awaited).
      @pl.when(i + NBUF < nch)
      def _():
        plgpu.barrier_arrive(consumed.at[st])
        if w == 0:
          plgpu.barrier_wait(consumed.at[st])
          issue(i + NBUF, st)

      if with_o:
        phases.start("o_store")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_w = o_s.at[w]
        o_w[...] = o[0].astype(o_s.dtype)
        plgpu.commit_smem()
        rows = jnp.minimum(seq_len - i * C, C)
        start = 0
        size = C
        while size:
          @pl.when((rows & size) != 0)
          def _(start=start, size=size):
            plgpu.copy_smem_to_gmem(o_w.at[pl.ds(start, size)],
                                    o_ref.at[pl.ds(t0 + i * C + start, size), h, pl.ds(v0, BV)])
          start = start + (rows & size)
          size //= 2

        phases.start("checkpoints")
        ck = checkpoints(s, run_chunk + i + 1, tuple(ck))
      phases.end()
      return s, *ck

    phases.end()
    s, *_ = lax.fori_loop(0, nch, step, (s0, *ck0))
    phases.start("final")
    # A sequence without chunks ends in its initial state: a slot read as its own initial state is left as it
    # is (bitwise), any other gets the zero state. Writing it here, from the program that owns the sequence,
    # costs one predicate on the hot path and no extra pass over the pool.
    pl.when((slot >= 0) & ((nch > 0) | jnp.logical_not(has_init)))(lambda: write_state(s, slot))
    util.finish_stores()
    phases.end()

  wg = lax.axis_index("wg")
  for w in range(wgs):
    pl.when(wg == w)(functools.partial(warpgroup, w))


def choose_v_blocks(num_seqs: int, num_heads: int, vdim: int) -> int:
  """The default ``v_blocks``: 2 where one-block programs (``V / BV`` per head and sequence) are more than one
  wave of SMs, 1 otherwise. A two-block program takes less than twice one block's time (the shared inputs
  load once), so halving the programs wins once they no longer all fit one wave, and loses while halving
  them idles SMs (few heads, or long single sequences at few heads)."""
  blocks = vdim // BV
  return 2 if blocks % 2 == 0 and blocks * num_heads * num_seqs > util.NUM_SMS else 1


# The segments heuristic's smallest number of runs (two runs do twice the one pass's state work on twice its
# programs: no gain) and the fewest chunks a run keeps on average (shorter runs leave the first and second passes
# to their fixed costs).
MIN_SEGMENTS = 3
MIN_CHUNKS_PER_SEGMENT = 8


def choose_segments(num_seqs: int, num_heads: int, vdim: int, num_tokens: int) -> int:
  """The default ``segments``: as many runs per sequence as fill the SMs once with one-block programs
  (``NUM_SMS // (V / BV · H · N)``), where that is at least ``MIN_SEGMENTS`` and the runs keep at least
  ``MIN_CHUNKS_PER_SEGMENT`` chunks on average (``T / (64 N)`` chunks a sequence); otherwise 1 (one pass)."""
  programs = vdim // BV * num_heads * num_seqs
  if programs == 0:
    return 1
  segments = min(util.NUM_SMS // programs, num_tokens // (C * num_seqs * MIN_CHUNKS_PER_SEGMENT))
  return segments if segments >= MIN_SEGMENTS else 1


def checkpoint_lists(offsets: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``state_pass``'s ``ck_meta``: the caller's checkpoint offsets and slots as int32. Without checkpoints (a
  static ``M = 0``) two one-entry constants that no program reads (its range is empty), as a kernel needs an
  array of at least one element; XLA embeds constants in the executable."""
  if offsets.shape[0] == 0:
    return jnp.asarray(np.zeros(1, np.int32)), jnp.asarray(np.full(1, -1, np.int32))
  return offsets.astype(jnp.int32), slots.astype(jnp.int32)


def state_pass(qg: jax.Array, kg: jax.Array, neg_w: jax.Array, u: jax.Array, aqk: jax.Array,
               chunk_decay: jax.Array, pool_ref, seq_meta: jax.Array, ck_meta: tuple[jax.Array, ...],
               *, T: int, out_dtype, v_blocks: int, interpret: bool = False,
               starts: jax.Array | None = None, num_seqs: int | None = None) -> jax.Array:
  """Stage 2. Writes final states / checkpoints into ``pool_ref`` (a ``jax.new_ref`` of the pool) in place.

  Args:
    qg, kg, neg_w, u, aqk, chunk_decay: stage-1 workspaces (``prefill_prep.prep``), chunk slots first.
    pool_ref: ref of the ``[P, H, V, K]`` pool (f32 or bf16).
    seq_meta: ``[SEQ_META_ROWS, N]`` int32, one row each: first chunk slot, number of chunks, first token,
      length, pool slot, has-initial-state (0/1), the range ``[lo, hi)`` of the sequence's checkpoints in
      ``ck_meta``, and how many of its sequence's chunks come before its first (0 for a whole sequence; a segment's
      first chunk within its sequence).
      One array, so that XLA builds it in one kernel.
    ck_meta: ``checkpoint_lists``: the checkpoints' token offsets from their sequence's start and their
      destination slots (``[M']`` int32 each, -1 = skip), in any order within a sequence's range. Sorted by offset,
      a program walks them (one comparison a chunk); unsorted, it scans its sequence's whole range at each chunk
      that ends on one.
    T: total tokens. out_dtype: dtype of ``o``. v_blocks: V-blocks of ``BV`` per program (a warpgroup each,
      sharing the V-independent chunk inputs), 1 or 2 (``KdaTuning.prefill_v_blocks``); divides ``V / BV``.
    interpret: the variant for interpret mode, whose accumulators cannot start from registers
      (``util.accumulate``).
    starts: ``[N, H, V, K]`` f32 or None: the sequences' initial states at their own index (read where
      has-initial-state is 1, whatever the slot), instead of from their pool slots (the segmented pass's second
      pass, whose runs write into slots they do not start from).
    num_seqs: the sequences, the first columns of ``seq_meta`` (None: all of them; a table with more columns and
      rows is the call's one index table, ``prefill_kernel.index_table``).

  Returns:
    ``o [T, H, V]`` in ``out_dtype``.
  """
  _, H, _, K = qg.shape
  V = u.shape[-1]
  inputs = (qg, kg, neg_w, u, aqk, chunk_decay, pool_ref) + (() if starts is None else (starts,))
  return _call(inputs, seq_meta, ck_meta, H=H, K=K, rows=V, N=seq_meta.shape[1] if num_seqs is None else num_seqs,
               v_blocks=v_blocks, out_type=jax.ShapeDtypeStruct((T, H, V), out_dtype), pool_dtype=pool_ref.dtype,
               interpret=interpret, real_rows=None, starts=starts is not None)


def transition_pass(qg: jax.Array, kg: jax.Array, neg_w: jax.Array, u: jax.Array, chunk_decay: jax.Array,
                    seq_meta: jax.Array, *, v_blocks: int, interpret: bool = False) -> jax.Array:
  """The segmented pass's first pass (``prefill_kernel._segmented_state_pass``): the state pass over runs of
  chunks from a zero state, without ``o``, over ``V + K`` rows: the first ``V`` carried with U as usual and the
  last ``K`` starting as the identity with U = 0, which end as the run's transition matrix.

  Args: as ``state_pass``; ``seq_meta``'s slot, has-initial-state and checkpoint rows are not read (every run
  starts from zero and ends in its own row of the output, and writes no checkpoint).

  Returns:
    ``[N, H, V + K, K]`` f32: every run's final rows (all written).
  """
  _, H, _, K = qg.shape
  V = u.shape[-1]
  N = seq_meta.shape[1]
  if V % BV:
    raise ValueError(f"transition_pass needs V a multiple of {BV}, got {V}")
  no_checkpoints = checkpoint_lists(*(jnp.zeros(0, jnp.int32),) * 2)
  return _call((kg, neg_w, u, chunk_decay), seq_meta, no_checkpoints, H=H, K=K, rows=V + K, N=N, v_blocks=v_blocks,
               out_type=jax.ShapeDtypeStruct((N, H, V + K, K), f32), pool_dtype=f32, interpret=interpret,
               real_rows=V, starts=False)


def _call(inputs, seq_meta, ck_meta, *, H: int, K: int, rows: int, N: int, v_blocks: int, out_type, pool_dtype,
          interpret: bool, real_rows: int | None, starts: bool):
  """One ``plgpu.kernel`` of ``_state_body`` over ``inputs`` (``_state_body``'s order for the mode: the pool ref,
  updated in place, then the starts if any, with ``o`` the output; or, for the transition pass, no pool and the
  output its pool)."""
  if seq_meta.shape[0] < SEQ_META_ROWS or seq_meta.shape[1] < N:
    raise ValueError(f"seq_meta must have at least {SEQ_META_ROWS} rows and {N} columns, got shape {seq_meta.shape}")
  wgs = v_blocks
  if wgs not in (1, 2) or (rows // BV) % wgs:
    raise ValueError(f"v_blocks must be 1 or 2 and divide {rows} / {BV} rows, got {v_blocks}")
  transition = real_rows is not None
  # Per warpgroup one union: the bf16 state and E stashes of a chunk, or the pool-dtype staging of a state (or
  # the f32 staging of a start).
  wg_buf = lambda: plgpu.RefUnion((tiled((BV, K)), tiled((C, BV))), plgpu.SMEM((BV, K), pool_dtype),
                                  *([plgpu.SMEM((BV, K), f32)] if starts else []))
  ring = [tiled((NBUF, C, K)), tiled((NBUF, C, K)), tiled((NBUF, C, K)), plgpu.SMEM((NBUF, wgs, C, BV), bf16),
          tiled((NBUF, C, C)), plgpu.SMEM((NBUF, K), f32), plgpu.SMEM((wgs, C, BV), out_type.dtype)]
  if transition:
    ring = [ring[0], ring[1], ring[3], ring[5]]  # neg_w, kg, U, decay
  scratch = [
      *ring, *(wg_buf() for _ in range(wgs)),
      plgpu.Barrier(num_arrivals=(3 if transition else 5) + wgs, num_barriers=NBUF),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=NBUF),
      plgpu.Barrier(num_arrivals=1, num_barriers=wgs),
  ]
  # No warpgroup barrier around every SMEM store (Pallas's default, two per store, three stores per chunk):
  # each stash is stored after a commit_smem or a TMA store wait (both end in a warpgroup barrier) that follows
  # every warp's last read of it, and read only after the commit_smem that follows the store.
  return plgpu.kernel(
      functools.partial(_state_body, K=K, wgs=wgs, interpret=interpret, real_rows=real_rows, starts=starts),
      out_type=out_type,
      # Heads fastest: the first programs are the first sequence's heads, which begin with the chunks the prep
      # wrote last (see prefill_prep), still in the L2.
      grid=(rows // (BV * wgs), N, H), grid_names=("v", "n", "h"), num_threads=wgs, thread_name="wg",
      kernel_name="kda_prefill_transition" if transition else "kda_prefill_state",
      scratch_types=scratch, compiler_params=util.compiler_params(unsafe_no_auto_barriers=True),
  )(seq_meta, *ck_meta, *inputs)

"""Split-K absorbed MLA decode as a Pallas Mosaic GPU kernel (Hopper).

One program per (split, sequence, 64-row head tile), head tiles fastest; a memory warpgroup streams the sequence's pages by TMA
into a two-slot ring that two compute warpgroups share (QK and the softmax on one, ``P @ V`` split by output
columns over both). See README.md for the derivation, the NaN rules and the SMEM budget.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_interpret, util
from pallas_kernels.mla.config import HEAD_TILE, LATENT_DIM, PAGE_SIZE, ROPE_DIM
from pallas_kernels.mla.reference import pages_per_split

DIM = LATENT_DIM + ROPE_DIM
COLS = LATENT_DIM // 2  # output columns per compute warpgroup
STAGES = 2  # KV ring slots: a third [64, 576] tile would exceed the 227 KiB of SMEM
COMPUTE_WGS = 2
LOG2E = util.LOG2E
LN2 = math.log(2.0)
INIT_MAX = -1e30  # finite: exp2(INIT_MAX - m) is 0 and never (-inf) - (-inf)


def _body(q_ref, kv_ref, table_ref, lens_ref, o_ref, lse_ref, q_smem, ring, p_smem, row_smem, lse_smem,
          q_bar, kv_bar, consumed_bar, p_ready_bar, p_free_bar, *, pps: int, out_rows: int, scale: float,
          smem_operands: bool):
  hb, split, b = lax.axis_index("hb"), lax.axis_index("split"), lax.axis_index("b")
  wg = lax.axis_index("wg")
  kv_smem, o_stage = ring
  seq_len = lens_ref[b]
  first_page = split * pps
  num_pages = jnp.clip(pl.cdiv(seq_len, PAGE_SIZE) - first_page, 0, pps)
  row0 = pl.multiple_of(hb * HEAD_TILE, HEAD_TILE)
  head_blocks = util.cdiv(out_rows, HEAD_TILE)
  last_rows = out_rows - (head_blocks - 1) * HEAD_TILE
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  along_rows = lambda x, shape: lax.broadcast_in_dim(x, shape, (0,))

  def zero_v_tail(tile, cols, page_start):
    """Zeroes this warpgroup's V columns of the rows past ``seq_len`` (last page only; NaN-safe ``P @ V``)."""
    @pl.when(page_start + PAGE_SIZE > seq_len)
    def _():
      v = tile.at[:, cols]
      token = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, COLS), 0, layout=plgpu.Layout.WGMMA)
      v[...] = jnp.where(token < seq_len - page_start,
                         plgpu.load(v, layout=plgpu.Layout.WGMMA, optimized=False), 0).astype(v.dtype)

  def accumulate(acc, alpha, tile, cols):
    """``acc * alpha + P @ V[:, cols]`` with P from SMEM."""
    acc = acc * along_rows(alpha, acc.shape)

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, tile.at[:, cols])
      if smem_operands:
        return acc_ref[...]

    if smem_operands:
      return acc + pl.run_scoped(pv, plgpu.ACC((HEAD_TILE, COLS), jnp.float32))
    return pl.run_state(pv)(plgpu.ACC.init(acc))

  def release(i, slot):
    """Hands ring slot ``slot`` back to the memory warpgroup after page ``i``, if that slot is loaded again.

    The memory warpgroup waits on ``consumed_bar[slot]`` only before it loads page ``i + STAGES`` into the
    slot, so the last ``STAGES`` pages of a split are never released: an arrival for them would complete a
    barrier phase that no warpgroup awaits. On the GPU that is no race (the memory warpgroup has issued its
    last copy and waits for nothing more), but every thread that waits on a barrier must observe each of
    its phases, and interpret mode checks that when the barrier is deallocated (it failed from 3 pages per
    split on, once the memory warpgroup had awaited an earlier phase of slot 0).
    """
    pl.when(i + STAGES < num_pages)(lambda: plgpu.barrier_arrive(consumed_bar.at[slot]))

  def store_rows(copy):
    """``copy(n)`` stores the first n rows of this head tile: only real heads (rounded up to 8) reach HBM."""
    if last_rows == HEAD_TILE:
      copy(HEAD_TILE)
      return
    pl.when(hb < head_blocks - 1)(lambda: copy(HEAD_TILE))
    pl.when(hb == head_blocks - 1)(lambda: copy(last_rows))

  def epilogue(w, acc, inv_l):
    o_stage[w] = (acc * along_rows(inv_l, acc.shape)).astype(o_stage.dtype)
    plgpu.commit_smem()
    store_rows(lambda n: plgpu.copy_smem_to_gmem(
        o_stage.at[w, pl.ds(0, n)], o_ref.at[split, b, pl.ds(row0, n), pl.ds(w * COLS, COLS)]))

  def leader():
    """Warpgroup 0: QK and the softmax for the whole page, then its half of ``P @ V``."""
    if not smem_operands:
      plgpu.set_max_registers(232, action="increase")
    cols = pl.ds(0, COLS)
    plgpu.barrier_wait(q_bar)

    def page_step(i, carry):
      acc, m, l = carry
      slot = lax.rem(i, STAGES)
      tile = kv_smem.at[slot]
      page_start = (first_page + i) * PAGE_SIZE
      plgpu.barrier_wait(kv_bar.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, tile.T)
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, PAGE_SIZE), jnp.float32)) * (scale * LOG2E)
      token = plgpu.broadcasted_iota(jnp.int32, (HEAD_TILE, PAGE_SIZE), 1, layout=plgpu.Layout.WGMMA)
      s = jnp.where(token < seq_len - page_start, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - along_rows(m_new, s.shape))
      l = l * alpha + p.sum(axis=1)

      @pl.when(i > 0)
      def _():
        plgpu.barrier_wait(p_free_bar)  # warpgroup 1 is done with the previous page's P and alpha

      p_smem[...] = p.astype(p_smem.dtype)
      row_smem[...] = alpha
      zero_v_tail(tile, cols, page_start)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready_bar)
      acc = accumulate(acc, alpha, tile, cols)
      release(i, slot)
      return acc, m_new, l

    acc = plgpu.layout_cast(jnp.zeros((HEAD_TILE, COLS), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((HEAD_TILE,), INIT_MAX, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((HEAD_TILE,), jnp.float32), row_layout)
    acc, m, l = lax.fori_loop(0, num_pages, page_step, (acc, m, l))

    @pl.when(num_pages > 0)
    def _():
      plgpu.barrier_wait(p_free_bar)  # warpgroup 1 is done with the ring: the staging may overwrite it

    # l = 0 is an empty split (no page, and acc = 0): (0, -inf). With tokens, l is NaN after a NaN or inf
    # in q or a token's row (exp2 of NaN or of inf - inf), or 0 if every logit was -inf (an infinite input
    # too): both give NaN, never the (0, -inf) that merge_partials drops as an empty split.
    l = jnp.where(l == 0, jnp.where(num_pages > 0, jnp.nan, 0.0), l)
    empty = l == 0
    inv_l = jnp.where(empty, 0.0, 1.0 / l)
    row_smem[...] = inv_l
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l)) * LN2)
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_ready_bar)
    store_rows(lambda n: plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, n)], lse_ref.at[split, b, pl.ds(row0, n)]))
    epilogue(0, acc, inv_l)
    plgpu.wait_smem_to_gmem(0)

  def follower():
    """Warpgroup 1: the other half of ``P @ V`` with the leader's P and alpha."""
    if not smem_operands:
      plgpu.set_max_registers(232, action="increase")
    cols = pl.ds(COLS, COLS)

    def page_step(i, acc):
      slot = lax.rem(i, STAGES)
      tile = kv_smem.at[slot]
      plgpu.barrier_wait(kv_bar.at[slot])
      zero_v_tail(tile, cols, (first_page + i) * PAGE_SIZE)
      plgpu.commit_smem()
      plgpu.barrier_wait(p_ready_bar)
      acc = accumulate(acc, plgpu.load(row_smem, layout=row_layout), tile, cols)
      plgpu.barrier_arrive(p_free_bar)
      release(i, slot)
      return acc

    acc = plgpu.layout_cast(jnp.zeros((HEAD_TILE, COLS), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, num_pages, page_step, acc)
    plgpu.barrier_wait(p_ready_bar)  # the leader's 1 / l, and the leader is done with the ring
    epilogue(1, acc, plgpu.load(row_smem, layout=row_layout))
    plgpu.wait_smem_to_gmem(0)

  pl.when(wg == 0)(leader)
  pl.when(wg == 1)(follower)

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    if not smem_operands:
      plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, HEAD_TILE)], q_smem, q_bar)

    @pl.loop(0, num_pages)
    def _(i):
      slot = lax.rem(i, STAGES)

      @pl.when(i >= STAGES)
      def _():
        plgpu.barrier_wait(consumed_bar.at[slot])

      plgpu.copy_gmem_to_smem(kv_ref.at[table_ref[b, first_page + i]], kv_smem.at[slot], kv_bar.at[slot])


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "partial_dtype", "interpret", "smem_operands"))
def _partials(q_abs, kv_cache, block_table, seq_lens, *, scale, num_splits, partial_dtype, interpret,
              smem_operands):
  batch, num_heads, dim = q_abs.shape
  head_blocks = util.cdiv(num_heads, HEAD_TILE)
  out_rows = util.cdiv(num_heads, 8) * 8  # TMA stores whole 8-row groups of the tiled staging buffer
  q_pad = jnp.pad(q_abs, ((0, 0), (0, head_blocks * HEAD_TILE - num_heads), (0, 0)))
  ring = plgpu.RefUnion(
      plgpu.SMEM((STAGES, PAGE_SIZE, DIM), kv_cache.dtype, transforms=util.smem_transforms(kv_cache.dtype, DIM)),
      plgpu.SMEM((COMPUTE_WGS, HEAD_TILE, COLS), partial_dtype, transforms=util.smem_transforms(partial_dtype, COLS)))
  kernel = plgpu.kernel(
      functools.partial(_body, pps=pages_per_split(block_table.shape[1], num_splits), out_rows=out_rows,
                        scale=scale, smem_operands=smem_operands),
      out_type=(jax.ShapeDtypeStruct((num_splits, batch, out_rows, LATENT_DIM), partial_dtype),
                jax.ShapeDtypeStruct((num_splits, batch, out_rows), jnp.float32)),
      # Row-major: the last grid axis is the fastest (Mosaic GPU maps it to CUDA's x, dispatched first), so the
      # head blocks of one (split, sequence) run at the same time and the second reads the pages from L2.
      grid=(num_splits, batch, head_blocks),
      grid_names=("split", "b", "hb"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      scratch_types=(
          plgpu.SMEM((HEAD_TILE, dim), q_abs.dtype, transforms=util.smem_transforms(q_abs.dtype, dim)),
          ring,
          plgpu.SMEM((HEAD_TILE, PAGE_SIZE), kv_cache.dtype,
                     transforms=util.smem_transforms(kv_cache.dtype, PAGE_SIZE)),
          plgpu.SMEM((HEAD_TILE,), jnp.float32),
          plgpu.SMEM((HEAD_TILE,), jnp.float32),
          plgpu.Barrier(),
          plgpu.Barrier(num_barriers=STAGES),
          plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=STAGES),
          plgpu.Barrier(),
          plgpu.Barrier(),
      ),
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
  )
  with mosaic_interpret.interpret_mode(interpret):
    o_parts, lse_parts = kernel(q_pad, kv_cache, block_table, seq_lens)
  return o_parts[:, :, :num_heads], lse_parts[:, :, :num_heads]


def mla_decode_partials_mosaic(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                               seq_lens: jax.Array, *, scale: float, num_splits: int,
                               partial_dtype: jnp.dtype, interpret: bool,
                               smem_operands: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``mla_decode``: the split partials, as ``reference.mla_decode_partials_reference``.

  Args:
    q_abs: ``[B, Hq, 576]`` bf16 (Hq is padded to a multiple of 64 rows inside; any Hq >= 1).
    kv_cache: ``[pages, 64, 576]`` bf16. block_table: ``[B, max_pages]`` int32. seq_lens: ``[B]`` int32.
      Already validated by ``mla_decode``.
    scale: softmax scale. num_splits: splits S (each ``pages_per_split`` pages). partial_dtype: bf16/f32.
    interpret: run in Mosaic GPU interpret mode (CPU).
    smem_operands: the interpret-safe variant (see README.md); None = ``interpret``.

  Returns:
    ``o_parts [S, B, Hq, 512]`` in ``partial_dtype`` (normalised) and ``lse_parts [S, B, Hq]`` f32 natural
    log; an empty split is ``(0, -inf)``.
  """
  return _partials(q_abs, kv_cache, block_table, seq_lens, scale=scale, num_splits=num_splits,
                   partial_dtype=jnp.dtype(partial_dtype), interpret=interpret,
                   smem_operands=interpret if smem_operands is None else smem_operands)

"""MLA prefill attention as a Pallas Mosaic GPU kernel (Hopper, sm_90a), FlashAttention-3 style.

The kernel is general over key rows: query row ``i`` of ``q [Tq, H, Dn + Dr]`` attends to the key rows
``row_lo[i] <= j < row_hi[i]`` of ``k_nope [Tk, H, Dn]``, ``k_rope [Tk, Dr]`` and ``v [Tk, H, Dv]``, with both
bounds non-decreasing in ``i``. Packed causal self-attention is ``row_lo`` = the row's sequence start and
``row_hi = i + 1``; a chunked prefill whose new tokens attend to a cached prefix and to themselves fits too.

Grid and warpgroups. One program per (head, 128-row query block), the query blocks fastest so that the
programs running at once share one head's K/V tiles in L2 (heads fastest would spread the SMs over all
heads, whose K/V then no longer fit), and in reverse order so that the longest (last) blocks of a long
sequence start first. Three warpgroups: two consumers of 64 query rows each and a producer
that issues every TMA load: the program's q tile and row bounds, then the K/V tiles of each visited key
block into a ring of ``num_stages`` slots. Each consumer computes ``S = q_nope k_nope^T + q_rope k_rope^T``
(two wgmmas into one f32 accumulator: q_nope and q_rope are column slices, whole 64-column tiles, of the one
``[64, Dn + Dr]`` q tile; the key parts have their own ring buffers, and each head's program loads the same
``[block_k, Dr]`` rope key tile),
runs the online softmax in f32 in the base-2 domain (``scale * log2(e)`` folded into one multiply) and
accumulates ``P V`` with P rounded to q's dtype (a register operand). A schedule barrier alternates the
consumers (FA3's ping-pong): one runs its softmax while the other's matmuls run.

Key blocks. A query block visits the key blocks that meet ``[row_lo[first row], row_hi[last row])``.
Blocks inside every row's range of the whole program ("full", most of a long sequence) take no mask; the
others ("checked": a sequence start, the diagonal, a row range of the general form) take the elementwise
mask ``row_lo[i] <= j < row_hi[i]``. ``block_table`` computes the ranges per program in XLA. A consumer
waits on every block of the program (its barrier phases must all be observed) but skips the work of blocks
that none of its rows sees.

Non-finite values. A NaN or inf in q or in a visible key reaches the softmax statistics and the output
through the arithmetic (NaN-propagating max, ``exp2(inf - inf)``); a row whose visible logits are all
``-inf`` has ``l = 0`` and reads NaN. A non-finite value in a key row that a row must not see is replaced by
``-inf`` in the masked logits, but in V it would leak through ``0 * NaN`` in ``P V``. So the producer cleans
the V tile of every checked block in SMEM before the consumers use it. That tile lands on a barrier only the
producer awaits; the producer zeroes its non-finite entries, writes one flag per key row and then arrives on
the barrier the consumers await, and each consumer marks its rows that see a flagged key (their output
becomes NaN). Full blocks are never cleaned: all their rows see every key, and the NaN or inf reaches the
output through ``P V`` itself, in its own column; a row with any non-finite output entry is stored as NaN in
full, as the reference's rows are.

Rows ``lo >= hi`` (none in self-attention) see nothing and give ``lse = -inf``, ``o = 0``.

Padding. A TMA into an operand (tiled) buffer needs the GMEM rows in whole 8-row tiles, so the token arrays
are padded (a copy) only when their rows are not a multiple of 8 or fewer than one box; the last query block
and the last key block otherwise run past the arrays: TMA fills those rows with zeros and drops their stores.
Rows past ``Tq`` in the last query block repeat the last row's bounds, so they add no masked block.

SMEM: the two consumers' q tiles (``2 * 64 * (Dn + Dr)``), each aliased by its own output staging tile after
its last QK, plus ``num_stages`` K/V slots of ``block_k * (Dn + Dr + Dv)`` elements, plus row vectors. K3
(Dn 128, Dr 64, Dv 128, bf16): 48 KiB + 4 x 40 KiB (``block_k`` 64) or 2 x 80 KiB (128) = 208 KiB of 227.

``smem_operands=True`` is the interpret-mode variant (every wgmma operand in SMEM): P goes through an SMEM
tile and ``P V`` into a fresh accumulator added in registers (interpret mode initialises no accumulator
from registers), and no register budgets are set. Nothing else differs.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_interpret, util

WG_ROWS = 64  # query rows of one consumer warpgroup: one wgmma M
COMPUTE_WGS = 2
BLOCK_Q = COMPUTE_WGS * WG_ROWS
HEAD_DIM_MULTIPLE = 64  # every head dim is whole 128-byte swizzle rows of 16-bit elements
SMEM_LIMIT = 227 * 1024
SMEM_SLACK = 4096  # barriers, the reduction scratch and alignment, on top of smem_bytes' buffers
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
# Register budgets per thread (FA3's split of the 64 Ki registers of an SM): the producer keeps enough for
# the [64, 64] register chunks in which it cleans V tiles.
CONSUMER_REGS, PRODUCER_REGS = 224, 56
LN2 = math.log(2.0)
WG = plgpu.Layout.WGMMA
ROWV, COLV = WG.reduce(1), WG.reduce(0)
# block_table columns: the program's key blocks [P0, P1), its unmasked ("full") blocks [F0, F1), then per
# consumer its own blocks [A, D), split into masked [A, B), full [B, C) and masked [C, D).
P0, P1, F0, F1 = range(4)
f32 = jnp.float32


def unsupported(dtype, dn: int, dr: int, dv: int) -> str | None:
  """Why the kernel does not take inputs of ``dtype`` with these head dims, or None when it does: it takes bf16 and
  f16, and head dims (Dn, Dr, Dv) that are positive multiples of 64."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, KERNEL_DTYPES)):
    return f"takes bf16 or f16 inputs, got q dtype {jnp.dtype(dtype).name}"
  for name, d in (("k_nope", dn), ("k_rope", dr), ("v", dv)):
    if d % HEAD_DIM_MULTIPLE or not d:
      return f"needs {name}'s last dim to be a positive multiple of {HEAD_DIM_MULTIPLE}, got {d}"
  return None


def check_supported(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array) -> None:
  """Raises ``NotImplementedError`` for valid inputs the kernel does not take (``unsupported``)."""
  why = unsupported(q.dtype, k_nope.shape[-1], k_rope.shape[-1], v.shape[-1])
  if why:
    raise NotImplementedError(f"the Mosaic GPU MLA prefill kernel {why} (use impl='xla')")


def _output_stage_rows(dq: int, dv: int) -> int | None:
  """Rows of a ``[rows, Dv]`` output staging tile of exactly one consumer's q-tile bytes, or None if none fits."""
  rows, rem = divmod(WG_ROWS * dq, dv)
  return rows if rem == 0 and rows % 8 == 0 and rows >= WG_ROWS else None


def smem_bytes(dn: int, dr: int, dv: int, itemsize: int, block_k: int, num_stages: int) -> int:
  """SMEM of the compiled kernel (the q / output tiles, the K/V ring, the row vectors), without alignment."""
  dq = dn + dr
  q_tiles = COMPUTE_WGS * WG_ROWS * dq * itemsize
  if _output_stage_rows(dq, dv) is None:
    q_tiles += COMPUTE_WGS * WG_ROWS * dv * itemsize
  ring = num_stages * block_k * (dq + dv) * itemsize
  vectors = COMPUTE_WGS * 3 * WG_ROWS * 4 + num_stages * block_k * 4
  return q_tiles + ring + vectors


def block_table(row_lo: jax.Array, row_hi: jax.Array, block_k: int) -> jax.Array:
  """Key-block ranges of every query block (XLA, int32): ``[Tq / 128, 12]``.

  Args:
    row_lo, row_hi: ``[num_q_blocks * 128]`` int32 non-decreasing bounds (padding rows included).
    block_k: key rows per block.

  Returns:
    Per query block, in key blocks: the visited range ``[P0, P1)``; the full range ``[F0, F1)`` inside it
    (blocks inside every row's range: no mask); then per consumer ``w`` (columns ``4 + 4 w ...``) ``A <= B <= C
    <= D``: its rows see blocks ``[A, D)`` only, ``[B, C)`` of them full and the rest masked.
  """
  nq = row_lo.shape[0] // BLOCK_Q
  lo = row_lo.reshape(nq, COMPUTE_WGS, WG_ROWS)
  hi = row_hi.reshape(nq, COMPUTE_WGS, WG_ROWS)
  up = lambda x: (x + block_k - 1) // block_k
  down = lambda x: x // block_k
  # Bounds are non-decreasing: a group's first row has the least lo and hi, its last row the greatest.
  p0 = down(lo[:, 0, 0])
  p1 = jnp.maximum(up(hi[:, -1, -1]), p0)
  f0 = jnp.clip(up(lo[:, -1, -1]), p0, p1)
  f1 = jnp.clip(down(hi[:, 0, 0]), f0, p1)
  cols = [p0, p1, f0, f1]
  for w in range(COMPUTE_WGS):
    a = jnp.clip(down(lo[:, w, 0]), p0, p1)
    d = jnp.clip(up(hi[:, w, -1]), a, p1)
    b = jnp.clip(f0, a, d)
    cols += [a, b, jnp.clip(f1, b, d), d]
  return jnp.stack(cols, axis=1).astype(jnp.int32)


def _bcast_rows(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
  return lax.broadcast_in_dim(x, shape, (0,))


def _bcast_cols(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
  return lax.broadcast_in_dim(x, shape, (1,))


def _finite(x: jax.Array) -> jax.Array:
  # |x| < inf is false for NaN and for +-inf (ordered comparison); Mosaic GPU lowers no is_finite.
  return jnp.abs(x) < jnp.inf


def _body(tab_ref, lo_ref, hi_ref, q_ref, kn_ref, kr_ref, v_ref, o_ref, lse_ref, *scratch, scale: float,
          block_k: int, num_stages: int, num_q_blocks: int, smem_operands: bool):
  (q_tiles, o_stage), kn_ring, kr_ring, v_ring, rows, vbad, lse_stage, *p_stage = scratch[:-7]
  q_bar, k_bar, v_bar, vraw_bar, vclean_bar, consumed_bar, sched_bar = scratch[-7:]
  qb = num_q_blocks - 1 - lax.axis_index("q")
  h = lax.axis_index("h")
  wg = lax.axis_index("wg")
  bk, stages = block_k, num_stages
  dn = kn_ref.shape[-1]
  dr = kr_ref.shape[-1]
  dv = v_ref.shape[-1]
  dtype = q_ref.dtype
  row0 = qb * BLOCK_Q
  p0, p1, f0, f1 = (tab_ref[qb, c] for c in (P0, P1, F0, F1))
  n = p1 - p0
  checked = lambda blk: (blk < f0) | (blk >= f1)

  def tile_rows(w):
    return pl.multiple_of(row0 + w * WG_ROWS, WG_ROWS)

  def key_rows(blk):
    return pl.ds(pl.multiple_of(blk * bk, bk), bk)

  def consumer():
    if not smem_operands:
      plgpu.set_max_registers(CONSUMER_REGS, action="increase")
    a, b, c, d = (tab_ref[qb, 4 + 4 * wg + k] - p0 for k in range(4))
    r0 = tile_rows(wg)
    q_tile = q_tiles.at[wg]
    q_nope, q_rope = q_tile.at[:, pl.ds(0, dn)], q_tile.at[:, pl.ds(dn, dr)]
    plgpu.barrier_wait(q_bar.at[wg])
    lo = plgpu.load(rows.at[wg, 0], layout=ROWV, optimized=False)
    hi = plgpu.load(rows.at[wg, 1], layout=ROWV, optimized=False)
    s_shape, o_shape = (WG_ROWS, bk), (WG_ROWS, dv)
    c_log2 = scale * util.LOG2E

    def schedule():
      plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(sched_bar)

    def release(i, slot):
      # The producer awaits slot `slot` again only to load block i + stages; an arrival that completes a
      # phase nobody awaits would fail interpret mode's barrier check.
      pl.when(i + stages < n)(lambda: plgpu.barrier_arrive(consumed_bar.at[slot]))

    def wait_v(slot, blk_checked):
      pl.when(blk_checked)(lambda: plgpu.barrier_wait(vclean_bar.at[slot]))
      pl.when(jnp.logical_not(blk_checked))(lambda: plgpu.barrier_wait(v_bar.at[slot]))

    def skip(i, carry):
      """A block none of this consumer's rows sees: its barrier phases are observed, nothing is computed."""
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_bar.at[slot])
      schedule()
      plgpu.barrier_arrive(sched_bar)
      wait_v(slot, checked(p0 + i))
      plgpu.barrier_wait(sched_bar)
      release(i, slot)
      return carry

    def pv(acc, p16, slot):
      p_op = p16
      if smem_operands:
        p_op = p_stage[0].at[wg]
        p_op[...] = p16
        plgpu.commit_smem()
      return util.accumulate(lambda acc_ref: plgpu.wgmma(acc_ref, p_op, v_ring.at[slot]), acc,
                             from_inits=not smem_operands)[0]

    def step(i, carry, *, masked: bool):
      acc, m, l, hit = carry
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_bar.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_nope, kn_ring.at[slot].T)
        plgpu.wgmma(acc_ref, q_rope, kr_ring.at[slot].T)
        schedule()  # the other consumer's softmax runs while these matmuls do
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC(s_shape, f32))
      if masked:
        # The cleaned tile is awaited before the softmax (masked blocks are few) so that the mask is used up
        # here, not kept live in registers across P V.
        plgpu.barrier_wait(vclean_bar.at[slot])
        k0 = (p0 + i) * bk
        col = plgpu.broadcasted_iota(jnp.int32, s_shape, 1, layout=WG)
        mask = (col >= _bcast_rows(lo - k0, s_shape)) & (col < _bcast_rows(hi - k0, s_shape))
        s = jnp.where(mask, s, -jnp.inf)
        flags = plgpu.load(vbad.at[slot], layout=COLV, optimized=False)
        hit = jnp.maximum(hit, jnp.where(mask, _bcast_cols(flags, s_shape), 0.0).max(axis=1))
      m_new = jnp.maximum(m, s.max(axis=1) * c_log2)
      # Shift by 0 while a row has seen only -inf (masked keys, or infinite inputs): exp2(-inf - -inf) would
      # be NaN. A NaN or +inf maximum stays and makes the row NaN, as it must.
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_use)
      p = jnp.exp2(s * c_log2 - _bcast_rows(m_use, s_shape))
      l = l * alpha + p.sum(axis=1)
      acc = acc * _bcast_rows(alpha, o_shape)
      p16 = p.astype(dtype)
      plgpu.barrier_arrive(sched_bar)
      if not masked:
        plgpu.barrier_wait(v_bar.at[slot])
      plgpu.barrier_wait(sched_bar)
      acc = pv(acc, p16, slot)
      release(i, slot)
      return acc, m_new, l, hit

    carry = (plgpu.layout_cast(jnp.zeros(o_shape, f32), WG),
             plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, f32), ROWV),
             plgpu.layout_cast(jnp.zeros((WG_ROWS,), f32), ROWV),
             plgpu.layout_cast(jnp.zeros((WG_ROWS,), f32), ROWV))
    pl.when(wg == 1)(schedule)  # consumer 1 runs half a step behind consumer 0
    carry = lax.fori_loop(0, a, skip, carry)
    carry = lax.fori_loop(a, b, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(b, c, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(c, d, functools.partial(step, masked=True), carry)
    acc, m, l, hit = lax.fori_loop(d, n, skip, carry)
    pl.when(wg == 0)(schedule)

    # l = 0 in a row that sees keys means all its logits were -inf (infinite inputs): NaN, as in the
    # reference, through 0 * (1 / 0). A row that sees nothing is (0, -inf).
    nonempty = lo < hi
    o = acc * _bcast_rows(jnp.where(nonempty, 1.0 / l, 0.0), o_shape)
    # A non-finite V entry of a full block reached only its own column: the whole row becomes NaN.
    hit = jnp.maximum(hit, jnp.where(_finite(o), 0.0, 1.0).max(axis=1))
    o = jnp.where(_bcast_rows(hit, o_shape) == 0, o, jnp.nan)
    lse = jnp.where(nonempty, jnp.where(l == 0, jnp.nan, (m + jnp.log2(l)) * LN2), -jnp.inf)
    out = o_stage.at[wg, pl.ds(0, WG_ROWS)]  # aliases this consumer's q tile, whose last reader is done
    out[...] = o.astype(dtype)
    lse_stage.at[wg][...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out, o_ref.at[pl.ds(r0, WG_ROWS), h])
    plgpu.copy_smem_to_gmem(lse_stage.at[wg], lse_ref.at[h, pl.ds(r0, WG_ROWS)])
    util.finish_stores()

  def producer():
    if not smem_operands:
      plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
    for w in range(COMPUTE_WGS):
      tile = pl.ds(tile_rows(w), WG_ROWS)
      plgpu.copy_gmem_to_smem(q_ref.at[tile, h], q_tiles.at[w], q_bar.at[w])
      plgpu.copy_gmem_to_smem(lo_ref.at[tile], rows.at[w, 0], q_bar.at[w])
      plgpu.copy_gmem_to_smem(hi_ref.at[tile], rows.at[w, 1], q_bar.at[w])

    def clean(i):
      """Zeroes the non-finite entries of block i's V tile and flags its key rows that held one."""
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(vraw_bar.at[slot])
      for r in range(0, bk, WG_ROWS):
        bad = None
        for c in range(0, dv, HEAD_DIM_MULTIPLE):
          chunk = v_ring.at[slot, pl.ds(r, WG_ROWS), pl.ds(c, HEAD_DIM_MULTIPLE)]
          x = plgpu.load(chunk, layout=WG, optimized=False)
          ok = _finite(x)
          chunk[...] = jnp.where(ok, x, jnp.zeros_like(x))
          row_bad = jnp.where(ok, 0.0, 1.0).max(axis=1)
          bad = row_bad if bad is None else jnp.maximum(bad, row_bad)
        vbad.at[slot, pl.ds(r, WG_ROWS)][...] = bad
      plgpu.commit_smem()
      plgpu.barrier_arrive(vclean_bar.at[slot])

    def issue(i):
      slot = lax.rem(i, stages)
      blk = p0 + i
      keys = key_rows(blk)
      pl.when(i >= stages)(lambda: plgpu.barrier_wait(consumed_bar.at[slot]))
      plgpu.copy_gmem_to_smem(kn_ref.at[keys, h], kn_ring.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(kr_ref.at[keys], kr_ring.at[slot], k_bar.at[slot])
      is_checked = checked(blk)
      pl.when(is_checked)(lambda: plgpu.copy_gmem_to_smem(v_ref.at[keys, h], v_ring.at[slot], vraw_bar.at[slot]))
      pl.when(jnp.logical_not(is_checked))(
          lambda: plgpu.copy_gmem_to_smem(v_ref.at[keys, h], v_ring.at[slot], v_bar.at[slot]))

    def step(i, carry):
      pl.when(i < n)(lambda: issue(i))
      # Block i - (stages - 1) is cleaned just before the next step waits for its consumption: the loads of
      # the blocks after it are in flight by then, and its own V was issued stages - 1 loads ago.
      old = i - (stages - 1)
      pl.when((old >= 0) & checked(p0 + old))(lambda: clean(old))
      return carry

    lax.fori_loop(0, n + stages - 1, step, None)

  pl.when(wg < COMPUTE_WGS)(consumer)
  pl.when(wg == COMPUTE_WGS)(producer)


def _rows(t: int, box: int) -> int:
  """Rows an array of ``t`` token rows is padded to: whole 8-row tiles and at least one TMA box."""
  return max(util.cdiv(t, 8) * 8, box)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_stages", "interpret", "smem_operands"))
def _attention(q, k_nope, k_rope, v, row_lo, row_hi, *, scale, block_k, num_stages, interpret, smem_operands):
  tq, h, dq = q.shape
  dn, dr, dv = k_nope.shape[-1], k_rope.shape[-1], v.shape[-1]
  dtype = q.dtype
  nq = util.cdiv(tq, BLOCK_Q)
  q = util.pad_rows(q, _rows(tq, WG_ROWS))
  tk = _rows(k_nope.shape[0], block_k)
  k_nope, k_rope, v = (util.pad_rows(x, tk) for x in (k_nope, k_rope, v))
  # Rows past Tq repeat the last row's bounds: no extra masked block, and their results are dropped.
  row_lo, row_hi = (jnp.pad(x.astype(jnp.int32), (0, nq * BLOCK_Q - tq), mode="edge") for x in (row_lo, row_hi))
  stage_rows = _output_stage_rows(dq, dv)
  q_spec = plgpu.SMEM((COMPUTE_WGS, WG_ROWS, dq), dtype, transforms=util.smem_transforms(dtype, dq))
  o_spec = plgpu.SMEM((COMPUTE_WGS, stage_rows or WG_ROWS, dv), dtype, transforms=util.smem_transforms(dtype, dv))
  # One ref per group starts each group at the union's offset 0, so consumer w's output tile (rows sized to
  # one q tile's bytes) covers exactly its own q tile and never the other consumer's.
  q_o = plgpu.RefUnion(q_spec, o_spec) if stage_rows else (q_spec, o_spec)
  ring = lambda d: plgpu.SMEM((num_stages, block_k, d), dtype, transforms=util.smem_transforms(dtype, d))
  scratch = [q_o, ring(dn), ring(dr), ring(dv), plgpu.SMEM((COMPUTE_WGS, 2, WG_ROWS), jnp.int32),
             plgpu.SMEM((num_stages, block_k), f32), plgpu.SMEM((COMPUTE_WGS, WG_ROWS), f32)]
  if smem_operands:
    scratch.append(plgpu.SMEM((COMPUTE_WGS, WG_ROWS, block_k), dtype, transforms=util.smem_transforms(dtype, block_k)))
  scratch += [
      plgpu.Barrier(num_arrivals=3, num_barriers=COMPUTE_WGS),  # q tile, row_lo, row_hi
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # k_nope, k_rope
      plgpu.Barrier(num_barriers=num_stages),  # V of a full block
      plgpu.Barrier(num_barriers=num_stages),  # V of a checked block, for the producer
      plgpu.Barrier(num_barriers=num_stages),  # V of a checked block, cleaned
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_stages),  # slot consumed
      plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # schedule
  ]
  kernel = plgpu.kernel(
      functools.partial(_body, scale=scale, block_k=block_k, num_stages=num_stages, num_q_blocks=nq,
                        smem_operands=smem_operands),
      out_type=(jax.ShapeDtypeStruct((q.shape[0], h, dv), dtype), jax.ShapeDtypeStruct((h, nq * BLOCK_Q), f32)),
      # Row-major: the last grid axis is the fastest (Mosaic GPU maps it to CUDA's x, which the hardware
      # dispatches first), so the query blocks of one head run together.
      grid=(h, nq),
      grid_names=("h", "q"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      kernel_name="mla_prefill",
      scratch_types=scratch,
      compiler_params=util.compiler_params(approx_math=True),
  )
  with mosaic_interpret.interpret_mode(interpret):
    o, lse = kernel(block_table(row_lo, row_hi, block_k), row_lo, row_hi, q, k_nope, k_rope, v)
  return o[:tq], lse[:, :tq].T


def check_row_bounds(row_lo: jax.Array, row_hi: jax.Array, tq: int, tk: int) -> None:
  """Raises ``ValueError`` for row bounds that are not ``[Tq]`` int32 or, when concrete, not non-decreasing
  within ``[0, Tk]``."""
  for name, x in (("row_lo", row_lo), ("row_hi", row_hi)):
    util.check_shape(name, x, (tq,))
    util.check_dtype(name, x, (jnp.int32,))
    value = util.concrete(x)
    if value is not None and value.size and (value.min() < 0 or value.max() > tk or (np.diff(value) < 0).any()):
      raise ValueError(f"{name} must be non-decreasing within [0, Tk = {tk}], got {value.tolist()}")


def mla_prefill_mosaic(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array, row_lo: jax.Array,
                       row_hi: jax.Array, *, scale: float, block_k: int, num_stages: int, interpret: bool,
                       smem_operands: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Kernel path of MLA prefill attention over general row bounds (see the module docstring).

  Args:
    q: ``[Tq, H, Dn + Dr]`` bf16/f16 queries.
    k_nope: ``[Tk, H, Dn]``, k_rope: ``[Tk, Dr]`` (shared by all heads), v: ``[Tk, H, Dv]``, q's dtype; Dn, Dr
      and Dv positive multiples of 64.
    row_lo, row_hi: ``[Tq]`` int32, both non-decreasing in the row, within ``[0, Tk]``: query row ``i`` sees the
      key rows ``row_lo[i] <= j < row_hi[i]`` (none when ``row_lo[i] >= row_hi[i]``).
    scale: softmax scale (> 0). block_k: key rows per step (64 or 128). num_stages: K/V ring slots (>= 2).
    interpret: run in Mosaic GPU interpret mode (CPU).
    smem_operands: the interpret-safe variant (module docstring); None = ``interpret``.

  Returns:
    ``o [Tq, H, Dv]`` in q's dtype and ``lse [Tq, H]`` f32 natural log; a row that sees no key gives ``o = 0``
    and ``lse = -inf``. NaN rules as ``mla_prefill_attention``'s, for the keys each row sees.

  Raises:
    ValueError: malformed shapes, dtypes or (when concrete) row bounds, or a tuning over the SMEM limit.
    NotImplementedError: a dtype or head dim the kernel does not take (``check_supported``).
  """
  check_supported(q, k_nope, k_rope, v)
  tq, h, dq = q.shape
  tk, dn, dr, dv = k_nope.shape[0], k_nope.shape[-1], k_rope.shape[-1], v.shape[-1]
  util.check_shape("k_nope", k_nope, (None, h, dq - dr))
  util.check_shape("k_rope", k_rope, (tk, None))
  util.check_shape("v", v, (tk, h, None))
  for name, x in (("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
    util.check_dtype(name, x, (q.dtype,))
  check_row_bounds(row_lo, row_hi, tq, tk)
  need = smem_bytes(dn, dr, dv, jnp.dtype(q.dtype).itemsize, block_k, num_stages) + SMEM_SLACK
  if need > SMEM_LIMIT:
    raise ValueError(f"tuning block_k={block_k}, num_stages={num_stages} needs {need} bytes of SMEM for "
                     f"Dn={dn}, Dr={dr}, Dv={dv}, over the {SMEM_LIMIT} of a Hopper SM")
  if tq == 0:
    return jnp.zeros((0, h, dv), q.dtype), jnp.zeros((0, h), f32)
  return _attention(q, k_nope, k_rope, v, row_lo, row_hi, scale=float(scale), block_k=block_k,
                    num_stages=num_stages, interpret=interpret,
                    smem_operands=interpret if smem_operands is None else smem_operands)

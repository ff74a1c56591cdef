"""KDA prefill, stage 1 (chunk-parallel): everything that needs only one 64-token chunk of one head.

One program per (chunk slot, head), one warpgroup, turns the chunk's raw inputs into the bf16 operands of
stage 2 (``qg``, ``kg``, ``neg_w``, ``u``, ``aqk``) and its f32 ``chunk_decay``. See README.md, "Prefill stage
1", for the formulas, the safe anchoring of the gate exponents, the inverse by block doubling and SMEM reuse.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import util
from pallas_kernels.kda._mosaic import COLV, ROWV, WG, bcast_cols, bcast_rows, bf16, f32, tiled
from pallas_kernels.kda.config import CHUNK_SIZE as C
from pallas_kernels.kda.kernel_math import GATE_FLOOR, L2NORM_EPS, bounded_gate_log2, gate, reciprocal
from pallas_kernels.kda.reference import SUB_BLOCK as SUB
from pallas_kernels.util import LOG2E

NSUB = C // SUB
# Rows per anchor block with a lower-bound gate. Its anchored factors reach 2^(|lower_bound| log2(e) rows / 2)
# (anchor at the block's middle): with KdaConfig's lower_bound >= -5 that is 2^115 at 32 rows, inside f32's and
# bf16's range (2^127), and 32-row blocks halve the key tiles of 16-row ones.
BOUNDED_BLOCK = 32
# The smallest exponent of one part of W's anchor factor 2^ν_b (README.md, "W from Kd"): a normal f32 (exp2 flushes
# subnormals to 0 under approx_math), with room for the gate's rounding.
W_PART_MIN_EXP = -125


def w_scale_parts(b: int, lower_bound: float | None) -> int:
  """How many equal factors W's anchor factor ``2^ν_b`` of key block ``b`` takes. With the softplus gate one: the
  anchor is the block's first row, so where ``2^ν_b`` is below f32's range so are the block's terms. With a lower
  bound, ``ν_b >= (anchor row + 1) · lower_bound · log2 e`` (the anchor at row ``32 b + 16``; ≈ -123 for the first
  block and -353 for the second at the bound -5), split so that each part stays above ``2^W_PART_MIN_EXP``."""
  if lower_bound is None:
    return 1
  nu_min = (b * BOUNDED_BLOCK + BOUNDED_BLOCK // 2 + 1) * lower_bound * LOG2E
  return max(1, math.ceil(nu_min / W_PART_MIN_EXP))


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WG)


def matmul(pairs, shape: tuple[int, int]) -> jax.Array:
  """Sum of ``a @ b`` over SMEM operand pairs, one f32 wgmma accumulator, returned in registers."""

  def body(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, b)
    return acc[...]

  return pl.run_scoped(body, plgpu.ACC(shape, f32))


def load_rows(ref, dtype=f32) -> jax.Array:
  return plgpu.load(ref, layout=WG, optimized=False).astype(dtype)


def load_l2norm(ref, row_factor: jax.Array) -> jax.Array:
  """Row-wise L2 normalisation (eps 1e-6 inside the sqrt of the sum) times a per-row factor (a mask, a
  scale); the raw rows are finite (real tokens or TMA zero fill), so a zero factor masks a row."""
  x = load_rows(ref)
  inv = lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS) * row_factor
  return x * bcast_rows(inv, x.shape)


def zero_rows_from(refs, n: jax.Array) -> None:
  """Rows ``n..`` of raw tiles set to 0 in SMEM, for a chunk of ``n < C`` tokens: the tiles' rows past it hold the
  next sequence's tokens, which may be NaN or inf, and the matmuls that weight them by 0 would still carry a NaN
  (0 * NaN is NaN) into this sequence. Ends in a warpgroup barrier; cold code, run for partial chunks only."""
  for ref in refs:
    x = plgpu.load(ref, layout=WG, optimized=False)
    ref[...] = jnp.where(iota(x.shape, 0) < n, x, jnp.zeros_like(x))
  plgpu.commit_smem()


def split(x: jax.Array, parts: int) -> list[jax.Array]:
  """``parts`` bf16 values whose f32 sum is ``x`` to about ``8 * parts`` bits."""
  out = []
  for _ in range(parts):
    p = x.astype(bf16)
    out.append(p)
    x = x - p.astype(f32)
  return out


def _prep_body(table_ref, q_ref, k_ref, v_ref, g_ref, b_ref, alog_ref, dtb_ref,
               qg_ref, kg_ref, neg_w_ref, u_ref, aqk_ref, decay_ref,
               x_q, x_k, x_v, y, anchors_s, bar_g, bar_qkv, *,
               K: int, V: int, scale: float, lower_bound: float | None, smem_operands: bool):
  # Register budget: one [C, K] f32 array is 64 registers per thread, so row-dependent factors stay
  # per-row vectors (2 registers) and column-dependent ones per-column vectors, broadcast where used.
  bounded = lower_bound is not None
  blk_rows = BOUNDED_BLOCK if bounded else SUB
  nblk = C // blk_rows
  off = blk_rows // 2 if bounded else 0  # anchor row inside each block
  raw_q, qt_s, (p_s, f_s) = x_q
  raw_k, kd_s = x_k
  raw_v, bv_s = x_v
  raw_g, (gsplit, tril), ph_diag, (stage_a, stage_b), (x_s, aqk_s) = y
  # Chunk slots in reverse order: the last items written, whose workspaces the L2 still holds when the state pass
  # starts, are the first chunks of the first sequences, which the state pass's first programs read first.
  rows = table_ref.shape[0]
  c = table_ref.shape[1] - 1 - lax.axis_index("c")
  h = lax.axis_index("h")
  t0 = table_ref[rows - 2, c]
  n = table_ref[rows - 1, c]

  @pl.when(n > 0)
  def _():
    phases = util.Phases()  # named regions for the on-device profiler (util.compiler_params)
    phases.start("issue")
    plgpu.copy_gmem_to_smem(g_ref.at[pl.ds(t0, C), h], raw_g, bar_g.at[0])
    for src, dst in ((q_ref, raw_q), (k_ref, raw_k), (v_ref, raw_v)):
      plgpu.copy_gmem_to_smem(src.at[pl.ds(t0, C), h], dst, bar_qkv.at[0])
    rowv = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=ROWV)
    validf = jnp.where(rowv < n, 1.0, 0.0)
    a = jnp.exp(alog_ref[h])
    dtb = plgpu.load(dtb_ref.at[h], layout=COLV, optimized=False)
    beta_raw = plgpu.load(b_ref.at[pl.ds(t0, C), h], layout=ROWV, optimized=False)  # a strided column
    beta = jnp.where(rowv < n, reciprocal(1.0 + jnp.exp(-beta_raw)), 0.0)  # a select: the next token may be NaN

    # Gate (log2 units). Rows past a partial chunk are zeroed first (they hold the next sequence's tokens, which
    # may be NaN), then left in: the cumulative sum's matrix drops them. An unbounded gate gets a floor: it changes
    # no factor (a span over a token at the floor is below f32's smallest value either way) but keeps the chunk's
    # cumulative sums small enough that differences of them keep their precision after an extreme token (e.g.
    # -1e13 with a huge A_log). A lower bound above the floor needs none, so that path has no extra op.
    phases.start("gate")
    plgpu.barrier_wait(bar_g.at[0])
    pl.when(n < C)(lambda: zero_rows_from([raw_g], n))
    if bounded:
      g = bounded_gate_log2(load_rows(raw_g), bcast_cols(dtb, (C, K)), a, lower_bound)
    else:
      g = gate(load_rows(raw_g) + bcast_cols(dtb, (C, K)), a, lower_bound, scale=LOG2E)
    if lower_bound is None or lower_bound * LOG2E < GATE_FLOOR:
      g = jnp.maximum(g, GATE_FLOOR)
    plgpu.commit_smem()  # raw_g is read in every warp before its memory takes the split gate

    # G[r] = sum_{s<=r, s<n} g[s] as a matmul with a lower-triangular ones matrix whose columns past the
    # chunk are 0 (rows past it repeat G[n-1]), g split into bf16 parts.
    phases.start("cumsum")
    r_cc, c_cc = iota((C, C), 0), iota((C, C), 1)
    tril[...] = jnp.where((c_cc <= r_cc) & (c_cc < n), 1.0, 0.0).astype(bf16)
    for dst, part in zip(gsplit, split(g, len(gsplit))):
      dst[...] = part
    plgpu.commit_smem()
    G = matmul([(tril, part) for part in gsplit], (C, K))
    plgpu.commit_smem()  # the cumsum's operands are dead in every warp before g_pad reuses their memory

    phases.start("anchors")
    # G rows read back as per-column vectors (anchors, last row) from an f32 copy; the anchors move to
    # anchors_s, outside the union, because the tiles overwrite g_pad's memory.
    g_pad, k_pad = ph_diag.at[0], None if bounded else ph_diag.at[1]
    g_pad[pl.ds(SUB, C), :] = G
    plgpu.commit_smem()
    g_last = plgpu.load(g_pad.at[SUB + C - 1], layout=COLV, optimized=False)
    anchors = [plgpu.load(g_pad.at[SUB + b * blk_rows + off], layout=COLV, optimized=False) for b in range(nblk)]
    for b, nu_b in enumerate(anchors):
      anchors_s[b] = nu_b
    # Row factor 2^(G[r] - G[anchor of r's block]): a block is one warp's rows (16) or two warps' (32).
    # The anchor is selected before the subtraction: one select per element and block after the first.
    blk = iota((C, K), 0) // blk_rows
    nu_row = bcast_cols(anchors[0], (C, K))
    for b in range(1, nblk):
      nu_row = jnp.where(blk == b, bcast_cols(anchors[b], (C, K)), nu_row)
    d_row = jnp.exp2(G - nu_row)

    phases.start("qkv")
    plgpu.barrier_wait(bar_qkv.at[0])
    pl.when(n < C)(lambda: zero_rows_from([raw_k, raw_v], n))  # q's rows past the chunk reach only their own rows
    bv = load_rows(raw_v) * bcast_rows(beta, (C, V))
    plgpu.commit_smem()  # raw_v read in every warp
    bv_s[...] = bv.astype(bf16)
    q = load_l2norm(raw_q, validf * scale)

    r64, c64 = iota((C, C), 0), iota((C, C), 1)
    zeros_cc = plgpu.layout_cast(jnp.zeros((C, C), f32), WG)  # the accumulators' layout, explicit
    if not bounded:
      phases.start("diagonal")
      # Diagonal 16x16 blocks pairwise: A[r, r-d] from row-shifted copies of k and G. The SUB rows above
      # the copies hold stale data: row r reads them only for r < d, a row `hit` never selects.
      k = load_l2norm(raw_k, validf)
      k_pad[pl.ds(SUB, C), :] = k
      plgpu.commit_smem()

      def diag_step(d, carry):
        aqk_d, l_d = carry
        k_j = plgpu.load(k_pad.at[pl.ds(SUB - d, C)], layout=WG, optimized=False)
        g_j = plgpu.load(g_pad.at[pl.ds(SUB - d, C)], layout=WG, optimized=False)
        kdec = k_j * jnp.exp2(G - g_j)
        hit = (c64 == r64 - d) & (r64 - d >= (r64 // SUB) * SUB)
        aqk_d = jnp.where(hit, bcast_rows(jnp.sum(q * kdec, axis=1), (C, C)), aqk_d)
        l_d = jnp.where(hit, bcast_rows(jnp.sum(k * kdec, axis=1) * beta, (C, C)), l_d)
        return aqk_d, l_d

      aqk_acc, l_acc = lax.fori_loop(0, SUB, diag_step, (zeros_cc, zeros_cc))
    else:
      aqk_acc = l_acc = zeros_cc
    # raw_q is read and every g_pad read is done in every warp before their memory takes the tiles.
    plgpu.commit_smem()

    phases.start("tiles")
    # Tiles. Every factor is a pairwise-safe exponent (see README.md): 2^(G - G_anchor) within 2^±116
    # (lower-bound gate) or <= 1 (softplus gate), 2^G, 2^(G_last - G) and the keys' 2^(ν_b - G), bounded like
    # the rows, with keys past block b cut to 2^-inf = 0 by a per-row -inf added to the exponent.
    gamma_row = jnp.exp2(G)
    qt_s[...] = (q * d_row).astype(bf16)
    stage_a[...] = (q * gamma_row).astype(bf16)
    if bounded:
      k = load_l2norm(raw_k, validf)
      plgpu.commit_smem()  # raw_k read in every warp
    # Kd carries β: L's rows need it, and so does W, which is taken from Kd (see w_u).
    kd_s[...] = (k * d_row * bcast_rows(beta, (C, K))).astype(bf16)
    stage_b[...] = (k * jnp.exp2(bcast_cols(g_last, (C, K)) - G)).astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage_a, qg_ref.at[c, h])
    plgpu.copy_smem_to_gmem(stage_b, kg_ref.at[c, h])
    decay_ref[c, h] = jnp.exp2(g_last)

    phases.start("aqk_l")
    # Block row b of Aqk and L from the keys of block b (block rows are selected after the matmul); the
    # key tiles take stage_a and stage_b once the qg/kg stores have read them. With 32-row blocks an entry
    # above the diagonal (a later key of the same block) can overflow to ±inf or NaN: the causal selects below
    # drop those entries, and nothing multiplies them before.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def key_tile(b, kb_s):
      nu_b = plgpu.load(anchors_s.at[b], layout=COLV, optimized=False)
      ex = bcast_cols(nu_b, (C, K)) - G
      if not (bounded and b == nblk - 1):  # the last 32-row block's keys are every row: nothing to cut
        ex = ex + bcast_rows(jnp.where(rowv < (b + 1 if bounded else b) * blk_rows, 0.0, -jnp.inf), (C, K))
      kb_s[...] = (k * jnp.exp2(ex)).astype(bf16)

    def add_block(b, kb_s, acc):
      def block_products(acc_a, acc_l):
        plgpu.wgmma(acc_a, qt_s, kb_s.T)
        plgpu.wgmma(acc_l, kd_s, kb_s.T)
        return acc_a[...], acc_l[...]

      aqk_b, l_b = pl.run_scoped(block_products, plgpu.ACC((C, C), f32), plgpu.ACC((C, C), f32))
      sel = r64 // blk_rows == b
      return jnp.where(sel, aqk_b + acc[0], acc[0]), jnp.where(sel, l_b + acc[1], acc[1])

    acc = (aqk_acc, l_acc)
    if bounded:
      # Both key tiles at once (two 32-row blocks), one barrier before their products.
      tiles = list(zip(range(nblk), (stage_a, stage_b)))
      for b, kb_s in tiles:
        key_tile(b, kb_s)
      plgpu.commit_smem()
      for b, kb_s in tiles:
        acc = add_block(b, kb_s, acc)
      plgpu.commit_smem()  # every warp's products have read the key tiles (and qt_s, kd_s)
    else:
      # Three 16-row blocks as a loop, not unrolled: the code stays small enough that every executable of it
      # runs at the same speed (README.md, "Code size").
      def key_block(b, acc):
        key_tile(b, stage_a)
        plgpu.commit_smem()
        acc = add_block(b, stage_a, acc)
        plgpu.commit_smem()  # every warp's products have read the key tile before the next one overwrites it
        return acc

      acc = lax.fori_loop(1, nblk, key_block, acc)
    aqk_acc, l_acc = acc
    aqk_s[...] = jnp.where(c64 <= r64, aqk_acc, 0.0).astype(bf16)
    lmat = jnp.where(c64 < r64, l_acc, 0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(aqk_s, aqk_ref.at[c, h])

    # (I + L)^-1 by recursive block doubling. P_s is block diagonal (s-blocks), so P_s F_s, with F_s the
    # s-blocks of L below the diagonal inside each 2s-block, is P_s L masked to those blocks: the terms it adds
    # are exact zeros. L goes to SMEM once. On the GPU the A operands P_s and X come from registers; interpret
    # mode takes them from SMEM (it runs every wgmma operand from there).
    phases.start("inverse")
    f_s[...] = lmat.astype(bf16)
    p = jnp.where(c64 == r64, 1.0, 0.0) - jnp.where((r64 // 2 == c64 // 2), lmat, 0.0)

    def a_operand(x16, buf):
      """``x16`` as a wgmma A operand: itself (registers), or stored to ``buf`` for interpret mode."""
      if not smem_operands:
        return x16
      buf[...] = x16
      plgpu.commit_smem()
      return buf

    s = 2
    while s < C:
      p16 = p.astype(bf16)
      if s > 2:
        plgpu.commit_smem()  # every warp's last product has read p_s (each warp's tensor core reads B itself)
      p_s[...] = p16
      plgpu.commit_smem()
      mask = (r64 // (2 * s) == c64 // (2 * s)) & (r64 // s != c64 // s)
      x16 = jnp.where(mask, matmul([(p_s if smem_operands else p16, f_s)], (C, C)), 0.0).astype(bf16)
      p = p - matmul([(a_operand(x16, x_s), p_s)], (C, C))
      s *= 2
    p_op = a_operand(p.astype(bf16), p_s)

    phases.start("w_u")
    u = matmul([(p_op, bv_s)], (C, V))
    plgpu.commit_smem()  # every warp's U product has read bv_s: it takes U in place
    bv_s[...] = u.astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(bv_s, u_ref.at[c, h])

    # W = P (βK 2^G) from Kd = βK 2^(G - ν_b) one key block at a time: the block's columns of P times Kd, times
    # 2^ν_b per column (README.md, "W from Kd"). A separate βK 2^G tile for W would take the SMEM that keeps two
    # programs per SM in the 196 KiB configuration (see prep).
    def w_block(b, w):
      if smem_operands:
        plgpu.commit_smem()  # the previous block's product has read x_s
      p_b = jnp.where(c64 // blk_rows == b, p, 0.0).astype(bf16)
      w_b = matmul([(a_operand(p_b, x_s), kd_s)], (C, K))
      nu_b = plgpu.load(anchors_s.at[b], layout=COLV, optimized=False)
      parts = w_scale_parts(b, lower_bound)
      part = bcast_cols(jnp.exp2(nu_b * (1.0 / parts)), (C, K))
      for _ in range(parts):
        w_b = w_b * part
      return w + w_b

    w = plgpu.layout_cast(jnp.zeros((C, K), f32), WG)
    if bounded:
      for b in range(nblk):
        w = w_block(b, w)
    else:
      w = lax.fori_loop(0, nblk, w_block, w)  # four 16-row blocks: a loop, as the key blocks (README.md)
    plgpu.commit_smem()  # every warp's W products have read Kd: it takes -W in place
    kd_s[...] = (-w).astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(kd_s, neg_w_ref.at[c, h])
    phases.start("store_wait")
    util.finish_stores()
    phases.end()


def prep(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_p: jax.Array, A_log: jax.Array,
         dt_bias: jax.Array, table: jax.Array, *, scale: float, lower_bound: float | None,
         smem_operands: bool) -> tuple[jax.Array, ...]:
  """Stage 1 over ``S = table.shape[1]`` chunk slots (slots without rows are skipped).

  Args:
    q, k: ``[T, H, K]`` raw, 16-bit. v: ``[T, H, V]`` 16-bit. g_raw: ``[T, H, K]``.
    beta_p: ``[T + C, H]`` f32, raw β padded by C rows (a chunk's column is read at once, past T too).
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32.
    table: ``[R, S]`` int32 whose last two rows are each chunk slot's first token and valid rows (0..64); the
      rows before them are not read (the call's one index table: ``prefill_kernel.index_table``).
    smem_operands: every wgmma operand from SMEM (interpret mode needs that); False takes the A operands of
      the inverse and of W/U from registers (the GPU).

  Returns:
    ``qg [S, H, C, K]``, ``kg [S, H, C, K]``, ``neg_w [S, H, C, K]``, ``u [S, H, C, V]``, ``aqk [S, H, C, C]``
    (bf16) and ``chunk_decay [S, H, K]`` f32, as described in README.md.
  """
  T, H, K = q.shape
  V = v.shape[-1]
  S = table.shape[1]
  bounded = lower_bound is not None
  out_type = (jax.ShapeDtypeStruct((S, H, C, K), bf16), jax.ShapeDtypeStruct((S, H, C, K), bf16),
              jax.ShapeDtypeStruct((S, H, C, K), bf16), jax.ShapeDtypeStruct((S, H, C, V), bf16),
              jax.ShapeDtypeStruct((S, H, C, C), bf16), jax.ShapeDtypeStruct((S, H, K), f32))
  parts = 2 if bounded else 3
  # Raw rows land untiled (their token offset is not a multiple of 8), then a tile (and for q two C x C buffers).
  x_q = plgpu.RefUnion(plgpu.SMEM((C, K), q.dtype), tiled((C, K)), (tiled((C, C)), tiled((C, C))))
  x_k = plgpu.RefUnion(plgpu.SMEM((C, K), k.dtype), tiled((C, K)))  # Kd lives until W
  x_v = plgpu.RefUnion(plgpu.SMEM((C, V), v.dtype), tiled((C, V)))
  # G rows and (pairwise diagonal only) k rows in one allocation: the row-vector reads of G pin it to a plain
  # row-major layout; a separate k buffer would get a swizzled tiling from layout inference, which the
  # row-shifted reads (offsets not a multiple of the tile) do not survive on the GPU.
  ph_diag = plgpu.SMEM((1 if bounded else 2, SUB + C, K), f32)
  y = plgpu.RefUnion(plgpu.SMEM((C, K), g_raw.dtype), ([tiled((C, K)) for _ in range(parts)], tiled((C, C))),
                     ph_diag, (tiled((C, K)), tiled((C, K))), (tiled((C, C)), tiled((C, C))))
  scratch = [x_q, x_k, x_v, y, plgpu.SMEM((NSUB, K), f32),
             plgpu.Barrier(num_arrivals=1, num_barriers=1), plgpu.Barrier(num_arrivals=3, num_barriers=1)]
  body = functools.partial(_prep_body, K=K, V=V, scale=scale, lower_bound=lower_bound,
                           smem_operands=smem_operands)
  # No warpgroup barrier around every SMEM store (Pallas's default, two per store): the body synchronises its
  # warps itself, with a commit_smem (a fence and a warpgroup barrier) wherever a store's memory was read by
  # other warps (their loads or their wgmmas) or is read by them next, and the TMA store waits end in one too.
  return plgpu.kernel(body, out_type=out_type, grid=(S, H), grid_names=("c", "h"), scratch_types=scratch,
                      kernel_name="kda_prefill_prep",
                      compiler_params=util.compiler_params(approx_math=True, unsafe_no_auto_barriers=True))(
      table, q, k, v, g_raw, beta_p, A_log, dt_bias)

"""KDA prefill, stage 1 (chunk-parallel): everything that needs only one 64-token chunk of one head.

One program per (chunk slot, head), one warpgroup. From the raw inputs of the chunk it computes the gate,
the chunk-local cumulative gate ``G`` (log2 units), the L2 norms, β, the intra-chunk matrices ``Aqk`` and
``L`` (``kda.md`` §4.1), ``A = (I + L)^-1`` and writes, per chunk and head, to chunk-padded workspaces:

* ``qg = scale · q̂ ⊙ 2^G`` and ``kg = k̂ ⊙ 2^(G_last − G)``  (``[C, K]`` bf16),
* ``wn = −A (β k̂ ⊙ 2^G)`` (``[C, K]``) and ``u = A (β v)`` (``[C, V]``) bf16,
* ``aqk`` (``[C, C]`` bf16, causal incl. the diagonal, scale folded in), ``gam = 2^G_last`` (``[K]`` f32).

Safe anchoring (``kda.md`` §4.3): 2^(G_r − G_j) is factored per 16-row query block b around an anchor row
of that block, ``2^(G_r − ν_b) · 2^(ν_b − G_j)``. With the lower-bound gate the anchor is the block
midpoint (every factor within ±8 tokens, |exponent| <= 8·5·log2 e ≈ 58) and the diagonal blocks use it too;
with the unbounded softplus gate the anchor is the block's first row (factors <= 1 for the off-diagonal
blocks) and the diagonal blocks are computed pairwise on CUDA cores. Keys past the block are masked to an
exponent of −inf before ``exp2``, so no factor ever overflows.

``A`` comes from recursive block doubling: with ``P_s`` the inverse of the block-diagonal part of
``I + L`` at block size s, ``P_2s = P_s − (P_s F_s) P_s`` where ``F_s`` holds the sub-diagonal s-blocks of
L inside each 2s-block (``(P_s F_s)² = 0``), i.e. exact block forward substitution in five levels of
64×64 matmuls, with no power series (whose intermediate powers cancel catastrophically).

The cumulative sum over tokens is a matmul with a lower-triangular ones matrix; to keep it at f32 accuracy
the gate is split into three bf16 parts (``g = g1 + g2 + g3`` exactly to 24 bits) and the three products
accumulate in f32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.kernel_math import L2NORM_EPS, gate

C = 64  # chunk
SUB = 16  # sub-block of the safe anchoring
NSUB = C // SUB
LOG2E = 1.4426950408889634

WG = plgpu.Layout.WGMMA
ROWV = WG.reduce(1)  # one value per row, broadcast along columns
COLV = WG.reduce(0)  # one value per column, broadcast along rows
f32, bf16 = jnp.float32, jnp.bfloat16


def tiled(shape: tuple[int, ...], dtype=bf16) -> plgpu.SMEM:
  """SMEM buffer in the wgmma operand form (8×64 tiles, 128-byte swizzle)."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WG)


def bcast_rows(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """[M] per-row vector -> [M, N]."""
  return lax.broadcast_in_dim(vec, shape, [0])


def bcast_cols(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """[N] per-column vector -> [M, N]."""
  return lax.broadcast_in_dim(vec, shape, [1])


def matmul(pairs, shape: tuple[int, int]) -> jax.Array:
  """Sum of ``a @ b`` over SMEM operand pairs, one f32 wgmma accumulator, returned in registers."""

  def body(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, b)
    return acc[...]

  return pl.run_scoped(body, plgpu.ACC(shape, f32))


def per_block(vecs: list[jax.Array], blk: jax.Array) -> jax.Array:
  """Row r takes column-vector ``vecs[r // 16]``: [NSUB] x [K] -> [C, K]."""
  out = bcast_cols(vecs[-1], blk.shape)
  for b in range(len(vecs) - 2, -1, -1):
    out = jnp.where(blk == b, bcast_cols(vecs[b], blk.shape), out)
  return out


def load_rows(ref, dtype=f32) -> jax.Array:
  return plgpu.load(ref, layout=WG, optimized=False).astype(dtype)


def load_l2norm(ref, valid: jax.Array) -> jax.Array:
  """Row-wise L2 normalisation (eps 1e-6 inside the sqrt of the sum), rows past the chunk zeroed."""
  x = load_rows(ref)
  inv = lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS)
  return jnp.where(valid, x * bcast_rows(inv, x.shape), 0.0)


def split3(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Three bf16 parts whose f32 sum is ``x`` to 24 bits."""
  x1 = x.astype(bf16)
  r1 = x - x1.astype(f32)
  x2 = r1.astype(bf16)
  x3 = (r1 - x2.astype(f32)).astype(bf16)
  return x1, x2, x3


def _prep_body(tok_ref, len_ref, q_ref, k_ref, v_ref, g_ref, b_ref, alog_ref, dtb_ref,
               qg_ref, kg_ref, wn_ref, u_ref, aqk_ref, gam_ref,
               raw_q, raw_k, raw_v, bk_s, bv_s, qg_s, kg_s, uni, bar_g, bar_qkv, *,
               K: int, V: int, scale: float, lower_bound: float | None):
  bounded = lower_bound is not None
  ph_gate, ph_diag, ph_tiles, ph_inv = uni
  c = lax.axis_index("c")
  h = lax.axis_index("h")
  t0 = tok_ref[c]
  n = len_ref[c]

  @pl.when(n > 0)
  def _():
    raw_g, gsplit, tril = ph_gate
    plgpu.copy_gmem_to_smem(g_ref.at[pl.ds(t0, C), h], raw_g, bar_g.at[0])
    for src, dst in ((q_ref, raw_q), (k_ref, raw_k), (v_ref, raw_v)):
      plgpu.copy_gmem_to_smem(src.at[pl.ds(t0, C), h], dst, bar_qkv.at[0])

    r_cc, c_cc = iota((C, C), 0), iota((C, C), 1)
    tril[...] = jnp.where(c_cc <= r_cc, 1.0, 0.0).astype(bf16)
    row = iota((C, K), 0)
    valid = row < n
    blk = row // SUB
    a = jnp.exp(alog_ref[h])
    dtb = plgpu.load(dtb_ref.at[h], layout=COLV, optimized=False)
    beta_raw = plgpu.load(b_ref.at[h, pl.ds(t0, C)], layout=ROWV, optimized=False)
    beta = 1.0 / (1.0 + jnp.exp(-beta_raw))

    # Gate and its chunk-local cumulative sum (log2 units), rows past the chunk contribute 0.
    plgpu.barrier_wait(bar_g.at[0])
    g = gate(load_rows(raw_g) + bcast_cols(dtb, (C, K)), a, lower_bound)
    g = jnp.where(valid, g * LOG2E, 0.0)
    for dst, part in zip(gsplit, split3(g)):
      dst[...] = part
    plgpu.commit_smem()
    G = matmul([(tril, part) for part in gsplit], (C, K))

    # Anchor rows (and the last row) of G, as per-column vectors.
    g_pad, k_pad = ph_diag
    g_pad[pl.ds(SUB, C), :] = G
    plgpu.commit_smem()
    off = SUB // 2 if bounded else 0
    nu = [plgpu.load(g_pad.at[SUB + b * SUB + off], layout=COLV, optimized=False) for b in range(NSUB)]
    g_last = plgpu.load(g_pad.at[SUB + C - 1], layout=COLV, optimized=False)
    nu_row = per_block(nu, blk)

    plgpu.barrier_wait(bar_qkv.at[0])
    q = load_l2norm(raw_q, valid) * scale
    k = load_l2norm(raw_k, valid)
    beta_ck = jnp.where(valid, bcast_rows(beta, (C, K)), 0.0)

    r64, c64 = iota((C, C), 0), iota((C, C), 1)
    if not bounded:
      # Diagonal 16x16 blocks pairwise: A[r, r-d] from row-shifted copies of k and G (zero rows on top).
      zeros = jnp.zeros((SUB, K), f32)
      k_pad[pl.ds(0, SUB), :] = zeros
      g_pad[pl.ds(0, SUB), :] = zeros
      k_pad[pl.ds(SUB, C), :] = k
      plgpu.commit_smem()

      def diag_step(d, carry):
        aqk_d, l_d = carry
        k_j = plgpu.load(k_pad.at[pl.ds(SUB - d, C)], layout=WG, optimized=False)
        g_j = plgpu.load(g_pad.at[pl.ds(SUB - d, C)], layout=WG, optimized=False)
        kdec = k_j * jnp.exp2(G - g_j)
        hit = (c64 == r64 - d) & (r64 - d >= (r64 // SUB) * SUB)
        aqk_d = jnp.where(hit, bcast_rows(jnp.sum(q * kdec, axis=1), (C, C)), aqk_d)
        l_d = jnp.where(hit, bcast_rows(jnp.sum(k * kdec, axis=1), (C, C)), l_d)
        return aqk_d, l_d

      zero_cc = jnp.zeros((C, C), f32)
      aqk_acc, l_acc = lax.fori_loop(0, SUB, diag_step, (zero_cc, zero_cc))
    else:
      aqk_acc = l_acc = jnp.zeros((C, C), f32)

    # Tiles. d_row = 2^(G - ν_row): the per-row anchored decay, shared by the query and key sides.
    qt_s, kd_s, kb_s = ph_tiles
    plgpu.commit_smem()  # every G-row / shifted-row read above is done before the aliased tiles are written
    d_row = jnp.exp2(G - nu_row)
    if bounded:
      # Bounded exponents everywhere: derive every factor from d_row, its inverse and per-block vectors.
      kr = k * jnp.exp2(nu_row - G)  # k ⊙ 2^(ν_row − G), |exponent| <= 58
      pw = [jnp.exp2(x) for x in nu]  # 2^ν_b <= 1
      gamma_row = d_row * per_block(pw, blk)  # 2^G
      kg = kr * per_block([jnp.exp2(g_last - x) for x in nu], blk)
      for b in range(NSUB):
        delta = per_block([jnp.exp2(nu[b] - x) for x in nu[:b + 1]], blk)  # rows past block b masked below
        kb_s[b][...] = jnp.where(blk <= b, kr * delta, 0.0).astype(bf16)
    else:
      gamma_row = jnp.exp2(G)
      kg = k * jnp.exp2(bcast_cols(g_last, (C, K)) - G)
      for b in range(1, NSUB):
        ex = jnp.where(row < b * SUB, bcast_cols(nu[b], (C, K)) - G, -jnp.inf)
        kb_s[b][...] = (k * jnp.exp2(ex)).astype(bf16)
    qt_s[...] = (q * d_row).astype(bf16)
    kd_s[...] = (k * d_row).astype(bf16)
    qg_s[...] = (q * gamma_row).astype(bf16)
    kg_s[...] = kg.astype(bf16)
    bk_s[...] = (beta_ck * k * gamma_row).astype(bf16)
    beta_cv = jnp.where(iota((C, V), 0) < n, bcast_rows(beta, (C, V)), 0.0)
    bv_s[...] = (beta_cv * load_rows(raw_v)).astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qg_s, qg_ref.at[c, h])
    plgpu.copy_smem_to_gmem(kg_s, kg_ref.at[c, h])
    gam_ref[c, h] = jnp.exp2(g_last)

    # Off-diagonal (and, bounded, diagonal) blocks: block row b uses the keys of kb_s[b].
    blk_cc = r64 // SUB
    for b in range(0 if bounded else 1, NSUB):
      aqk_b = matmul([(qt_s, kb_s[b].T)], (C, C))
      l_b = matmul([(kd_s, kb_s[b].T)], (C, C))
      aqk_acc = jnp.where(blk_cc == b, aqk_b + aqk_acc, aqk_acc)
      l_acc = jnp.where(blk_cc == b, l_b + l_acc, l_acc)
    beta_cc = bcast_rows(beta, (C, C))
    aqk = jnp.where(c64 <= r64, aqk_acc, 0.0)
    lmat = jnp.where(c64 < r64, beta_cc * l_acc, 0.0)

    # (I + L)^-1 by recursive block doubling.
    p_s, f_s, x_s, aqk_s, wn_s, u_s = ph_inv
    aqk_s[...] = aqk.astype(bf16)
    eye = jnp.where(c64 == r64, 1.0, 0.0)
    p = eye - jnp.where((r64 // 2 == c64 // 2), lmat, 0.0)
    s = 2
    while s < C:
      f_s[...] = jnp.where((r64 // (2 * s) == c64 // (2 * s)) & (r64 // s != c64 // s), lmat, 0.0).astype(bf16)
      p_s[...] = p.astype(bf16)
      plgpu.commit_smem()
      x_s[...] = matmul([(p_s, f_s)], (C, C)).astype(bf16)
      plgpu.commit_smem()
      p = p - matmul([(x_s, p_s)], (C, C))
      s *= 2
    p_s[...] = p.astype(bf16)
    plgpu.commit_smem()
    wn_s[...] = (-matmul([(p_s, bk_s)], (C, K))).astype(bf16)
    u_s[...] = matmul([(p_s, bv_s)], (C, V)).astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(aqk_s, aqk_ref.at[c, h])
    plgpu.copy_smem_to_gmem(wn_s, wn_ref.at[c, h])
    plgpu.copy_smem_to_gmem(u_s, u_ref.at[c, h])
    plgpu.wait_smem_to_gmem(0)


def prep(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_t: jax.Array, A_log: jax.Array,
         dt_bias: jax.Array, chunk_tok: jax.Array, chunk_len: jax.Array, *, scale: float,
         lower_bound: float | None) -> tuple[jax.Array, ...]:
  """Stage 1 over ``S = chunk_tok.shape[0]`` chunk slots (slots with ``chunk_len == 0`` are skipped).

  Args:
    q, k: ``[T, H, K]`` raw, 16-bit. v: ``[T, H, V]`` 16-bit. g_raw: ``[T, H, K]``.
    beta_t: ``[H, T + C]`` f32, raw β transposed and padded by C columns (read a chunk at a time).
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32.
    chunk_tok: ``[S]`` int32 first token of each chunk slot. chunk_len: ``[S]`` int32 valid rows (0..64).

  Returns:
    ``qg [S, H, C, K]``, ``kg [S, H, C, K]``, ``wn [S, H, C, K]``, ``u [S, H, C, V]``, ``aqk [S, H, C, C]``
    (bf16) and ``gam [S, H, K]`` f32, as described in the module docstring.
  """
  T, H, K = q.shape
  V = v.shape[-1]
  S = chunk_tok.shape[0]
  bounded = lower_bound is not None
  out_type = (jax.ShapeDtypeStruct((S, H, C, K), bf16), jax.ShapeDtypeStruct((S, H, C, K), bf16),
              jax.ShapeDtypeStruct((S, H, C, K), bf16), jax.ShapeDtypeStruct((S, H, C, V), bf16),
              jax.ShapeDtypeStruct((S, H, C, C), bf16), jax.ShapeDtypeStruct((S, H, K), f32))
  ph_gate = (plgpu.SMEM((C, K), g_raw.dtype), [tiled((C, K)) for _ in range(3)], tiled((C, C)))
  ph_diag = (plgpu.SMEM((SUB + C, K), f32), plgpu.SMEM((SUB + C, K), f32) if not bounded else None)
  ph_tiles = (tiled((C, K)), tiled((C, K)), [tiled((C, K)) for _ in range(NSUB)])
  ph_inv = (tiled((C, C)), tiled((C, C)), tiled((C, C)), tiled((C, C)), tiled((C, K)), tiled((C, V)))
  scratch = [
      plgpu.SMEM((C, K), q.dtype), plgpu.SMEM((C, K), k.dtype), plgpu.SMEM((C, V), v.dtype),
      tiled((C, K)), tiled((C, V)), tiled((C, K)), tiled((C, K)),
      # Gate/cumsum -> G rows (and the pairwise diagonal) -> tiles and Aqk/L -> inverse and W/U: the four
      # phases have disjoint lifetimes (each is separated from the next by a warpgroup barrier).
      plgpu.RefUnion(ph_gate, ph_diag, ph_tiles, ph_inv),
      plgpu.Barrier(num_arrivals=1, num_barriers=1), plgpu.Barrier(num_arrivals=3, num_barriers=1),
  ]
  body = functools.partial(_prep_body, K=K, V=V, scale=scale, lower_bound=lower_bound)
  return plgpu.kernel(body, out_type=out_type, grid=(S, H), grid_names=("c", "h"), scratch_types=scratch)(
      chunk_tok, chunk_len, q, k, v, g_raw, beta_t, A_log, dt_bias)

"""Split-K absorbed MLA decode as a Pallas Mosaic GPU kernel (Hopper).

One program per (split, sequence, 64-row head tile), head tiles fastest, or with ``narrow`` per (split,
sequence) for all heads with the products transposed (the heads as the MMA's N); a memory warpgroup streams
the sequence's pages by TMA into a two-slot ring that two compute warpgroups share (QK and the softmax on one,
``P @ V`` split by output columns over both). An fp8 cache (``cache_format``) is read on chip: with 64-row
tiles the compute warpgroups dequantise each page into one bf16 tile; in the narrow kernel the memory warpgroup
(and for each page's last piece the follower) converts it to f16 unscaled into the ring (e4m3 -> f16 is exact
and one instruction per two values), q is taken in f16 (a q beyond f16's 65,504 gives inf, so NaN outputs), and
the leader applies the per-token scales to the logits and to P. By default (``registers``) the narrow kernel
keeps the fp8 page as it lands instead: the leader runs QK on its e4m3 values (q split into two e4m3 parts) and
the softmax, and the follower runs all of ``P @ V`` on V's e4m3 bytes in registers beside the leader's next page,
so no f16 copy of the page is written or read. See README.md for the derivation, the NaN rules, the fp8
pages and the SMEM budget.
"""

import functools
import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.mlir import ir
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels import mosaic_interpret, util
from pallas_kernels.mla import cache_format
from pallas_kernels.mla.config import HEAD_TILE, LATENT_DIM, PAGE_SIZE, ROPE_DIM
from pallas_kernels.mla.reference import balanced_split_width, pages_per_split

DIM = LATENT_DIM + ROPE_DIM
COLS = LATENT_DIM // 2  # output columns per compute warpgroup
STAGES = 2  # KV ring slots: a third [64, 576] tile would exceed the 227 KiB of SMEM
COMPUTE_WGS = 2
NARROW_MAX_HEADS = 32  # the narrow kernel's heads: at 64 its SMEM (q, ring, reduction scratch) would not fit
FP8_NARROW_MAX_HEADS = 16  # with an fp8 cache: its staging ring for the fp8 pieces fits beside q up to 16 heads
LOG2E = util.LOG2E
LN2 = math.log(2.0)
INIT_MAX = -1e30  # finite: exp2(INIT_MAX - m) is 0 and never (-inf) - (-inf)
# fp8 cache (cache_format): the values of a page land in an fp8 ring slot, its rows' scales as f32 words (8 words
# from word 144 of each 160-word row: the scales are its columns 0 and 1). With 64-row tiles both compute
# warpgroups dequantise the slot into one bf16 tile, 64 columns at a time (latent chunks 0-7, rope 8).
FP8_CHUNK = 64
FP8_TILE_COLS = 64  # divides the 640-byte rows of the source; 64-byte swizzled tiles
FP8_CHUNKS = (tuple(range(5)), tuple(range(5, DIM // FP8_CHUNK)))
ROW_WORDS = cache_format.row_width(DIM, cache_format.FP8) // 4
SCALE_WORDS = 8
SCALE_WORD0 = DIM // 4  # the words right after the values
SCALE_COLS = (0, 1)
TOKEN_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a per-token vector of a [64, *] page tile
# fp8 cache, narrow kernel: each page is loaded as three column pieces (three 64-column chunks each) and each
# piece is converted into the page's f16 ring slot as soon as it lands. The memory warpgroup converts the first
# MEM_PIECES of every page through a MEM_SLOTS-slot staging ring (so about three pieces are in flight while it
# converts); the follower, idle while the leader computes QK and the softmax, converts the last piece of the next
# page through a staging slot of its own.
PIECE_CHUNKS = 3
PIECE_COLS = PIECE_CHUNKS * FP8_CHUNK
PIECES = DIM // PIECE_COLS
MEM_PIECES = PIECES - 1
MEM_SLOTS = 3
PIECE_SLOTS = MEM_SLOTS + 1  # the last one: the follower's
# The converter's register layout: 4 consecutive values of a row per thread, so a 4-byte load per 4 fp8 values
# and an 8-byte store per 4 f16 values (the WGMMA layout moves 2 values per load and per store).
CONVERT_LAYOUT = plgpu.Layout.WGMMA_UPCAST_2X
# fp8 pages in registers (narrow, the default there): four fp8 slots of [64, 576] fit where two f16 ones did, so
# four pages are in flight. q goes in as two e4m3 parts, q = s_q (q_hi + q_lo / Q_LO_FACTOR) per head: |q / s_q| <=
# 448 leaves a remainder of at most 448 / 16, so q_lo = e4m3(remainder * 16) stays in range and the pair carries
# about 8 bits of each element, near bf16's.
REG_STAGES = 4
LATENT_SWIZZLE = 128  # bytes: ``registers``' latent slots (``_partials``)
# ``registers``: the leader runs QK and the softmax only and the follower all of ``P @ V``, so that the two run side by
# side; P and alpha go through HANDOFFS buffers, so the leader's next page need not wait for the follower's products.
HANDOFFS = 2
Q_LO_FACTOR = 16.0
# An e4m3 wgmma does not keep an f32 running sum: each product is added at the sum's exponent to about 14 bits,
# the low bits truncated (DeepSeek-V3's report; that model reproduces a peaky logit's error on the GPU), so the
# error grows with the sum a chain of products adds onto. QK adds the latent columns' products in QK_CHUNK columns
# per accumulator (4 wgmma steps of 32) and those in f32, as that report's kernels promote every 128.
QK_CHUNK = 128
# ``P @ V`` runs on e4m3 operands, 32 tokens a wgmma step (twice an f16 step's 16): V^T from the fp8 slot in
# registers, P^T from SMEM as two e4m3 parts, P = (p_hi + p_lo / Q_LO_FACTOR) / P_SCALE, the N of 2 x heads. A
# transposed 16-bit load of the slot's uint16 pairs (the only transposed load sm_90 has: none for 8 bits) puts, for
# a row of V^T's column pairs, tokens 2q and 2q + 1 in one register of thread q and tokens 2q + 8 and 2q + 9 in
# another (bytes: t even, t odd, t + 1 even, t + 1 odd). A byte permute of the two by these prmt.b32 selectors (the
# lowest digit first) gives the even and the odd column's e4m3 register of the 8-bit A layout, whose thread q holds
# k = 4q .. 4q + 3: tokens 2q, 2q + 8, 2q + 1, 2q + 9. So the k-th of every 16 products takes token
# ``p_token(k)``, and the leader stores P^T's columns in that order (``store_p_e4m3``).
EVEN_BYTES = 0x6240
ODD_BYTES = 0x7351
# P's weights (at most 1) times 256: the smallest weights that matter stay clear of e4m3's subnormals.
P_SCALE = 256.0
LO_FACTOR_PTX = "0f" + struct.pack(">f", Q_LO_FACTOR).hex().upper()  # PTX's f32 literal
# P^T's buffers (and interpret mode's V^T operands): rows of a page's 64 tokens, 64 bytes in e4m3.
P_TRANSFORMS = (plgpu.TilingTransform((8, PAGE_SIZE)), plgpu.SwizzleTransform(PAGE_SIZE))


def narrow_applies(num_heads: int, cache_dtype) -> bool:
  """Whether the narrow kernel takes this call: at most ``NARROW_MAX_HEADS`` heads with a bf16 cache, at most
  ``FP8_NARROW_MAX_HEADS`` with an fp8 one."""
  if cache_format.is_fp8(cache_dtype):
    return num_heads <= FP8_NARROW_MAX_HEADS
  return num_heads <= NARROW_MAX_HEADS and jnp.dtype(cache_dtype) == jnp.bfloat16


def split_e4m3(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q ``[B, R, 576]`` as two e4m3 parts and each row's largest magnitude: ``[B, 2 R, 576]`` (the R ``q_hi`` rows,
  then the R ``q_lo`` rows) and ``amax [B, R]`` f32, with ``q = s_q * (q_hi + q_lo / Q_LO_FACTOR)`` to ``2^-8 |q| +
  2^-14 s_q`` per element (e4m3's 2^-4 twice, or its subnormal spacing), ``s_q = cache_format.amax_scale(amax)``
  (which the kernel derives itself: an ``s_q`` array would cost an XLA kernel of its own). A row with a NaN or inf
  has a non-finite ``s_q`` (NaN parts), so its logits are NaN; an all-zero row gets ``s_q = 1``."""
  x = q.astype(jnp.float32)
  amax = cache_format.row_amax(x)
  x = x / cache_format.amax_scale(amax)  # the cache rows' own scale rule
  # The parts' values in f32, rounded to e4m3 by integer operations: XLA's GPU compiler, at its default (excess
  # precision allowed), folds an f32 -> e4m3 -> f32 round trip into the f32 value itself, which would leave q_lo
  # only what the clip cut (q about e4m3's 3 bits). The conversions below are exact.
  return jnp.concatenate(e4m3_parts(x), axis=1).astype(cache_format.FP8), amax[..., 0]


def round_to_e4m3(x: jax.Array) -> jax.Array:
  """f32 ``x`` (finite values within e4m3's +-448, or NaN) rounded to the nearest e4m3 value, ties to even, as
  f32: 3 of f32's 23 mantissa bits at e4m3's normal exponents (from 2^-6), multiples of 2^-9 below (its
  subnormals). NaN stays NaN."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  keep = bits + jnp.uint32(0x7FFFF) + ((bits >> 20) & jnp.uint32(1))  # round the low 20 bits, ties to even
  normal = lax.bitcast_convert_type(keep & jnp.uint32(0xFFF00000), jnp.float32)
  subnormal = jnp.round(x * 2.0 ** 9) * 2.0 ** -9  # exact scalings; jnp.round takes ties to even
  return jnp.where(jnp.isnan(x), x, jnp.where(jnp.abs(x) < 2.0 ** -6, subnormal, normal))


def p_token(k: int) -> int:
  """The token whose product the k-th K position of ``P @ V``'s e4m3 steps takes (``EVEN_BYTES``): within each 16,
  k = 4q + j holds token 2q + 8 (j % 2) + j // 2."""
  q, j = divmod(k % 16, 4)
  return k - k % 16 + 2 * q + 8 * (j % 2) + j // 2


def e4m3_pair_bytes(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint16 words of two e4m3 bytes each as two e4m3 arrays of the same shape, the low bytes' and the high
  bytes' (the even and the odd column's), tokens in order. Interpret mode's form of ``e4m3_pair_operands``."""
  return tuple(lax.bitcast_convert_type(byte.astype(jnp.uint8), cache_format.FP8)
               for byte in (x & jnp.uint16(0xFF), x >> jnp.uint16(8)))


def e4m3_pair_operands(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """WGMMA-layout uint16 pairs ``[M, K]`` (rows: column pairs, K: tokens) as the even and the odd columns' e4m3
  ``[M, K]`` wgmma operands in the 8-bit A layout, the tokens of every 16 in ``p_token``'s order: per register of
  the result one byte permute of the two registers that hold its tokens."""
  out = plgpu.ShapeDtypeStruct(x.shape, cache_format.FP8, layout=plgpu.Layout.WGMMA_8BIT)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(out, out))
  def convert(_, words):
    i32 = ir.IntegerType.get_signless(32)
    f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
    shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape(words.shape)
    halves = (np.empty(shape, object), np.empty(shape, object))
    for idx in np.ndindex(*shape):
      # The 16-bit layout's registers of the same rows: axis 1 counts 8 tokens there, 16 here.
      first, second = (mgpu_utils.bitcast(words.registers[idx[:1] + (2 * idx[1] + h,) + idx[2:]], i32)
                       for h in (0, 1))
      for half, selector in zip(halves, (EVEN_BYTES, ODD_BYTES)):
        word = mgpu_utils.inline_ptx(f"prmt.b32 $0, $1, $2, {selector:#x};", first, second, result_types=i32)
        half[idx] = mgpu_utils.bitcast(word, f8x4)
    return tuple(mgpu.FragmentedArray(_registers=h, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)
                 for h in halves)

  return convert(x)


def e4m3_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """f32 ``x`` as its two e4m3 parts' values in f32, ``x = hi + lo / Q_LO_FACTOR`` to about 2^-8 of x (round to
  nearest even, saturating; NaN stays NaN): q's parts (``split_e4m3``, of ``q / s_q``) and P's (``P * P_SCALE``;
  interpret mode's form of ``store_p_e4m3``'s conversions)."""
  hi = round_to_e4m3(jnp.clip(x, -cache_format.FP8_MAX, cache_format.FP8_MAX))
  lo = (x - hi) * Q_LO_FACTOR
  return hi, round_to_e4m3(jnp.clip(lo, -cache_format.FP8_MAX, cache_format.FP8_MAX))


def store_p_e4m3(x: jax.Array, ref) -> None:
  """The leader's ``x = P * P_SCALE`` (f32 ``[64 tokens, R]``, WGMMA layout) into ``ref`` (e4m3 ``[2 R, 64]``, tiled
  ``P_TRANSFORMS``): P^T's ``p_hi`` rows, then its ``p_lo`` rows (``e4m3_parts``, by ``cvt.rn.satfinite``), token
  ``p_token(k)`` in column k. Thread q of row group r of warp w holds tokens t = 16 w + r and t + 8 (the layout's
  two row halves): ``p_token`` puts them side by side at k = 16 w + 2 r, so one 16-bit store per head and part.
  In the tiled, 64-byte-swizzled buffer head row n = 8 g + 2 q + i sits at byte 512 g + 64 (2 q + i), and its
  16-byte chunk w at chunk w ^ q (the swizzle XORs the chunk with the row's bits 1-2: q)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(transforms=P_TRANSFORMS)))
  def store(_, values, dst):
    i32 = ir.IntegerType.get_signless(32)
    tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
    lane = arith.remui(tid, mgpu_utils.c(32, i32))
    warp, row, q = (arith.divui(tid, mgpu_utils.c(32, i32)), arith.divui(lane, mgpu_utils.c(4, i32)),
                    arith.remui(lane, mgpu_utils.c(4, i32)))
    base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(dst))
    chunk = arith.shli(arith.xori(warp, q), mgpu_utils.c(4, i32))
    thread = arith.addi(arith.addi(arith.muli(q, mgpu_utils.c(128, i32)), chunk),
                        arith.muli(row, mgpu_utils.c(2, i32)))
    base = arith.addi(base, thread)
    lo_rows = values.shape[1] // 8 * 512  # the p_lo rows' first tile
    regs = values.registers  # [1, R / 8, 1, 1, 2 (row halves), ...] of (head 2q, head 2q + 1) f32 pairs
    for g in range(regs.shape[1]):
      first, second = (regs[(0, g, 0, 0, h) + (0,) * (regs.ndim - 5)] for h in (0, 1))
      for i in range(2):
        a, b = (vector.extract(v, [], [i]) for v in (first, second))
        # cvt.rn.satfinite.e4m3x2.f32 d, hi_src, lo_src: the second source in the low byte (token t).
        mgpu_utils.inline_ptx(
            "{\n.reg .b16 p_hi, p_lo;\n.reg .b32 p_f16;\n.reg .f16 h0, h1;\n.reg .f32 f0, f1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 p_hi, $2, $1;\ncvt.rn.f16x2.e4m3x2 p_f16, p_hi;\n"
            "mov.b32 {h0, h1}, p_f16;\ncvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\n"
            f"sub.f32 f0, $1, f0;\nsub.f32 f1, $2, f1;\nmul.f32 f0, f0, {LO_FACTOR_PTX};\n"
            f"mul.f32 f1, f1, {LO_FACTOR_PTX};\ncvt.rn.satfinite.e4m3x2.f32 p_lo, f1, f0;\n"
            f"st.shared.b16 [$0+{512 * g + 64 * i}], p_hi;\nst.shared.b16 [$0+{lo_rows + 512 * g + 64 * i}], p_lo;\n}}",
            base, a, b, result_types=None)

  store(x, ref)


def in_loop(ref, i: jax.Array):
  """``ref`` itself, sliced at an offset of 0 that depends on the page loop's index ``i`` (``i >> 30``: a program
  has fewer than 2**30 pages). A loop-invariant wgmma operand's descriptors, one 64-bit pair per k-step (36 for
  q's 576 columns), are otherwise hoisted out of the page loop, and ptxas keeps them in ordinary registers that
  spill (and, under a loop nest, are reloaded on every page); computed in the loop, they are constant offsets from
  one uniform base."""
  zero = pl.multiple_of(lax.shift_right_logical(i, 30) * ref.shape[0], ref.shape[0])
  return ref.at[pl.ds(zero, ref.shape[0])]


def _body(q_ref, kv_ref, *refs, num_splits: int, budget: int | None, out_rows: int, scale: float,
          smem_operands: bool, fp8: bool, narrow: bool, registers: bool, stages: int):
  # fp8 pages: the compute warpgroups dequantise them into one bf16 tile (64-row tiles), or the memory warpgroup
  # converts them unscaled into the f16 ring (narrow), and the compute warpgroups apply the per-token scales; or
  # (``registers``, narrow) the pages stay fp8 in SMEM, QK reads them as e4m3 and ``P @ V`` takes V's e4m3 bytes
  # into registers.
  dequant, convert = fp8 and not narrow, fp8 and narrow and not registers
  if registers:
    (words_ref, kv16_ref, q_amax_ref, table_ref, lens_ref, total_ref, o_ref, lse_ref, q_smem, ring, p_smem,
     row_smem, lse_smem, q_bar, kv_bar, consumed_bar, p_ready_bar, p_free_bar, piece_scales, scale_bar, ring_scales,
     q_amax_smem, inv_smem, fin_bar, rope_smem, q_rope_smem, *a_smem) = refs
    kv_smem, kv16_smem, o_stage = ring
  elif dequant:
    (words_ref, table_ref, lens_ref, total_ref, o_ref, lse_ref, q_smem, ring, row_smem, lse_smem, q_bar, kv_bar,
     consumed_bar, p_ready_bar, p_free_bar, tile_ready_bar, tile_free_bar) = refs
    (raw, scales, kv_tile), p_ring, o_stage = ring
  elif convert:
    (words_ref, table_ref, lens_ref, total_ref, o_ref, lse_ref, q_smem, ring, p_smem, row_smem, lse_smem, q_bar,
     kv_bar, consumed_bar, p_ready_bar, p_free_bar, pieces, piece_scales, piece_bar, scale_bar, ring_scales) = refs
    kv_smem, o_stage = ring
  else:
    (table_ref, lens_ref, total_ref, o_ref, lse_ref, q_smem, ring, p_smem, row_smem, lse_smem, q_bar, kv_bar,
     consumed_bar, p_ready_bar, p_free_bar) = refs
    kv_smem, o_stage = ring
  hb, split, b = lax.axis_index("hb"), lax.axis_index("split"), lax.axis_index("b")
  wg = lax.axis_index("wg")
  seq_len = lens_ref[b]
  seq_pages = pl.cdiv(seq_len, PAGE_SIZE)
  max_pages = table_ref.shape[1]
  if budget is None:  # equal splits of the block table's columns
    width = pages_per_split(max_pages, num_splits)
  else:  # this sequence's share of the batch's pages (``total_ref``: the batch's pages)
    width = balanced_split_width(total_ref[0], seq_pages, max_pages=max_pages, budget=budget,
                                 batch=lens_ref.shape[0], num_splits=num_splits)
  first_page = split * width
  num_pages = jnp.clip(seq_pages - first_page, 0, width)
  # head rows of a program: a 64-row tile, or narrow: all heads rounded up to 8 (registers: q_hi's, then q_lo's)
  rows = q_smem.shape[0] // (2 if registers else 1)
  row0 = pl.multiple_of(hb * rows, rows)
  head_blocks = util.cdiv(out_rows, rows)
  last_rows = out_rows - (head_blocks - 1) * rows
  # Wide: S = q @ kv^T is [heads, tokens]. Narrow: S^T = kv @ q^T is [tokens, heads], the heads being the
  # MMA's N (a multiple of 8), so its matrix work scales with the heads instead of a 64-row tile.
  head_axis, token_axis = (1, 0) if narrow else (0, 1)
  head_layout = plgpu.Layout.WGMMA.reduce(token_axis)
  along_heads = lambda x, shape: lax.broadcast_in_dim(x, shape, (head_axis,))
  acc_shape = (COLS, rows) if narrow else (rows, COLS)  # one warpgroup's half of the output columns

  def zero_v_tail(tile, cols, page_start, commit: bool):
    """Zeroes this warpgroup's V columns of the rows past ``seq_len`` (last page only; NaN-safe ``P @ V``), and
    with ``commit`` makes the zeros visible to the wgmma (the other pages need no fence)."""
    @pl.when(page_start + PAGE_SIZE > seq_len)
    def _():
      v = tile.at[:, cols]
      token = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, COLS), 0, layout=plgpu.Layout.WGMMA)
      v[...] = jnp.where(token < seq_len - page_start,
                         plgpu.load(v, layout=plgpu.Layout.WGMMA, optimized=False), 0).astype(v.dtype)
      if commit:
        plgpu.commit_smem()

  def p_tile(i):
    """Where P of page i goes: one buffer; fp8 with 64-row tiles: the first rows of page i's ring slot, whose values
    are in the bf16 tile by then (the slot goes back to the memory warpgroup only after ``P @ V``)."""
    if dequant:
      return p_ring.at[lax.rem(i, stages), pl.ds(0, rows)]
    return p_smem

  def accumulate(acc, alpha, tile, cols, p_ref):
    """``acc * alpha + P @ V[:, cols]`` with P (``[rows, 64]``) from SMEM; narrow: ``V[:, cols]^T @ P^T``.
    ``alpha=None``: the caller has rescaled ``acc`` already."""
    if alpha is not None:
      acc = acc * along_heads(alpha, acc.shape)

    def pv(acc_ref):
      if narrow:
        plgpu.wgmma(acc_ref, tile.at[:, cols].T, p_ref.T)
      else:
        plgpu.wgmma(acc_ref, p_ref, tile.at[:, cols])

    return util.accumulate(pv, acc, from_inits=not smem_operands)[0]

  def accumulate_fp8(acc, alpha, i, w, p_ref, phases):
    """``registers``: ``acc * alpha + V^T @ P^T`` over half w of the latent columns of page i, V^T straight from
    the fp8 slot: a transposed load of its uint16 pairs (two tokens' pairs per register) gives the e4m3 operands
    of the even and the odd columns (``e4m3_pair_operands``), so ``acc`` is a pair, those columns' ``[COLS / 2,
    rows]`` accumulators. The products (against P^T's two parts, ``store_p_e4m3``) go to accumulators of their own,
    added to ``acc`` in f32: an e4m3 wgmma's sum keeps about 14 bits (``QK_CHUNK``), too few to carry a sequence's
    pages. The profiler sees the conversion and the products as two phases."""
    phases.start(f"wg1_v{w}_convert")
    acc = tuple(a * along_heads(alpha, a.shape) for a in acc)  # before the loads: alpha's registers go free
    slot = lax.rem(i, stages)
    pairs = plgpu.load(kv16_smem.at[slot, :, pl.ds(w * (COLS // 2), COLS // 2)].T, layout=plgpu.Layout.WGMMA)
    # A NaN byte converts to NaN, which P = 0 would not cancel: the rows past seq_len of the last page (stale
    # or poisoned) are zeroed first.
    tail = seq_len - (first_page + i) * PAGE_SIZE
    # 16-bit token indices: half the registers of int32 ones beside the live accumulators.
    token = plgpu.broadcasted_iota(jnp.int16, pairs.shape, 1, layout=plgpu.Layout.WGMMA)
    pairs = lax.cond(tail < PAGE_SIZE, lambda x: jnp.where(token < tail.astype(jnp.int16), x, jnp.uint16(0)),
                     lambda x: x, pairs)
    operands = (e4m3_pair_bytes if a_smem else e4m3_pair_operands)(pairs)
    if a_smem:  # interpret mode takes the products' operands from SMEM only
      for k, x in enumerate(operands):
        a_smem[0].at[w, k][...] = x
      plgpu.commit_smem()
      operands = tuple(a_smem[0].at[w, k] for k in range(len(operands)))
    phases.start(f"wg1_v{w}_pv")

    def pv(*acc_refs):
      for acc_ref, a in zip(acc_refs, operands):
        plgpu.wgmma(acc_ref, a, p_ref.T)
      return tuple(r[...] for r in acc_refs)

    page = pl.run_scoped(pv, *(plgpu.ACC((COLS // 2, 2 * rows), jnp.float32) for _ in acc))
    return tuple(a + x[:, :rows] + x[:, rows:] * (1.0 / Q_LO_FACTOR) for a, x in zip(acc, page))

  def handoff(i):
    """Page i's P buffer, its alpha vector and their two barriers (P ready, P free). ``registers``: two of each,
    alternating, as the follower runs all of ``P @ V`` up to a page behind the leader's QK."""
    if registers:
      k = lax.rem(i, HANDOFFS)
      return p_smem.at[k], row_smem.at[k], p_ready_bar.at[k], p_free_bar.at[k]
    return p_tile(i), row_smem, p_ready_bar, p_free_bar

  def release(i, slot):
    """Hands ring slot ``slot`` back to the memory warpgroup after page ``i``, if that slot is loaded again.

    The memory warpgroup waits on ``consumed_bar[slot]`` only before it loads page ``i + stages`` into the
    slot, so the last ``stages`` pages of a split are never released: an arrival for them would complete a
    barrier phase that no warpgroup awaits. On the GPU that is no race (the memory warpgroup has issued its
    last copy and waits for nothing more), but every thread that waits on a barrier must observe each of
    its phases, and interpret mode checks that when the barrier is deallocated (it failed from 3 pages per
    split on, once the memory warpgroup had awaited an earlier phase of slot 0).
    """
    pl.when(i + stages < num_pages)(lambda: plgpu.barrier_arrive(consumed_bar.at[slot]))

  def row_scales(words_ref, valid_rows=None):
    """A page's ``[64, 8]`` scale words as row vectors: the latent and the rope scales, and given the number of
    ``valid_rows`` also the latent scales with 0 on the rows past them."""
    shape = (PAGE_SIZE, SCALE_WORDS)
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    words = plgpu.load(words_ref, layout=plgpu.Layout.WGMMA, optimized=False)
    picks = [(c, words) for c in SCALE_COLS]
    if valid_rows is not None:
      row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
      picks.append((SCALE_COLS[0], jnp.where(row < valid_rows, words, 0.0)))
    # A masked row max picks one column (and keeps a NaN scale NaN).
    return tuple(jnp.where(col == c, x, -jnp.inf).max(axis=1) for c, x in picks)

  def dequantize(w, slot, page_start):
    """fp8, 64-row tiles: warpgroup w's column chunks of ring slot ``slot`` into ``kv_tile`` as bf16 ``value *
    scale`` (the latent chunks by the row's latent scale, the rope chunk by its rope scale); rows past
    ``seq_len`` become 0, which also makes ``P @ V`` NaN-safe there."""
    s_c, s_pe = row_scales(scales.at[slot])
    shape = (PAGE_SIZE, FP8_CHUNK)
    valid = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) < seq_len - page_start
    for c in FP8_CHUNKS[w]:
      cols = pl.ds(c * FP8_CHUNK, FP8_CHUNK)
      # e4m3 -> f16 is exact (and the conversion Hopper has); the scale is applied in f32.
      x = plgpu.load(raw.at[slot, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
      x = x.astype(jnp.float16).astype(jnp.float32)
      x = x * lax.broadcast_in_dim(s_pe if c * FP8_CHUNK >= LATENT_DIM else s_c, shape, (0,))
      kv_tile.at[:, cols][...] = jnp.where(valid, x, 0.0).astype(kv_tile.dtype)

  def acquire(i, w):
    """Page i's ``[64, 576]`` bf16 tile for warpgroup w's QK / ``P @ V``. bf16: the ring slot itself. fp8: both
    compute warpgroups dequantise the slot into the one bf16 tile, once the previous page's ``P @ V`` is done
    with it."""
    slot = lax.rem(i, stages)
    plgpu.barrier_wait(kv_bar.at[slot])
    if not dequant:
      return kv_smem.at[slot]
    pl.when(i > 0)(lambda: plgpu.barrier_wait(tile_free_bar))
    dequantize(w, slot, (first_page + i) * PAGE_SIZE)
    plgpu.commit_smem()
    plgpu.barrier_arrive(tile_ready_bar)
    plgpu.barrier_wait(tile_ready_bar)
    return in_loop(kv_tile, i)  # one tile for every page: its descriptors as q's

  def done(i):
    """After a warpgroup's ``P @ V`` of page i: the ring slot goes back to the memory warpgroup (fp8: it held P
    too), and the fp8 tile may take the next page (an arrival only if a next page awaits it, as in
    ``release``)."""
    if dequant:
      pl.when(i + 1 < num_pages)(lambda: plgpu.barrier_arrive(tile_free_bar))
    release(i, lax.rem(i, stages))

  def store_rows(copy):
    """``copy(n)`` stores the first n rows of this head tile: only real heads (rounded up to 8) reach HBM."""
    if last_rows == rows:
      copy(rows)
      return
    pl.when(hb < head_blocks - 1)(lambda: copy(rows))
    pl.when(hb == head_blocks - 1)(lambda: copy(last_rows))

  def epilogue(w, acc, inv_l):
    if registers:  # a row of the stage: an even column's heads, then the next odd column's (O^T's rows in order)
      for k, a in enumerate(acc):
        o_stage.at[w, :, pl.ds(k * rows, rows)][...] = (a * along_heads(inv_l, a.shape)).astype(o_stage.dtype)
    else:
      o_stage[w] = (acc * along_heads(inv_l, acc.shape)).astype(o_stage.dtype)
    plgpu.commit_smem()
    if narrow:  # O^T as it is: the output is [..., 512, heads] (one program holds every head)
      stage_rows = o_stage.shape[1]
      plgpu.copy_smem_to_gmem(o_stage.at[w], o_ref.at[split, b, pl.ds(w * stage_rows, stage_rows)])
      return
    store_rows(lambda n: plgpu.copy_smem_to_gmem(
        o_stage.at[w, pl.ds(0, n)], o_ref.at[split, b, pl.ds(row0, n), pl.ds(w * COLS, COLS)]))

  def zero_acc():
    """A compute warpgroup's accumulator at 0: ``registers``, the even and the odd columns' pair."""
    if registers:
      half = (COLS // 2, rows)
      return tuple(plgpu.layout_cast(jnp.zeros(half, jnp.float32), plgpu.Layout.WGMMA) for _ in range(2))
    return plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)

  def leader():
    """Warpgroup 0: QK and the softmax for the whole page, then its half of ``P @ V``."""
    if not (smem_operands or convert):  # the converting memory warpgroup keeps its registers
      plgpu.set_max_registers(224 if registers else 232, action="increase")
    cols = pl.ds(0, COLS)
    phases = util.Phases()  # named regions for the on-device profiler (util.compiler_params)
    phases.start("wg0_q_wait")
    plgpu.barrier_wait(q_bar)
    phases.end()
    # registers: each head's s_q (q = s_q (q_hi + q_lo / Q_LO_FACTOR)), from its largest magnitude, with the
    # softmax scale
    q_scale = None
    if registers:
      q_scale = cache_format.amax_scale(plgpu.load(q_amax_smem, layout=head_layout)) * (scale * LOG2E)
    scaled = convert or registers  # the per-token scales enter S and P here

    def page_step(i, carry, masked: bool):
      acc, m, l, v_scale = carry if scaled else (*carry, None)
      phases.start("wg0_acquire")
      tile = acquire(i, 0)
      page_start = (first_page + i) * PAGE_SIZE
      phases.start("wg0_qk_softmax")

      def qk(acc_ref):
        if narrow:  # q as it is: narrow does not spill, and its loop keeps its instructions
          plgpu.wgmma(acc_ref, tile, q_smem.T)
        else:
          plgpu.wgmma(acc_ref, in_loop(q_smem, i), tile.T)
        return acc_ref[...]

      def qk_parts(*acc_refs):
        """fp8, narrow: the unscaled latent and rope parts of ``S^T``, each to be scaled per token (registers: over
        the e4m3 page against q's two parts, the latent part in ``QK_CHUNK``-column accumulators added in f32)."""
        *latent_refs, rope_ref = acc_refs
        width = LATENT_DIM // len(latent_refs)
        for k, acc_ref in enumerate(latent_refs):
          plgpu.wgmma(acc_ref, tile.at[:, pl.ds(k * width, width)], q_smem.at[:, pl.ds(k * width, width)].T)
        rope = pl.ds(LATENT_DIM, ROPE_DIM)  # registers: the rope columns land in a slot of their own
        if registers:
          plgpu.wgmma(rope_ref, rope_smem.at[slot], q_rope_smem.T)
        else:
          plgpu.wgmma(rope_ref, tile.at[:, rope], q_smem.at[:, rope].T)
        return sum(ref[...] for ref in latent_refs), rope_ref[...]

      shape = (PAGE_SIZE, rows) if narrow else (rows, PAGE_SIZE)
      slot = lax.rem(i, stages)
      if scaled:
        s_c, s_pe = (lax.broadcast_in_dim(plgpu.load(ring_scales.at[slot, k], layout=TOKEN_LAYOUT), shape, (0,))
                     for k in (0, 1))
        acc_s = (PAGE_SIZE, 2 * rows) if registers else shape
        chunks = LATENT_DIM // QK_CHUNK if registers else 1
        s_latent, s_rope = pl.run_scoped(qk_parts, *(plgpu.ACC(acc_s, jnp.float32) for _ in range(chunks + 1)))
        if registers:  # e4m3 products against [q_hi | q_lo]: the hi heads' columns, then the lo heads'
          s_latent, s_rope = (x[:, :rows] + x[:, rows:] * (1.0 / Q_LO_FACTOR) for x in (s_latent, s_rope))
        s = (s_latent * s_c + s_rope * s_pe) * (along_heads(q_scale, shape) if registers else scale * LOG2E)
      else:
        s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32)) * (scale * LOG2E)
      if masked:  # only the page that reaches past seq_len pays for the mask
        token = plgpu.broadcasted_iota(jnp.int32, shape, token_axis, layout=plgpu.Layout.WGMMA)
        s = jnp.where(token < seq_len - page_start, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(axis=token_axis))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - along_heads(m_new, s.shape))
      if not scaled:
        # Rescaled here, beside P's exponentials, instead of in accumulate: the multiplies then issue with P's
        # stores, ahead of the fence and the arrival on p_ready (the barrier keeps LLVM from sinking them below).
        acc, p = lax.optimization_barrier((acc * along_heads(alpha, acc.shape), p))
      if registers:  # l as a tile, summed over the tokens (across the warps) once, after the last page
        l = l * along_heads(alpha, shape) + p
      else:
        l = l * alpha + p.sum(axis=token_axis)

      phases.start("wg0_p_handoff")
      p_ref, alpha_ref, p_ready, p_free = handoff(i)

      @pl.when(i >= (HANDOFFS if registers else 1))
      def _():
        plgpu.barrier_wait(p_free)  # warpgroup 1 is done with the P and alpha that these buffers held

      if scaled:
        # The latent scales enter P @ V through P, relative to the page's largest (so P stays in [0, 1], clear of
        # f16's subnormals); the accumulator is kept in units of the current page's largest scale, hence alpha's
        # extra factor. page_scales wrote both (the ratios are 0 past seq_len, where P is 0 too).
        p = p * lax.broadcast_in_dim(plgpu.load(ring_scales.at[slot, 2], layout=TOKEN_LAYOUT), shape, (0,))
        page_scale = plgpu.load(ring_scales.at[slot, 3, pl.ds(0, rows)], layout=head_layout)
        alpha = alpha * (v_scale / page_scale)
        v_scale = page_scale
      if registers and not a_smem:
        store_p_e4m3(p * P_SCALE, p_ref)
      elif registers:
        for k, part in enumerate(e4m3_parts(p * P_SCALE)):
          p_ref.at[pl.ds(k * rows, rows)].T[...] = part.astype(p_ref.dtype)
      else:
        (p_ref.T if narrow else p_ref)[...] = p.astype(p_ref.dtype)
      alpha_ref[...] = alpha
      if masked and not fp8:
        zero_v_tail(tile, cols, page_start, commit=False)  # P's fence below covers the zeros
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      if registers:  # QK has read the slot; the follower runs all of P @ V
        release(i, slot)
      else:
        phases.start("wg0_pv")
        acc = accumulate(acc, alpha if scaled else None, tile, cols, p_ref)
        done(i)
      phases.end()
      return (acc, m_new, l, v_scale) if scaled else (acc, m_new, l)

    acc = None if registers else zero_acc()
    m = plgpu.layout_cast(jnp.full((rows,), INIT_MAX, jnp.float32), head_layout)
    l_shape = (PAGE_SIZE, rows) if registers else (rows,)
    l = plgpu.layout_cast(jnp.zeros(l_shape, jnp.float32), plgpu.Layout.WGMMA if registers else head_layout)
    carry = (acc, m, l)
    if scaled:  # the accumulator's unit (see page_step)
      carry += (plgpu.layout_cast(jnp.ones((rows,), jnp.float32), head_layout),)
    # The pages before full_pages hold PAGE_SIZE tokens each; a last page past seq_len, if any, is masked. Narrow
    # (bound by HBM, not by this warpgroup) masks every page: a second loop body there spills.
    full_pages = 0 if narrow else jnp.clip(seq_len // PAGE_SIZE - first_page, 0, num_pages)
    if not narrow:
      carry = lax.fori_loop(0, full_pages, functools.partial(page_step, masked=False), carry)
    carry = lax.fori_loop(full_pages, num_pages, functools.partial(page_step, masked=True), carry)
    acc, m, l = carry[:3]
    if scaled:
      v_scale = carry[3]

    if not registers:
      @pl.when(num_pages > 0)
      def _():
        plgpu.barrier_wait(p_free_bar)  # warpgroup 1 is done with the ring: the staging may overwrite it

    if registers:
      l = l.sum(axis=token_axis)
    # l = 0 is an empty split (no page, and acc = 0): (0, -inf). With tokens, l is NaN after a NaN or inf
    # in q or a token's row (exp2 of NaN or of inf - inf), or 0 if every logit was -inf (an infinite input
    # too): both give NaN, never the (0, -inf) that merge_partials drops as an empty split.
    l = jnp.where(l == 0, jnp.where(num_pages > 0, jnp.nan, 0.0), l)
    empty = l == 0
    inv_l = jnp.where(empty, 0.0, 1.0 / l)
    if scaled:
      inv_l = inv_l * (v_scale * (1.0 / P_SCALE) if registers else v_scale)
    (inv_smem if registers else row_smem)[...] = inv_l
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l)) * LN2)
    plgpu.commit_smem()
    plgpu.barrier_arrive(fin_bar if registers else p_ready_bar)
    store_rows(lambda n: plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, n)], lse_ref.at[split, b, pl.ds(row0, n)]))
    if not registers:
      epilogue(0, acc, inv_l)
    util.finish_stores()

  def follower():
    """Warpgroup 1: the other half of ``P @ V`` with the leader's P and alpha (``registers``: all of it)."""
    if not (smem_operands or convert):  # the converting memory warpgroup keeps its registers
      plgpu.set_max_registers(240 if registers else 232, action="increase")
    cols = pl.ds(COLS, COLS)
    phases = util.Phases()

    def page_step(i, acc):
      phases.start("wg1_acquire")
      tile = acquire(i, 1)
      if not fp8:
        zero_v_tail(tile, cols, (first_page + i) * PAGE_SIZE, commit=True)
      if convert:  # while the leader computes QK and the softmax of page i
        phases.start("wg1_convert")
        pl.when(i + 1 < num_pages)(lambda: convert_last_piece(i + 1))
      p_ref, alpha_ref, p_ready, p_free = handoff(i)
      phases.start("wg1_p_wait")
      plgpu.barrier_wait(p_ready)
      phases.start("wg1_pv")
      alpha = plgpu.load(alpha_ref, layout=head_layout)
      if registers:
        acc = tuple(accumulate_fp8(a, alpha, i, w, p_ref, phases) for w, a in enumerate(acc))
      else:
        acc = accumulate(acc, alpha, tile, cols, p_ref)
      if registers:  # only where the leader awaits it (every phase is observed: see ``release``)
        pl.when(i + HANDOFFS < num_pages)(lambda: plgpu.barrier_arrive(p_free))
      else:  # the leader awaits every page's, the last one's after its loop
        plgpu.barrier_arrive(p_free)
      done(i)
      phases.end()
      return acc

    if convert:
      pl.when(num_pages > 0)(lambda: convert_last_piece(0))
    acc = lax.fori_loop(0, num_pages, page_step, (zero_acc(), zero_acc()) if registers else zero_acc())
    plgpu.barrier_wait(fin_bar if registers else p_ready_bar)  # the leader's 1 / l; it is done with the ring
    inv_l = plgpu.load(inv_smem if registers else row_smem, layout=head_layout)
    for w, a in enumerate(acc) if registers else [(1, acc)]:
      epilogue(w, a, inv_l)
    util.finish_stores()

  def staging_slot(i, p):
    """fp8, narrow: the staging slot of page i's piece p (static): the memory warpgroup's pieces in turn over
    its ``MEM_SLOTS`` slots, the last piece of every page in the follower's slot."""
    return MEM_SLOTS if p == MEM_PIECES else lax.rem(i * MEM_PIECES + p, MEM_SLOTS)

  def issue_piece(i, p):
    """fp8, narrow: the TMA of page i's column piece p (static) into its staging slot, and with its last piece
    (the follower's) the page's scale words."""
    page = table_ref[b, first_page + i]
    staged = staging_slot(i, p)
    plgpu.copy_gmem_to_smem(kv_ref.at[page, :, pl.ds(p * PIECE_COLS, PIECE_COLS)], pieces.at[staged],
                            piece_bar.at[staged])
    if p == MEM_PIECES:
      s = lax.rem(i, stages)
      plgpu.copy_gmem_to_smem(words_ref.at[page, :, pl.ds(SCALE_WORD0, SCALE_WORDS)], piece_scales.at[s],
                              scale_bar.at[s])

  def convert_piece(staged, slot, p, page_start, masked: bool):
    """fp8, narrow: piece p (static) in staging slot ``staged`` into ring slot ``slot`` as f16 (exact, one
    instruction per two values), unscaled; ``masked`` (a sequence's last page) zeroes the rows past ``seq_len``,
    so that ``P @ V`` is NaN-safe there. All of the piece's loads come before its stores: the converter is one
    warp per scheduler, bound by the latency of its shared-memory loads, not by their issue."""
    chunks = [plgpu.load(pieces.at[staged, :, pl.ds(k * FP8_CHUNK, FP8_CHUNK)], layout=CONVERT_LAYOUT,
                         optimized=False) for k in range(PIECE_CHUNKS)]
    if masked:
      token = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, FP8_CHUNK), 0, layout=CONVERT_LAYOUT)
      valid = token < seq_len - page_start
    for k, x in enumerate(chunks):
      x = x.astype(jnp.float16)
      if masked:
        x = jnp.where(valid, x, 0.0).astype(jnp.float16)
      kv_smem.at[slot, :, pl.ds((p * PIECE_CHUNKS + k) * FP8_CHUNK, FP8_CHUNK)][...] = x

  def page_scales(slot, page_start):
    """fp8, narrow (on the follower; ``registers``: on the memory warpgroup): a page's scale vectors beside its
    ring slot, for the leader: the latent and the rope scales (rows 0 and 1, for S), the latent scales over their
    largest on the page's valid rows (row 2, 0 past ``seq_len``, for P) and that largest, repeated (row 3, for
    alpha). A NaN scale propagates to all."""
    plgpu.barrier_wait(scale_bar.at[slot])
    s_c, s_pe, s_valid = row_scales(piece_scales.at[slot], seq_len - page_start)
    # The largest over the rows of all four warps without the reduction scratch, which the leader's softmax uses
    # at the same time: the valid scales through SMEM (row 4), read back by every thread as a column vector and
    # reduced along a row of a broadcast [64, 64] tile, inside each warp.
    ring_scales.at[slot, 4][...] = s_valid
    plgpu.commit_smem()
    every = plgpu.load(ring_scales.at[slot, 4], layout=plgpu.Layout.WGMMA.reduce(0))
    top = lax.broadcast_in_dim(every, (PAGE_SIZE, PAGE_SIZE), (1,)).max(axis=1)
    for k, v in enumerate((s_c, s_pe, s_valid / top, top)):
      ring_scales.at[slot, k][...] = v

  def convert_last_piece(i):
    """fp8, narrow, on the follower: page i's last piece into its ring slot and the page's scale vectors beside
    it (once the slot's previous page is consumed, as the memory warpgroup waits for it too), the loads of page
    i + 1's last piece and scale words into the freed staging, and the follower's arrival on the page's
    ``kv_bar``."""
    slot = lax.rem(i, stages)
    pl.when(i >= stages)(lambda: plgpu.barrier_wait(consumed_bar.at[slot]))
    plgpu.barrier_wait(piece_bar.at[MEM_SLOTS])
    page_start = (first_page + i) * PAGE_SIZE
    piece = functools.partial(convert_piece, MEM_SLOTS, slot, MEM_PIECES, page_start)
    last = page_start + PAGE_SIZE > seq_len
    pl.when(last)(functools.partial(piece, True))
    pl.when(jnp.logical_not(last))(functools.partial(piece, False))
    page_scales(slot, page_start)
    plgpu.commit_smem()
    pl.when(i + 1 < num_pages)(functools.partial(issue_piece, i + 1, MEM_PIECES))
    plgpu.barrier_arrive(kv_bar.at[slot])

  def scales_behind(i):
    """``registers``, on the memory warpgroup, a page behind its loads (so their TMA has had a page's time to
    land and the loads never wait for it): page i's scale vectors beside its slot (``page_scales``), then the
    memory warpgroup's arrival on the page's ``kv_bar`` (the other arrival: its values' TMA). The leader last read
    those vectors for page ``i - stages``, before its release of the slot that the loads of page i awaited."""
    slot = lax.rem(i, stages)
    page_scales(slot, (first_page + i) * PAGE_SIZE)
    plgpu.commit_smem()
    plgpu.barrier_arrive(kv_bar.at[slot])

  def convert_pages(phases):
    """fp8, narrow: the memory warpgroup converts each page's first pieces into its f16 ring slot and reloads a
    staging slot as soon as its piece is converted."""
    for h in range(MEM_SLOTS):
      i, p = divmod(h, MEM_PIECES)
      pl.when(i < num_pages)(functools.partial(issue_piece, i, p))
    pl.when(num_pages > 0)(functools.partial(issue_piece, 0, MEM_PIECES))  # the follower's first piece

    @pl.loop(0, num_pages)
    def _(i):
      slot = lax.rem(i, stages)
      phases.start("mem_slot_wait")
      pl.when(i >= stages)(lambda: plgpu.barrier_wait(consumed_bar.at[slot]))
      page_start = (first_page + i) * PAGE_SIZE
      last = page_start + PAGE_SIZE > seq_len
      for p in range(MEM_PIECES):
        staged = staging_slot(i, p)
        phases.start("mem_piece_wait")
        plgpu.barrier_wait(piece_bar.at[staged])
        phases.start("mem_convert")
        piece = functools.partial(convert_piece, staged, slot, p, page_start)
        pl.when(last)(functools.partial(piece, True))
        pl.when(jnp.logical_not(last))(functools.partial(piece, False))
        # Every thread has read the piece (its slot may be reloaded) and its f16 chunks are visible to wgmma.
        plgpu.commit_smem()
        pages_on, p_next = divmod(p + MEM_SLOTS, MEM_PIECES)  # the piece MEM_SLOTS on takes the same slot
        pl.when(i + pages_on < num_pages)(functools.partial(issue_piece, i + pages_on, p_next))
      plgpu.barrier_arrive(kv_bar.at[slot])
      phases.end()

  pl.when(wg == 0)(leader)
  pl.when(wg == 1)(follower)

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    if not (smem_operands or convert):
      plgpu.set_max_registers(40, action="decrease")
    if registers:  # q_hi and q_lo, and the heads' largest magnitudes (s_q's)
      plgpu.copy_gmem_to_smem(q_ref.at[b, :, pl.ds(0, LATENT_DIM)], q_smem, q_bar)
      plgpu.copy_gmem_to_smem(q_ref.at[b, :, pl.ds(LATENT_DIM, ROPE_DIM)], q_rope_smem, q_bar)
      plgpu.copy_gmem_to_smem(q_amax_ref.at[b], q_amax_smem, q_bar)
    else:
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, rows)], q_smem, q_bar)
    phases = util.Phases()
    if convert:
      convert_pages(phases)
      return

    @pl.loop(0, num_pages)
    def _(i):
      slot = lax.rem(i, stages)
      phases.start("mem_slot_wait")

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(consumed_bar.at[slot])

      phases.start("mem_issue")
      page = table_ref[b, first_page + i]
      if registers:
        plgpu.copy_gmem_to_smem(kv_ref.at[page, :, pl.ds(0, LATENT_DIM)], kv_smem.at[slot], kv_bar.at[slot])
        plgpu.copy_gmem_to_smem(kv_ref.at[page, :, pl.ds(LATENT_DIM, ROPE_DIM)], rope_smem.at[slot],
                                kv_bar.at[slot])
        if a_smem:  # interpret mode: the uint16 view is a buffer of its own (its RefUnion does not alias)
          plgpu.copy_gmem_to_smem(kv16_ref.at[page, :, pl.ds(0, LATENT_DIM // 2)], kv16_smem.at[slot],
                                  kv_bar.at[slot])
        plgpu.copy_gmem_to_smem(words_ref.at[page, :, pl.ds(SCALE_WORD0, SCALE_WORDS)], piece_scales.at[slot],
                                scale_bar.at[slot])
        phases.start("mem_scales")
        pl.when(i > 0)(lambda: scales_behind(i - 1))
      elif fp8:
        plgpu.copy_gmem_to_smem(kv_ref.at[page, :, pl.ds(0, DIM)], raw.at[slot], kv_bar.at[slot])
        plgpu.copy_gmem_to_smem(words_ref.at[page, :, pl.ds(SCALE_WORD0, SCALE_WORDS)], scales.at[slot],
                                kv_bar.at[slot])
      else:
        plgpu.copy_gmem_to_smem(kv_ref.at[page], kv_smem.at[slot], kv_bar.at[slot])
      phases.end()

    if registers:
      pl.when(num_pages > 0)(lambda: scales_behind(num_pages - 1))


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "budget", "partial_dtype", "narrow",
                                             "interpret", "smem_operands", "registers"))
def _partials(q_abs, kv_cache, block_table, seq_lens, *, scale, num_splits, budget, partial_dtype, narrow,
              interpret, smem_operands, registers):
  batch, num_heads, dim = q_abs.shape
  out_rows = util.cdiv(num_heads, 8) * 8  # TMA stores whole 8-row groups of the tiled staging buffer
  rows = out_rows if narrow else HEAD_TILE  # head rows of one program
  head_blocks = util.cdiv(num_heads, rows)
  q_pad = jnp.pad(q_abs, ((0, 0), (0, head_blocks * rows - num_heads), (0, 0)))
  fp8 = cache_format.is_fp8(kv_cache.dtype)
  # fp8, narrow: the products run in f16 (e4m3 -> f16 is exact; the scales are applied to S and to P).
  tile_dtype = (jnp.float16 if narrow else jnp.bfloat16) if fp8 else kv_cache.dtype
  if fp8 and narrow and not registers:
    q_pad = q_pad.astype(jnp.float16)
  tile = lambda shape, dtype: plgpu.SMEM(shape, dtype, transforms=util.smem_transforms(dtype, shape[-1]))
  o_stage = tile((COMPUTE_WGS,) + ((COLS, rows) if narrow else (rows, COLS)), partial_dtype)
  inputs, extra, stages, q_bar = (q_pad, kv_cache), (), STAGES, plgpu.Barrier()
  handoffs = (HANDOFFS,) if registers else ()  # P, alpha and their barriers: one set each, registers: HANDOFFS
  p_smem = (tile(handoffs + (rows, PAGE_SIZE), tile_dtype),)
  if fp8:
    # The same bytes as f32 words (a bitcast, no copy): the memory warpgroup loads the scales from there.
    words = lax.bitcast_convert_type(kv_cache.reshape(kv_cache.shape[:2] + (ROW_WORDS, 4)), jnp.float32)
    inputs += (words,)
  # The fp8 slots are tiled (8, 64) with the 64-byte swizzle: a tiled TMA needs the rows of the source (640
  # bytes) in whole tiles.
  fp8_smem = lambda shape, swizzle=FP8_TILE_COLS: plgpu.SMEM(
      shape, kv_cache.dtype, transforms=(plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle)))
  fp8_slots = lambda n, cols, swizzle=FP8_TILE_COLS: fp8_smem((n, PAGE_SIZE, cols), swizzle)
  if registers:
    # The fp8 ring read two ways: as e4m3 by QK, as uint16 pairs by the conversion of V (and the output stage
    # once the pages are done). On the GPU one RefUnion; interpret mode, whose RefUnion does not alias, loads the
    # uint16 view (the same bytes in GMEM, a bitcast) into a buffer of its own and stages the products' register
    # operands in SMEM. The latent columns come with the 128-byte swizzle (a row's 512 bytes are four whole
    # 128-byte tiles; the 64-byte swizzle's narrower boxes stream slower), the rope columns with the 64-byte one
    # into slots of their own. kv_bar: the two TMAs (and interpret's third) and the memory warpgroup's page
    # scales.
    stages = REG_STAGES
    p_smem = (plgpu.SMEM(handoffs + (2 * rows, PAGE_SIZE), cache_format.FP8, transforms=P_TRANSFORMS),)  # P^T's parts
    q8, q_amax = split_e4m3(q_pad)
    # q's parts as the pages' slots: the latent columns with the 128-byte swizzle (a wgmma's operands share one),
    # the rope columns with the 64-byte one; the rows padded to 640 bytes, whole tiles of either, for the TMA.
    q8 = jnp.pad(q8, ((0, 0), (0, 0), (0, LATENT_SWIZZLE - ROPE_DIM)))
    pairs = lax.bitcast_convert_type(kv_cache.reshape(kv_cache.shape[:2] + (ROW_WORDS * 2, 2)), jnp.uint16)
    inputs = (q8, kv_cache, words, pairs, q_amax)
    views = (fp8_slots(stages, LATENT_DIM, LATENT_SWIZZLE),
             plgpu.SMEM((stages, PAGE_SIZE, LATENT_DIM // 2), jnp.uint16,
                        transforms=(plgpu.TilingTransform((8, LATENT_SWIZZLE // 2)),
                                    plgpu.SwizzleTransform(LATENT_SWIZZLE))),
             plgpu.SMEM((COMPUTE_WGS, COLS // 2, 2 * rows), partial_dtype))
    ring = views if interpret else plgpu.RefUnion(*views)
    q_bar = plgpu.Barrier(num_arrivals=3)
    kv_bar = plgpu.Barrier(num_arrivals=4 if interpret else 3, num_barriers=stages)
    # The page scale words, their barriers, the scale vectors, q's row maxima, the leader's 1 / l for the
    # follower, and the rope slots.
    extra = (plgpu.SMEM((stages, PAGE_SIZE, SCALE_WORDS), jnp.float32), plgpu.Barrier(num_barriers=stages),
             plgpu.SMEM((stages, 5, PAGE_SIZE), jnp.float32), plgpu.SMEM((rows,), jnp.float32),
             plgpu.SMEM((rows,), jnp.float32), plgpu.Barrier(), fp8_slots(stages, ROPE_DIM),
             fp8_smem((2 * rows, ROPE_DIM)))
    if interpret:
      extra += (plgpu.SMEM((COMPUTE_WGS, 2, COLS // 2, PAGE_SIZE), cache_format.FP8, transforms=P_TRANSFORMS),)
  elif fp8 and narrow:
    # An f16 ring, which the memory warpgroup and the follower fill from the fp8 staging slots (a page is ready
    # when both have arrived), and the per-token scales beside it.
    ring = plgpu.RefUnion(tile((STAGES, PAGE_SIZE, DIM), tile_dtype), o_stage)
    kv_bar = plgpu.Barrier(num_arrivals=2, num_barriers=STAGES)
    extra = (fp8_slots(PIECE_SLOTS, PIECE_COLS), plgpu.SMEM((STAGES, PAGE_SIZE, SCALE_WORDS), jnp.float32),
             plgpu.Barrier(num_barriers=PIECE_SLOTS), plgpu.Barrier(num_barriers=STAGES),
             plgpu.SMEM((STAGES, 5, PAGE_SIZE), jnp.float32))
  elif fp8:
    # Three groups from the same offset: the fp8 ring (then the scales and the bf16 tile); P of each page in the
    # first rows of its ring slot (a slot's values are in the tile before P is written, and the slot is reloaded
    # only after P @ V); the staging of the outputs once the pages are done. A separate P buffer would not fit.
    ring = plgpu.RefUnion((fp8_slots(STAGES, DIM),
                           plgpu.SMEM((STAGES, PAGE_SIZE, SCALE_WORDS), jnp.float32),
                           tile((PAGE_SIZE, DIM), tile_dtype)),
                          tile((STAGES, DIM // 2, PAGE_SIZE), tile_dtype),  # a slot's bytes as [*, 64] bf16
                          o_stage)
    p_smem = ()
    kv_bar = plgpu.Barrier(num_arrivals=2, num_barriers=STAGES)  # values, scales
    extra = (plgpu.Barrier(num_arrivals=COMPUTE_WGS), plgpu.Barrier(num_arrivals=COMPUTE_WGS))  # tile
  else:
    ring = plgpu.RefUnion(tile((STAGES, PAGE_SIZE, DIM), kv_cache.dtype), o_stage)
    kv_bar = plgpu.Barrier(num_barriers=STAGES)
  # registers: each row of O^T's stage holds two latent columns (``epilogue``), the same bytes as [512, rows].
  o_shape = ((LATENT_DIM // 2, 2 * out_rows) if registers else (LATENT_DIM, out_rows)) if narrow else (
      out_rows, LATENT_DIM)
  kernel = plgpu.kernel(
      functools.partial(_body, num_splits=num_splits, budget=budget, out_rows=out_rows, scale=scale,
                        smem_operands=smem_operands, fp8=fp8, narrow=narrow, registers=registers, stages=stages),
      out_type=(jax.ShapeDtypeStruct((num_splits, batch) + o_shape, partial_dtype),
                jax.ShapeDtypeStruct((num_splits, batch, out_rows), jnp.float32)),
      # Row-major: the last grid axis is the fastest (Mosaic GPU maps it to CUDA's x, dispatched first), so the
      # head blocks of one (split, sequence) run at the same time and the second reads the pages from L2.
      grid=(num_splits, batch, head_blocks),
      grid_names=("split", "b", "hb"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      kernel_name="mla_decode_" + ("narrow" if narrow else "wide") + ("_fp8" if fp8 else "") + (
          "_regs" if registers else ""),
      scratch_types=(
          fp8_smem((2 * rows, LATENT_DIM), LATENT_SWIZZLE) if registers else tile((rows, dim), q_pad.dtype),
          ring,
          *p_smem,
          plgpu.SMEM(handoffs + (rows,), jnp.float32),
          plgpu.SMEM((rows,), jnp.float32),
          q_bar,
          kv_bar,
          plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
          plgpu.Barrier(num_barriers=HANDOFFS if registers else 1),
          plgpu.Barrier(num_barriers=HANDOFFS if registers else 1),
      ) + extra,
      # Wide: the row reductions stay inside a warp, and SMEM has no room for scratch. Narrow: the reductions
      # over the tokens (the rows of S^T) cross the warps, through the default scratch. No warpgroup barrier
      # around every SMEM store (Pallas's default), which the fp8 converter paid twice per chunk and the leader
      # twice for each page's P and alpha, except with 64-row fp8 tiles (their P and bf16 tile share memory with
      # the slot that both warpgroups read). That is safe: every store that another warp, warpgroup or the
      # async proxy reads is followed by ``commit_smem`` (a fence and a warpgroup barrier) before the mbarrier
      # that hands it over. The follower has arrived on ``p_free_bar`` before the leader overwrites P and alpha;
      # the leader's own ``P @ V`` reads P^T whole in every warp (narrow), but its warps meet in the softmax's
      # reductions across warps before the next P, or reads only each warp's own rows of P (64-row tiles). The
      # bf16 tail zeroing reads and writes the same rows in the same warp.
      compiler_params=util.compiler_params(approx_math=True, unsafe_no_auto_barriers=not (fp8 and not narrow),
                                           **({} if narrow else dict(reduction_scratch_bytes=0))),
  )
  # fp8 with 64-row tiles: P is written over the first rows of its page's raw fp8 slot through one RefUnion group,
  # and the raw slots, the scales and the bf16 tile are read through the other; the race detector compares groups,
  # not bytes, and reports a read after P's store. Not shown to be a race (the path's GPU tests pass), not shown
  # not to be either: this path runs without the detector (benchmarks/RESULTS.md, session 35).
  with mosaic_interpret.interpret_mode(interpret, detect_races=not (fp8 and not narrow)):
    # The batch's pages, for the balanced splits' widths: one small XLA reduction.
    page_total = (jnp.sum((seq_lens + PAGE_SIZE - 1) // PAGE_SIZE, keepdims=True) if budget is not None
                  else jnp.zeros((1,), jnp.int32))
    o_parts, lse_parts = kernel(*inputs, block_table, seq_lens, page_total)
  if narrow:
    o_parts = jnp.swapaxes(o_parts.reshape(o_parts.shape[:2] + (LATENT_DIM, out_rows)), 2, 3)  # fused into the merge
  return o_parts[:, :, :num_heads], lse_parts[:, :, :num_heads]


def mla_decode_partials_mosaic(q_abs: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                               seq_lens: jax.Array, *, scale: float, num_splits: int,
                               partial_dtype: jnp.dtype, interpret: bool, narrow: bool = False,
                               smem_operands: bool | None = None, budget: int | None = None,
                               registers: bool = False) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``mla_decode``: the split partials, as ``reference.mla_decode_partials_reference`` (which has
  the equal splits of ``budget=None``).

  Args:
    q_abs: ``[B, Hq, 576]`` bf16 (Hq is padded to a multiple of 64 rows inside, narrow: of 8; any Hq >= 1).
    kv_cache: ``[pages, 64, 576]`` bf16, or ``[pages, 64, 640]`` fp8 rows with their scales (``cache_format``:
      dequantised on chip into a bf16 tile, narrow: converted unscaled into an f16 tile). block_table:
      ``[B, max_pages]`` int32. seq_lens: ``[B]`` int32. Already validated by ``mla_decode``.
    scale: softmax scale. num_splits: splits S (each ``pages_per_split`` pages). partial_dtype: bf16/f32.
    interpret: run in Mosaic GPU interpret mode (CPU).
    narrow: the transposed kernel (``S^T = kv @ q^T``, ``O^T = V^T @ P^T``: the heads are the MMA's N), one
      program for all heads; its matrix work scales with Hq rounded up to 8 instead of 64. Hq <= 32 with a bf16
      cache, Hq <= 16 with an fp8 one (``narrow_applies``).
    smem_operands: the interpret-safe variant (see README.md); None = ``interpret``.
    budget: balanced splits: ``budget * B`` programs spread over the sequences by the pages they hold, each
      sequence over at most its S splits (``reference.balanced_split_width``; ``mla_decode`` takes S = twice the
      budget). None: every sequence in S equal splits of ``pages_per_split(max_pages, S)`` pages.
    registers: narrow with an fp8 cache only: the pages stay fp8 in SMEM, QK runs on their e4m3 values against q
      split in two e4m3 parts (``split_e4m3``) and ``P @ V`` on V's e4m3 bytes in registers against P in two e4m3
      parts (interpret mode: through SMEM, so ``smem_operands`` must equal ``interpret``).

  Returns:
    ``o_parts [S, B, Hq, 512]`` in ``partial_dtype`` (normalised) and ``lse_parts [S, B, Hq]`` f32 natural
    log; an empty split is ``(0, -inf)``.
  """
  if narrow and not narrow_applies(q_abs.shape[1], kv_cache.dtype):
    raise NotImplementedError(f"the narrow MLA decode kernel takes at most {NARROW_MAX_HEADS} heads with a bf16 "
                              f"cache or {FP8_NARROW_MAX_HEADS} with an fp8 one, got {q_abs.shape[1]} and "
                              f"{jnp.dtype(kv_cache.dtype).name}")
  smem_operands = interpret if smem_operands is None else smem_operands
  if registers and not (narrow and cache_format.is_fp8(kv_cache.dtype) and smem_operands == interpret):
    raise NotImplementedError(f"registers=True takes the narrow kernel over an fp8 cache, with smem_operands equal "
                              f"to interpret; got narrow={narrow}, {jnp.dtype(kv_cache.dtype).name}, "
                              f"smem_operands={smem_operands}, interpret={interpret}")
  return _partials(q_abs, kv_cache, block_table, seq_lens, scale=scale, num_splits=num_splits, budget=budget,
                   partial_dtype=jnp.dtype(partial_dtype), narrow=narrow, interpret=interpret,
                   smem_operands=smem_operands, registers=registers)

"""KDA prefill with segments: the combine between the two state passes (README.md, "Segments").

Segment ``j`` of a sequence maps its first state ``S`` (V-first: ``[V, K]``) to ``S M_j + B_j``, with ``B_j``
(``[V, K]``) and ``M_j`` (``[K, K]``) from the transition pass. The combine runs each sequence's segments in order
from the sequence's initial state and writes every segment's first state. One program (one warpgroup) per
(V-block, sequence, head). The products run on the tensor cores with each f32 operand split into a bf16 head and
tail, ``S M = Sh Mh + Sl Mh + Sh Ml`` (relative error about 2^-16): one bf16 or TF32 product would round the
carried state at every segment, coarser than an f32 pool keeps it.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import util
from pallas_kernels.kda._mosaic import WG, bf16, f32, tiled
from pallas_kernels.kda import prefill_state
from pallas_kernels.kda.prefill_state import BV


def _split(x: jax.Array, hi, lo) -> None:
  """Stores ``x`` (f32) as the bf16 head ``hi`` and the bf16 tail ``lo`` of ``x - hi``."""
  x_hi = x.astype(bf16)
  hi[...] = x_hi
  lo[...] = (x - x_hi.astype(f32)).astype(bf16)


def _combine_body(meta_ref, pool_ref, bm_ref, out_ref, stg, m_f, b_f, m_hi, m_lo, s_hi, s_lo, init_bar,
                  bar, *, G: int, interpret: bool):
  init_s, out_s = stg  # one memory: the initial state's staging, then each first state's
  K = m_f.shape[-1]
  V = bm_ref.shape[2] - K
  v0 = pl.multiple_of(lax.axis_index("v") * BV, BV)
  n = lax.axis_index("n")
  h = lax.axis_index("h")
  slot = meta_ref[prefill_state.SLOT_ROW, n]
  has_init = (slot >= 0) & (meta_ref[prefill_state.INIT_ROW, n] != 0)

  def issue(j):
    """Segment ``j``'s M and this program's rows of its B."""
    plgpu.copy_gmem_to_smem(bm_ref.at[n * G + j, h, pl.ds(V, K)], m_f, bar)
    plgpu.copy_gmem_to_smem(bm_ref.at[n * G + j, h, pl.ds(v0, BV)], b_f, bar)

  if G > 1:
    issue(0)

  @pl.when(has_init)
  def _():
    plgpu.copy_gmem_to_smem(pool_ref.at[slot, h, pl.ds(v0, BV)], init_s, init_bar)
    plgpu.barrier_wait(init_bar)

  # Uninitialised SMEM may hold NaN: select, never multiply by 0.
  init_rows = plgpu.broadcasted_iota(jnp.int32, (BV, K), 0, layout=WG) < jnp.where(has_init, BV, 0)
  s0 = jnp.where(init_rows, plgpu.load(init_s, layout=WG, optimized=False).astype(f32), 0.0)

  def store(j, s):
    """``s`` as segment ``j``'s first state. The wait before the staging is written (it ends in a warpgroup
    barrier) also orders every warp's read of the initial state, whose memory the staging shares."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_s[...] = s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_ref.at[n * G + j, h, pl.ds(v0, BV)])

  def step(j, s):
    store(j, s)
    plgpu.barrier_wait(bar)
    for r in range(0, K, BV):  # M in row blocks: all of it at once would take K²/128 registers a thread
      _split(plgpu.load(m_f.at[pl.ds(r, BV)], layout=WG, optimized=False), m_hi.at[pl.ds(r, BV)],
             m_lo.at[pl.ds(r, BV)])
    b = plgpu.load(b_f, layout=WG, optimized=False)
    _split(s, s_hi, s_lo)
    # The splits are visible to the tensor cores, and every warp's reads of m_f and b_f are performed, so the next
    # segment's loads may overwrite them while this one's products run.
    plgpu.commit_smem()
    pl.when(j + 1 < G - 1)(lambda: issue(j + 1))

    def products(acc):
      plgpu.wgmma(acc, s_hi, m_hi)
      plgpu.wgmma(acc, s_lo, m_hi)
      plgpu.wgmma(acc, s_hi, m_lo)

    (s,) = util.accumulate(products, b, from_inits=not interpret)
    return s

  s = lax.fori_loop(0, G - 1, step, s0)
  store(G - 1, s)
  util.finish_stores()


def combine(bm: jax.Array, state_pool: jax.Array, seq_meta: jax.Array, *, G: int,
            interpret: bool = False) -> jax.Array:
  """Every segment's first state.

  Args:
    bm: ``[N * G, H, V + K, K]`` f32, the transition pass's output for segment ``j`` of sequence ``n`` at
      ``n * G + j``: rows ``[0, V)`` B, rows ``[V, V + K)`` M.
    state_pool: ``[P, H, V, K]`` f32 or bf16, read at the sequences' initial-state slots.
    seq_meta: ``prefill_state.state_pass``'s per-sequence table (``[R >= SEQ_META_ROWS, N' >= N]``); its pool
      slot (-1: no initial state) and has-initial-state (0/1) rows are read, in the first ``N`` columns.
    G: segments per sequence.
    interpret: the variant for interpret mode (``util.accumulate``).

  Returns:
    ``[N * G, H, V, K]`` f32: at ``n * G + j`` the state sequence ``n`` enters segment ``j`` with (the initial
    state for ``j = 0``: the slot's, exactly in f32, or zero).
  """
  NS, H, R, K = bm.shape
  V = R - K
  N = NS // G
  if NS != N * G or seq_meta.shape[1] < N or V <= 0 or V % BV or state_pool.shape[1:] != (H, V, K):
    raise ValueError(f"combine: bm {bm.shape} must be [N * G, H, V + K, K] (G = {G}) with V a multiple of {BV}, "
                     f"matching state_pool {state_pool.shape} [P, H, V, K], and seq_meta {seq_meta.shape} N columns")
  scratch = [
      plgpu.RefUnion(plgpu.SMEM((BV, K), state_pool.dtype), plgpu.SMEM((BV, K), f32)),
      plgpu.SMEM((K, K), f32), plgpu.SMEM((BV, K), f32), tiled((K, K)), tiled((K, K)), tiled((BV, K)),
      tiled((BV, K)), plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=2),
  ]
  # Pallas's automatic warpgroup barriers around SMEM stores are off: each store follows a commit_smem or a TMA
  # store wait (both end in one) after every warp's last read of that memory, and is read after the next one.
  return plgpu.kernel(
      functools.partial(_combine_body, G=G, interpret=interpret),
      out_type=jax.ShapeDtypeStruct((NS, H, V, K), f32),
      grid=(V // BV, N, H), grid_names=("v", "n", "h"), scratch_types=scratch, kernel_name="kda_prefill_combine",
      compiler_params=util.compiler_params(unsafe_no_auto_barriers=True),
  )(seq_meta, state_pool, bm)

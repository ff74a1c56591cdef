"""Public MLA prefill entry point: causal attention within packed sequences, flash-style blockwise in XLA
(``impl="xla"``) or the Mosaic GPU kernel of ``kernel.py`` (``impl="pallas"``, and ``"interpret"`` on the CPU).

The blockwise path never forms a ``[T, T]`` array: an outer ``lax.map`` over query blocks runs an inner
``lax.fori_loop`` over key blocks with a running max and sum in f32 (online softmax), so its working set is
O(T * H * D) for the inputs and outputs plus one ``[H, block_q, block_k]`` f32 score block. Compute stays
O(T^2) within a sequence, but key blocks outside ``[row_lo[first row], row_hi[last row])`` of a query block
(``reference.row_bounds``: both bounds are non-decreasing) are not visited.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import util
from pallas_kernels.mla_prefill import kernel, reference
from pallas_kernels.mla_prefill.config import MlaPrefillConfig, MlaPrefillTuning

_HIGHEST = jax.lax.Precision.HIGHEST


def default_tuning() -> MlaPrefillTuning:
  """The "xla" path takes blocks of 256 query by 512 key rows (a shorter batch is one block): the f32 score
  block ``[H, 256, 512]`` stays small next to the ``[T, H, D]`` inputs of a long prompt while each step
  multiplies whole tiles. The kernel takes 128-row key blocks in a two-slot ring, the key tile and depth that
  FlashAttention-3 and JAX's Mosaic GPU attention use at these head sizes (no third slot fits in SMEM); not
  yet tuned by measurement."""
  return MlaPrefillTuning(block_q=256, block_k=512, kernel_block_k=128, num_stages=2)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k"))
def _blockwise(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k, *, scale, block_q, block_k):
  t, h, _ = q.shape
  tk, dv = k_nope.shape[0], v.shape[-1]
  bq, bk = min(block_q, t), min(block_k, tk)
  nq, nk = util.cdiv(t, bq), util.cdiv(tk, bk)
  lo, hi = reference.row_bounds(cu_seqlens, cu_seqlens_k, t)
  # Padded keys have indices >= Tk, past every row's range. Padded query rows repeat the last row's bounds
  # (the blocks visited stay those of the real rows) and are sliced off; they only need to stay finite.
  lo, hi = (jnp.pad(x, (0, nq * bq - t), mode="edge") for x in (lo, hi))
  q_blocks = util.pad_rows(q, nq * bq).reshape(nq, bq, *q.shape[1:])
  k_nope, k_rope, v = (util.pad_rows(x, nk * bk) for x in (k_nope, k_rope, v))

  def query_block(args):
    i, q_blk = args
    q0 = i * bq
    rows = q0 + jnp.arange(bq, dtype=jnp.int32)
    row_lo, row_hi = (jax.lax.dynamic_slice_in_dim(x, q0, bq) for x in (lo, hi))
    # Both bounds are non-decreasing: the first row's lower and the last row's upper bound every row's range.
    first_block = row_lo[0] // bk
    last_block = (row_hi[-1] - 1) // bk

    def key_block(j, carry):
      m, l, acc, hit = carry
      k0 = j * bk
      cols = k0 + jnp.arange(bk, dtype=jnp.int32)
      mask = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None])
      blk = lambda x: jax.lax.dynamic_slice_in_dim(x, k0, bk)
      s = jnp.where(mask[None], reference.logits(q_blk, blk(k_nope), blk(k_rope), scale), -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      # Shift by 0 only while a row has seen nothing but -inf; a NaN or +inf max must stay and give NaN.
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_use)
      p = jnp.exp(s - m_use[..., None])
      l = alpha * l + jnp.sum(p, axis=-1)
      # Cleaned per block, not up front: an f32 copy of the whole V would be the largest buffer of the op.
      v_clean, v_bad = reference.split_v(blk(v))
      acc = alpha[..., None] * acc + jnp.einsum("hqk,khv->hqv", p, v_clean, precision=_HIGHEST)
      hit = hit + jnp.einsum("qk,kh->hq", mask.astype(jnp.float32), v_bad, precision=_HIGHEST)
      return m_new, l, acc, hit

    init = (jnp.full((h, bq), -jnp.inf, jnp.float32), jnp.zeros((h, bq), jnp.float32),
            jnp.zeros((h, bq, dv), jnp.float32), jnp.zeros((h, bq), jnp.float32))
    m, l, acc, hit = jax.lax.fori_loop(first_block, last_block + 1, key_block, init)
    # A real row always sees itself: l == 0 there only when every visible logit is -inf (infinite inputs),
    # which must read NaN, never as an empty row. Padded rows divide by 1.
    l = jnp.where(rows[None, :] < t, jnp.where(l == 0, jnp.nan, l), 1.0)
    o = jnp.where(hit[..., None] > 0, jnp.nan, acc / l[..., None])
    return o.transpose(1, 0, 2).astype(q.dtype), (m + jnp.log(l)).T

  o, lse = jax.lax.map(query_block, (jnp.arange(nq, dtype=jnp.int32), q_blocks))
  return o.reshape(nq * bq, h, dv)[:t], lse.reshape(nq * bq, h)[:t]


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_stages", "interpret"))
def _kernel_path(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k, *, scale, block_k, num_stages, interpret):
  # Traced here, the bounds skip the kernel entry's host-side value check: they are right by construction.
  row_lo, row_hi = reference.row_bounds(cu_seqlens, cu_seqlens_k, q.shape[0])
  return kernel.mla_prefill_mosaic(q, k_nope, k_rope, v, row_lo, row_hi, scale=scale, block_k=block_k,
                                   num_stages=num_stages, interpret=interpret)


def mla_prefill_attention(q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array, *,
                          cu_seqlens: jax.Array, cu_seqlens_k: jax.Array | None = None,
                          config: MlaPrefillConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal self-attention within each packed sequence, the MLA prefill form (non-absorbed, shared rope key).

  Token ``i`` of sequence ``n`` attends to tokens ``cu_seqlens[n] .. i`` with logits
  ``scale * (q[i, h, :Dn] . k_nope[j, h] + q[i, h, Dn:] . k_rope[j])``. With ``cu_seqlens_k`` the keys are
  packed apart and each sequence's queries are its last tokens (a prompt chunk after its cached prefix: its
  query ``t`` sees keys ``0 .. Lk_n - L_n + t``; ``reference``'s docstring). Softmax statistics and the
  accumulation are f32 and the output is rounded once. ``impl="xla"`` is the blockwise path (memory
  O(T * H * D + H * block_q * block_k), never ``[T, T]``); ``impl="pallas"`` is the Mosaic GPU kernel
  (Hopper; bf16/f16 inputs, head dims positive multiples of 64; P is rounded to q's dtype before ``P @ V``, as in
  FlashAttention), ``"interpret"`` the same kernel interpreted on the CPU. Both paths run data-dependent
  loops, so they are forward-only (no reverse-mode gradient).

  Args:
    q: ``[T, H, Dn + Dr]`` queries (K3: Dn = 128, Dr = 64), f32/bf16/f16. T = 0 is allowed.
    k_nope: ``[T, H, Dn]`` (``[Tk, H, Dn]`` with ``cu_seqlens_k``) per-head keys, q's dtype.
    k_rope: ``[T, Dr]`` / ``[Tk, Dr]`` rope key shared by all heads (never broadcast over heads), q's dtype.
    v: ``[T, H, Dv]`` / ``[Tk, H, Dv]`` values, q's dtype; Dv may differ from Dn + Dr.
    cu_seqlens: ``[N + 1]`` int32, non-decreasing from 0 to T (empty sequences allowed).
    cu_seqlens_k: ``[N + 1]`` int32 or None: key rows of each sequence in ``k_nope``, ``k_rope`` and ``v``
      (``[Tk, ...]`` then), non-decreasing from 0 to at most Tk, ``Lk_n >= L_n``; rows past the last
      sequence's are never seen.
    config: ``MlaPrefillConfig`` (scale, impl, tuning: the block sizes of either path).

  Returns:
    ``o [T, H, Dv]`` in q's dtype and ``lse [T, H]`` f32 natural log of the softmax denominator. A NaN or inf
    in q or in a visible key makes the heads it reaches NaN in ``o`` and ``lse``; one in a visible ``v`` row
    makes that head's ``o`` NaN. Later tokens and other sequences never reach a token.

  Raises:
    ValueError: malformed shapes or dtypes, (when concrete) ``cu_seqlens`` values, or a kernel tuning whose
      buffers exceed the SMEM of an SM.
    NotImplementedError: the kernel ("pallas", "interpret") with f32 inputs or a head dim (Dn, Dr, Dv) that is
      not a positive multiple of 64.
  """
  config = config or MlaPrefillConfig()
  reference.validate_prefill_inputs(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k)
  if config.impl != "xla":
    kernel.check_supported(q, k_nope, k_rope, v)
  t, h, _ = q.shape
  if t == 0:
    return jnp.zeros((0, h, v.shape[-1]), q.dtype), jnp.zeros((0, h), jnp.float32)
  scale = reference.default_scale(q) if config.scale is None else config.scale
  tuning, default = config.tuning or MlaPrefillTuning(), default_tuning()
  if config.impl == "xla":
    return _blockwise(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k, scale=scale,
                      block_q=tuning.block_q or default.block_q, block_k=tuning.block_k or default.block_k)
  return _kernel_path(q, k_nope, k_rope, v, cu_seqlens, cu_seqlens_k, scale=scale,
                      block_k=tuning.kernel_block_k or default.kernel_block_k,
                      num_stages=tuning.num_stages or default.num_stages, interpret=config.impl == "interpret")

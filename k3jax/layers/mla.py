"""NoPE multi-head latent attention (HF ``KimiMLAAttention``; K3 adds q-LoRA and an output gate).

``q = q_b(norm(q_a x))`` (or ``q_proj x``) split into ``q_nope [dn] | q_pe [dr]``;
``[c | k_pe] = kv_a_proj_with_mqa x``, ``c = kv_a_layernorm(c)``; ``kv_b_proj`` holds ``W_UK [R, H, dn]``
and ``W_UV [R, H, dv]``. Nothing is rotated (NoPE); the ``dr`` slice is shared by all heads.

* Prefill (non-absorbed): ``k = [c W_UK | k_pe]``, ``v = c W_UV``, causal attention of the new tokens of each
  packed sequence (``mla_prefill_attention``, never a ``[T, T]`` array: its Mosaic GPU kernel with 16-bit
  activations, its blockwise XLA path otherwise; per device on its heads on a mesh). A sequence that already
  has cached tokens (a chunked prefill, a prefix-cache hit) reads them back from the cache and up-projects
  them the same way: its new tokens are the last queries over all its keys. Up-projecting the prefix costs
  ``R x H x (dn + dv)`` multiply-adds per cached token, far less than the absorbed form's larger attention
  (``R + dr`` and ``R`` wide instead of ``dn + dr`` and ``dv``) for every new token.
* Decode (absorbed): ``q_abs = [W_UK q_nope | q_pe]`` against the cached rows ``[c | k_pe]`` with
  ``mla_decode``, then ``o = o_lat W_UV``.

Both read the latent rounded to the cache dtype, so a prefilled and a decoded token see the same keys.
The cache is read with ``k3jax.ops.mesh_mla_decode`` / ``mesh_read_rows`` and written with ``mesh_write_rows``: the
plain paged ops without a mesh, the DCP layout (tokens split over devices, ``k3jax.dcp``) on one set by
``jax.set_mesh``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import dcp, nn_util, ops
from k3jax.config import PAGE_SIZE, K3Config
from k3jax.layers.norms import RMSNorm
from pallas_kernels.mla import cache_format


class KvBProj(nnx.Module):
  """HF ``kv_b_proj`` ``[H*(dn+dv), R]`` stored split: ``w_uk [R, H, dn]`` and ``w_uv [R, H, dv]``."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    r, h = cfg.kv_lora_rank, cfg.num_attention_heads
    init = nn_util.fan_in_normal(r)
    self.w_uk = nn_util.param(rngs, init, (r, h, cfg.qk_nope_head_dim), cfg.param_dtype,
                              ("kv_lora", "heads", "qk_nope_dim"))
    self.w_uv = nn_util.param(rngs, init, (r, h, cfg.v_head_dim), cfg.param_dtype,
                              ("kv_lora", "heads", "v_head_dim"))


class MlaLayer(nnx.Module):
  """One MLA layer over the paged latent cache ``[pages, 64, R + dr]``."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h = cfg.hidden_size, cfg.num_attention_heads
    dqk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    lin = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    norm = dict(eps=cfg.latent_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    if cfg.q_lora_rank is None:
      self.q_proj = nn_util.Linear((d,), (h, dqk), ("embed", "heads", "qk_head_dim"), **lin)
    else:
      self.q_a_proj = nn_util.Linear((d,), (cfg.q_lora_rank,), ("embed", "q_lora"), **lin)
      self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, name="q_lora", **norm)
      self.q_b_proj = nn_util.Linear((cfg.q_lora_rank,), (h, dqk), ("q_lora", "heads", "qk_head_dim"), **lin)
    self.kv_a_proj_with_mqa = nn_util.Linear((d,), (cfg.kv_lora_rank + cfg.qk_rope_head_dim,),
                                             ("embed", "kv_latent"), **lin)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, name="kv_lora", **norm)
    self.kv_b_proj = KvBProj(cfg, rngs=rngs)
    if cfg.mla_use_output_gate:
      self.g_proj = nn_util.Linear((d,), (h, dv), ("embed", "heads", "v_head_dim"), **lin)
    self.o_proj = nn_util.Linear((h, dv), (d,), ("heads", "v_head_dim", "embed"), **lin)

  def _query(self, x: jax.Array) -> jax.Array:
    """``[M, H, dn + dr]`` in ``cfg.dtype``."""
    if self.cfg.q_lora_rank is None:
      return self.q_proj(x)
    return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

  def _latent(self, x: jax.Array) -> jax.Array:
    """Cache rows of ``[c | k_pe]``: ``[M, cfg.cache_row_width]`` in ``cfg.cache_dtype`` (fp8 rows carry their
    scales, ``cache_format``)."""
    r = self.cfg.kv_lora_rank
    a = self.kv_a_proj_with_mqa(x)
    c = self.kv_a_layernorm(a[:, :r])
    return cache_format.quantize_rows(jnp.concatenate([c, a[:, r:]], axis=-1), self.cfg.cache_dtype, r)

  def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
    """Optional sigmoid output gate (f32) on ``o [M, H, dv]``, then ``o_proj``."""
    if self.cfg.mla_use_output_gate:
      o = o.astype(jnp.float32) * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32))
    return self.o_proj(o.astype(self.cfg.dtype))

  def _weights(self) -> tuple[jax.Array, jax.Array]:
    return tuple(w[...].astype(self.cfg.dtype) for w in (self.kv_b_proj.w_uk, self.kv_b_proj.w_uv))

  def _attend_cache(self, q: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                    seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Absorbed attention of ``q [M, H, dn + dr]`` over ``seq_lens [M]`` cached rows of ``block_table [M, *]``.

    Returns ``o [M, H, dv]`` f32 and ``lse [M, H]`` f32 (``(0, -inf)`` for an empty context)."""
    cfg = self.cfg
    dn = cfg.qk_nope_head_dim
    w_uk, w_uv = self._weights()
    q_lat = jnp.einsum("mhd,rhd->mhr", q[..., :dn], w_uk, preferred_element_type=jnp.float32)
    q_abs = jnp.concatenate([q_lat.astype(cfg.dtype), q[..., dn:]], axis=-1)
    # The op's config carries the model's scale (dn + dr) ** -0.5: q_abs alone (R + dr wide) cannot give it.
    o_lat, lse = ops.mesh_mla_decode(q_abs, kv_cache, block_table, seq_lens, config=cfg.mla_op_config())
    return jnp.einsum("mhr,rhv->mhv", o_lat, w_uv, preferred_element_type=jnp.float32), lse

  @staticmethod
  def _write(kv_cache: jax.Array, rows: jax.Array, block_table: jax.Array, seq: jax.Array,
             pos: jax.Array) -> jax.Array:
    """Row ``i`` to token ``pos[i]`` of sequence ``seq[i]``: the paged layout, or its DCP form on a mesh."""
    return ops.mesh_write_rows(kv_cache, rows, block_table, seq, pos)

  def _keys(self, kv_cache: jax.Array, block_table: jax.Array, cu_seqlens: jax.Array, prefix_lens: jax.Array,
            num_rows: int) -> tuple[jax.Array, jax.Array]:
    """The cached latent rows of every sequence with new tokens (its prefix, then its new tokens, written just
    before), packed sequence by sequence into ``num_rows`` rows: ``[num_rows, R + dr]`` and ``cu_seqlens_k
    [N + 1]``. Rows past the last sequence's are zeros."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    cu_k = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            jnp.cumsum(jnp.where(lens > 0, prefix_lens + lens, 0)).astype(jnp.int32)])
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_k, r, side="right") - 1, 0, lens.shape[0] - 1).astype(jnp.int32)
    used = r < cu_k[-1]
    return ops.mesh_read_rows(kv_cache, block_table, jnp.where(used, seq, -1),
                              jnp.where(used, r - cu_k[seq], -1)), cu_k

  def prefill(self, x: jax.Array, kv_cache: jax.Array, *, seq: jax.Array, pos: jax.Array,
              block_table: jax.Array, prefix_lens: jax.Array, prefix_rows: int | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """Non-absorbed causal attention over packed sequences (and their cached prefix); writes their rows.

    Without a cached prefix the keys are the new tokens' own. With one (a chunked prefill, a prefix-cache hit)
    each sequence's keys are all its cached rows, read back from the cache after the new rows are written:
    its ``prefix_lens[n]`` earlier tokens and its new ones, up-projected to ``k_nope``/``v`` like the new
    tokens (the same latent, rounded to the cache dtype), and the new tokens are its last queries.

    Args:
      x: ``[T, D]`` normalised hidden states. kv_cache: ``[pages, 64, cfg.cache_row_width]``.
      seq: ``[T]`` int32 sequence of each token, non-decreasing (tokens packed sequence by sequence).
      pos: ``[T]`` int32 position of each token in its sequence (consecutive within a sequence).
      block_table: ``[N, max_pages]`` int32.
      prefix_lens: ``[N]`` int32 tokens each sequence had cached before this call (0: a fresh sequence).
      prefix_rows: static bound on the cached prefix tokens read back, summed over the sequences with new
        tokens; 0: no sequence has a prefix (no read). None: the whole capacity of every sequence
        (``N * max_pages * 64``, times the devices of the ambient mesh). ``ModelStep.prefill`` passes the sum
        from the host, rounded up to a power of two (a few compiled variants). Too small a bound makes the
        output NaN, never silently short.

    Returns:
      ``[T, D]`` in ``cfg.dtype`` and the updated cache.
    """
    cfg = self.cfg
    r = cfg.kv_lora_rank
    q = self._query(x)
    rows = self._latent(x)
    kv_cache = self._write(kv_cache, rows, block_table, seq, pos)
    # Tokens are packed sequence by sequence (``seq`` non-decreasing), so sequence n starts at the first token
    # with seq >= n; within it ``pos`` grows with the token index, so causal by index is causal by position.
    cu_seqlens = jnp.searchsorted(seq, jnp.arange(block_table.shape[0] + 1, dtype=seq.dtype),
                                  side="left").astype(jnp.int32)
    if prefix_rows is None:
      prefix_rows = dcp.capacity(block_table.shape[1], page_size=PAGE_SIZE) * block_table.shape[0]
    if prefix_rows:
      lat, cu_k = self._keys(kv_cache, block_table, cu_seqlens, prefix_lens, x.shape[0] + prefix_rows)
    else:
      lat, cu_k = rows, None
    lat = cache_format.dequantize_rows(lat, r).astype(cfg.dtype)
    w_uk, w_uv = self._weights()
    k_nope = jnp.einsum("tr,rhd->thd", lat[:, :r], w_uk, preferred_element_type=jnp.float32).astype(cfg.dtype)
    v = jnp.einsum("tr,rhd->thd", lat[:, :r], w_uv, preferred_element_type=jnp.float32).astype(cfg.dtype)
    o, _ = ops.mesh_mla_prefill_attention(q, k_nope, lat[:, r:], v, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_k,
                                          config=cfg.mla_prefill_op_config())
    if cu_k is not None:  # keys past the bound were not read: say so rather than attend to part of them
      o = jnp.where(cu_k[-1] > lat.shape[0], jnp.nan, o)
    return self._output(x, o), kv_cache

  def decode(self, x: jax.Array, kv_cache: jax.Array, *, block_table: jax.Array, seq_lens: jax.Array,
             active: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Absorbed decode of one new token per sequence at position ``seq_lens[n]``.

    Args:
      x: ``[N, D]``. kv_cache: ``[pages, 64, cfg.cache_row_width]``. block_table: ``[N, max_pages]`` int32.
      seq_lens: ``[N]`` int32 tokens cached before this step.
      active: ``[N]`` bool or None (all): an inactive row writes nothing and attends to nothing (its output is
        then meaningless; the model masks its logits).

    Returns:
      ``[N, D]`` in ``cfg.dtype`` and the updated cache.
    """
    q = self._query(x)
    rows = jnp.arange(x.shape[0])
    lens = seq_lens + 1
    if active is not None:
      rows, lens = jnp.where(active, rows, -1), jnp.where(active, lens, 0)
    kv_cache = self._write(kv_cache, self._latent(x), block_table, rows, seq_lens)
    o, _ = self._attend_cache(q, kv_cache, block_table, lens)
    return self._output(x, o), kv_cache

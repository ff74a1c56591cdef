"""The Kimi-Linear / Kimi-K3 text model: decoder layer, model, jitted ``prefill`` / ``decode``.

Parameter paths follow the HF names without the ``model.`` prefix (``embed_tokens``,
``layers.{i}.self_attn.q_proj.kernel``, ``layers.{i}.block_sparse_moe.experts.w1``, ``norm``, ``lm_head``);
``k3jax.nn_util.logical_axes(model)`` lists them with their logical axis names.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import dcp, nn_util, sharding
from k3jax.cache import Checkpoints, KdaState, ModelCache
from k3jax.config import KDA, MLA, PAGE_SIZE, K3Config
from k3jax.layers.attn_res import AttnResSite
from k3jax.layers.kda import KdaLayer
from k3jax.layers.mla import MlaLayer
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norms import RMSNorm
from pallas_kernels import util
from pallas_kernels.kda import checks

# ``attend(self_attn, h, entry) -> (y, entry)``: the layer's attention (prefill or decode) on the normalised
# ``h [M, D]`` with its cache entry (``KdaState`` or the MLA latent cache), returning the updated entry.
Attend = Callable[[nnx.Module, jax.Array, object], tuple[jax.Array, object]]


def _check_token_ids(tokens: jax.Array, vocab_size: int) -> None:
  """Token ids in ``[0, vocab_size)`` when concrete: the embedding gather would wrap or clamp any other id."""
  ids = util.concrete(tokens)
  if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"tokens must be ids in [0, vocab_size = {vocab_size}), got values in "
                     f"[{ids.min()}, {ids.max()}]")


def check_prefill_inputs(tokens: jax.Array, cu_seqlens: jax.Array, cache: ModelCache, *, vocab_size: int,
                         checkpoints: Checkpoints | None = None, prefix_rows: int | None = None) -> None:
  """The arguments of ``KimiK3Model.prefill``: shapes and dtypes always, index values when they are concrete.

  Values are checked on the host (``cache.seq_lens`` is copied from the device) only for concrete arrays, so
  under a jit of the caller's the values go unchecked (see ``prefill``).

  Args:
    tokens: ``[T]`` int32 ids in ``[0, vocab_size)``.
    cu_seqlens: ``[N + 1]`` int32, non-decreasing from 0 to T, ``N`` the cache's sequences.
    cache: ``ModelCache``; ``seq_lens[n] + L_n`` must fit its capacity (``dcp.capacity`` on the ambient mesh).
    vocab_size: the real vocabulary (a padded model's ``cfg.vocab_size`` counts padding rows).
    checkpoints: ``Checkpoints`` or None: offsets multiples of 64 in ``(0, L_n]``, slots in ``[-1, P)``,
      distinct and none of them any sequence's ``state_indices`` entry.
    prefix_rows: None or an int >= the cached tokens of the sequences with new tokens.

  Raises:
    ValueError: naming the argument, what was expected and what was given.
  """
  num_seqs, max_pages = cache.block_table.shape
  util.check_shape("tokens", tokens, (None,))
  util.check_dtype("tokens", tokens, (jnp.int32,))
  util.check_shape("cu_seqlens", cu_seqlens, (num_seqs + 1,))
  util.check_dtype("cu_seqlens", cu_seqlens, (jnp.int32,))
  _check_token_ids(tokens, vocab_size)
  t = tokens.shape[0]
  cu, cached = util.concrete(cu_seqlens), util.concrete(cache.seq_lens)
  checks.check_pointer("cu_seqlens", cu, t, f"T = {t}")
  if cu is not None:
    total = np.diff(cu) + (cached if cached is not None else 0)
    # On a mesh the cache is a DCP cache: each block-table row addresses max_pages pages on every device.
    limit = dcp.capacity(max_pages, page_size=PAGE_SIZE)
    if total.max(initial=0) > limit:
      raise ValueError(f"cu_seqlens must give lengths that fit the cache capacity {limit} after the cached "
                       f"tokens {None if cached is None else cached.tolist()}, got {cu.tolist()}")
    slots = util.concrete(cache.state_indices)
    if slots is not None and ((slots < 0) & (np.diff(cu) > 0)).any():
      raise ValueError(f"cu_seqlens must give no tokens to idle rows (cache.state_indices -1), got lengths "
                       f"{np.diff(cu).tolist()} for state_indices {slots.tolist()}")
    _check_pages_held(cache, total)
  if checkpoints is not None:
    _check_checkpoints(t, cu_seqlens, cache, checkpoints)
  if prefix_rows is not None:
    need = _prefix_tokens(cu_seqlens, cache.seq_lens)
    if isinstance(prefix_rows, bool) or not isinstance(prefix_rows, int) or prefix_rows < (need or 0):
      raise ValueError(f"prefix_rows must be an int >= the cached tokens of the sequences with new tokens "
                       f"({'unknown' if need is None else need}), got {prefix_rows!r}")


def _prefix_tokens(cu_seqlens: jax.Array, seq_lens: jax.Array) -> int | None:
  """The cached tokens of the sequences with new tokens, summed; None when either array is traced."""
  cu, cached = util.concrete(cu_seqlens), util.concrete(seq_lens)
  return None if cu is None or cached is None else int(cached[np.diff(cu) > 0].sum())


def needed_prefix_rows(cu_seqlens: jax.Array, seq_lens: jax.Array) -> int | None:
  """The ``prefix_rows`` bound of a prefill from concrete values: its cached prefix tokens rounded up to a power
  of two >= 64 (so that few bounds, each compiled once, serve every batch), 0 when there are none; None when
  either array is traced."""
  total = _prefix_tokens(cu_seqlens, seq_lens)
  return total if not total else max(PAGE_SIZE, 1 << (total - 1).bit_length())


def _check_checkpoints(t: int, cu_seqlens: jax.Array, cache: ModelCache, ckpt: Checkpoints) -> None:
  """``check_prefill_inputs``'s checks of ``checkpoints`` (the KDA ops' own index checks, on the model's pool)."""
  if not cache.kda:
    raise ValueError("checkpoints need KDA layers: this model has none (cfg.layer_types)")
  num_slots = cache.kda[0].recurrent.shape[0]
  cu, seq_slots = util.concrete(cu_seqlens), util.concrete(cache.state_indices)
  # The slots this prefill writes as sequence states: those of sequences with new tokens.
  state_indices = (cache.state_indices if cu is None or seq_slots is None
                   else jnp.asarray(np.where(np.diff(cu) > 0, seq_slots, -1), jnp.int32))
  checks.check_prefill_indices(
      t, num_slots, "cache.kda[l].recurrent", cu_seqlens=cu_seqlens, state_indices=state_indices,
      has_initial_state=cache.seq_lens > 0, checkpoint_indptr=ckpt.indptr, checkpoint_offsets=ckpt.offsets,
      checkpoint_slots=ckpt.slots, int_dtypes=(jnp.int32,), chunk_size=PAGE_SIZE)
  # A checkpoint written into an idle sequence's slot would overwrite that sequence's state.
  ck = util.concrete(ckpt.slots)
  if ck is not None and seq_slots is not None and set(ck.tolist()) & set(seq_slots.tolist()):
    raise ValueError(f"checkpoints.slots must not be any sequence's slot (cache.state_indices "
                     f"{seq_slots.tolist()}), got {ck.tolist()}")


def _check_pages_held(cache: ModelCache, lengths: np.ndarray, active: np.ndarray | None = None) -> None:
  """When concrete, the block-table entries of the pages that sequences of ``lengths`` tokens occupy are page ids
  (>= 0) in the rows ``active`` marks (>= 0; default every row): a row may end in -1 past its pages (a
  scheduler's unallocated tail; writes there are dropped), and the attention would read outside the cache."""
  table = util.concrete(cache.block_table)
  if table is None or not cache.mla:
    return
  mesh = sharding.ambient_mesh()
  n = 1 if mesh is None else sharding.mesh_size(mesh)
  for row, length in enumerate(lengths.tolist()):
    used = table[row, :dcp.pages_per_device(length, n)]
    if (active is None or active[row] >= 0) and (used < 0).any():
      raise ValueError(f"block_table[{row}] must hold page ids >= 0 for the {used.size} pages of its {length} "
                       f"tokens, got {used.tolist()}")


def check_decode_inputs(tokens: jax.Array, cache: ModelCache, *, vocab_size: int,
                        draft_slots: jax.Array | None = None) -> None:
  """The arguments of ``KimiK3Model.decode`` (or, with ``draft_slots``, of ``verify``), checked as
  ``check_prefill_inputs`` checks a prefill's.

  Args:
    tokens: ``[N]`` int32 ids in ``[0, vocab_size)``; ``[N, 1 + S]`` with ``draft_slots``.
    cache: ``ModelCache`` whose every active sequence has room for the step's 1 (or 1 + S) tokens
      (``seq_lens + 1 + S <= capacity``) and holds the pages they land in.
    vocab_size: the real vocabulary.
    draft_slots: ``[N, S]`` int32 or None (decode): see ``_check_draft_slots``.

  Raises:
    ValueError: naming the argument, what was expected and what was given.
  """
  num_seqs, max_pages = cache.block_table.shape
  width = 1
  if draft_slots is None:
    util.check_shape("tokens", tokens, (num_seqs,))
  else:
    util.check_shape("draft_slots", draft_slots, (num_seqs, None))
    util.check_dtype("draft_slots", draft_slots, (jnp.int32,))
    width = draft_slots.shape[1] + 1
    util.check_shape("tokens", tokens, (num_seqs, width))
  util.check_dtype("tokens", tokens, (jnp.int32,))
  _check_token_ids(tokens, vocab_size)
  cached, slots = util.concrete(cache.seq_lens), util.concrete(cache.state_indices)
  limit = dcp.capacity(max_pages, page_size=PAGE_SIZE)
  if cached is not None:
    busy = cached if slots is None else cached[slots >= 0]
    if busy.max(initial=0) + width > limit:
      raise ValueError(f"cache.seq_lens must leave room for {width} more token(s) per active sequence (the cache "
                       f"capacity is {limit}), got {cached.tolist()}")
    _check_pages_held(cache, cached + width, active=slots)
  if draft_slots is not None:
    _check_draft_slots(cache, draft_slots)


def _check_draft_slots(cache: ModelCache, draft_slots: jax.Array) -> None:
  """When concrete: an active row's draft slots are pool slots, distinct over the batch and none of them any
  sequence's ``state_indices`` entry (the verify writes a state into each); an idle row's are all -1."""
  drafts, own = util.concrete(draft_slots), util.concrete(cache.state_indices)
  if drafts is None or own is None:
    return
  if (drafts[own < 0] != -1).any():
    raise ValueError(f"draft_slots must be -1 in idle rows (cache.state_indices -1), got {drafts.tolist()} for "
                     f"state_indices {own.tolist()}")
  used = drafts[own >= 0].ravel()
  num_slots = cache.kda[0].recurrent.shape[0] if cache.kda else 0
  if used.size and (used.min() < 0 or used.max() >= num_slots):
    raise ValueError(f"draft_slots of active rows must be pool slots in [0, P = {num_slots}), got "
                     f"{drafts.tolist()}")
  if len(set(used.tolist())) != used.size or set(used.tolist()) & set(own.tolist()):
    raise ValueError(f"draft_slots must be distinct and none of them a sequence's slot (cache.state_indices "
                     f"{own.tolist()}), got {drafts.tolist()}")


class DecoderLayer(nnx.Module):
  """Pre-norm layer: ``self_attn`` (KDA or MLA) then ``mlp`` (dense) or ``block_sparse_moe``.

  Without attention residuals: ``x += attn(input_layernorm(x))``; ``x += ffn(post_attention_layernorm(x))``.
  With them the stream is ``(prefix_sum, blocks)``: before the attention and before the FFN the input is
  the learned mix of ``{blocks..., prefix_sum}``; at a block start (``layer % attn_res_block_size == 0``)
  the layer input is appended to ``blocks`` and the prefix sum restarts from the attention output.
  """

  def __init__(self, cfg: K3Config, layer: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.layer = layer
    norm = dict(eps=cfg.rms_norm_eps, name="embed", dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
    self.self_attn = (KdaLayer if cfg.layer_types[layer] == KDA else MlaLayer)(cfg, rngs=rngs)
    if cfg.is_moe(layer):
      self.block_sparse_moe = MoE(cfg, rngs=rngs)
    else:
      self.mlp = MLP(cfg, cfg.intermediate_size, rngs=rngs)
    if cfg.attn_res_block_size is not None:
      site = dict(eps=cfg.rms_norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
      self.self_attention_res = AttnResSite(cfg.hidden_size, **site)
      self.mlp_res = AttnResSite(cfg.hidden_size, **site)

  def _ffn(self, x: jax.Array) -> jax.Array:
    return self.block_sparse_moe(x) if self.cfg.is_moe(self.layer) else self.mlp(x)

  def __call__(self, x: jax.Array, blocks: tuple[jax.Array, ...], entry,
               attend: Attend) -> tuple[jax.Array, tuple[jax.Array, ...], object]:
    """Runs the layer.

    Args:
      x: ``[M, D]`` residual stream (the prefix sum with attention residuals), ``cfg.dtype``.
      blocks: depth checkpoints of the attention residuals (empty without them).
      entry: this layer's cache entry (``KdaState`` or the MLA latent cache).
      attend: ``attend(self_attn, h, entry) -> (y, entry)``, the attention (prefill or decode) on the
        normalised ``h [M, D]``.

    Returns:
      The new ``x``, ``blocks`` and ``entry``.
    """
    if self.cfg.attn_res_block_size is None:
      a, entry = attend(self.self_attn, self.input_layernorm(x), entry)
      x = x + a
      return x + self._ffn(self.post_attention_layernorm(x)), blocks, entry
    h = self.self_attention_res(x, blocks)
    prefix = x
    if self.cfg.is_attn_res_checkpoint(self.layer):
      blocks, prefix = blocks + (x,), None
    a, entry = attend(self.self_attn, self.input_layernorm(h), entry)
    prefix = a if prefix is None else prefix + a
    h = self.mlp_res(prefix, blocks)
    return prefix + self._ffn(self.post_attention_layernorm(h)), blocks, entry


def empty_prefill_logits(num_seqs: int, vocab_size: int, last_only: bool) -> jax.Array:
  """The logits of a prefill of no token: ``[0, vocab]``, or with ``last_only`` ``[N, vocab]`` NaN (no sequence
  has a last new token)."""
  return jnp.full((num_seqs, vocab_size), jnp.nan, jnp.float32) if last_only else jnp.zeros((0, vocab_size),
                                                                                             jnp.float32)


class KimiK3Model(nnx.Module):
  """Embedding, decoder layers, (output attention residual mix), final norm and LM head.

  ``prefill`` / ``decode`` return f32 logits and the updated ``ModelCache``; wrap them with
  ``k3jax.prefill`` / ``k3jax.decode`` (index values checked on the host, then jitted with the cache donated).
  """

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nn_util.param(rngs, nn_util.small_normal(1.0), (cfg.vocab_size, cfg.hidden_size),
                                      cfg.param_dtype, ("vocab", "embed"))
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
    if cfg.attn_res_block_size is not None:
      self.output_attn_res = AttnResSite(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.param_dtype,
                                         rngs=rngs)
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, name="embed", dtype=cfg.dtype,
                        param_dtype=cfg.param_dtype, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head = nn_util.Linear((cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"),
                                    dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)

  def _run(self, tokens: jax.Array, cache: ModelCache, attend_kda: Attend, attend_mla: Attend,
           rows: jax.Array | None = None) -> tuple[jax.Array, ModelCache]:
    """Embedding, layers (each with its cache entry and the attention of its kind), head.

    Returns ``logits [M, vocab]`` f32 (``[len(rows), vocab]`` of the hidden rows ``rows`` when given) and
    ``cache`` with every layer's new entry.
    """
    cfg = self.cfg
    x = self.embed_tokens[...][tokens].astype(cfg.dtype)
    blocks: tuple[jax.Array, ...] = ()
    entries = {KDA: list(cache.kda), MLA: list(cache.mla)}
    index = {KDA: 0, MLA: 0}  # next entry of each kind, in layer order
    for layer, layer_type in zip(self.layers, cfg.layer_types):
      kind = KDA if layer_type == KDA else MLA
      j = index[kind]
      x, blocks, entries[kind][j] = layer(x, blocks, entries[kind][j], attend_kda if kind == KDA else attend_mla)
      index[kind] += 1
    if cfg.attn_res_block_size is not None:
      x = self.output_attn_res(x, blocks)
    if rows is not None:  # the final norm and the head only where logits are asked for
      x = x[rows]
    x = self.norm(x)
    head = self.embed_tokens[...].T if cfg.tie_word_embeddings else self.lm_head.kernel[...]
    logits = jnp.dot(x, head.astype(cfg.dtype), preferred_element_type=jnp.float32)
    return logits, cache.replace(kda=tuple(entries[KDA]), mla=tuple(entries[MLA]))

  def prefill(self, tokens: jax.Array, cu_seqlens: jax.Array, cache: ModelCache, *,
              last_only: bool = False, checkpoints: Checkpoints | None = None,
              prefix_rows: int | None = None) -> tuple[jax.Array, ModelCache]:
    """Prefill of a packed varlen batch; sequence n of the batch extends sequence n of the cache.

    A sequence with ``seq_lens[n] == 0`` starts fresh; one with cached tokens continues from them (chunked
    prefill: its KDA state and conv window are read, its new tokens attend to its cached latent rows).
    ``L_n == 0`` leaves sequence n untouched. Restart a sequence by setting its ``seq_lens`` entry to 0.

    Args:
      tokens: ``[T]`` int32 token ids in ``[0, vocab_size)`` of N packed sequences (T = 0 allowed).
      cu_seqlens: ``[N + 1]`` int32 with ``cu_seqlens[0] = 0``, non-decreasing, ``cu_seqlens[N] = T``;
        ``N`` equals the cache's number of sequences and ``seq_lens[n] + L_n`` fits the cache capacity
        (``max_pages * 64`` tokens, times the devices of the ambient mesh for a DCP cache).
      cache: ``ModelCache``.
      last_only: return only each sequence's last new token's logits, ``[N, vocab]`` (NaN rows for sequences
        with ``L_n = 0``). What a server needs to sample; at long T the full ``[T, vocab]`` f32 logits are the
        largest array of the step (a 128K-token prompt at vocab 163840: 80 GiB).
      checkpoints: ``Checkpoints`` or None: every KDA layer also writes its recurrent and conv states after
        the given offsets into the given pool slots (what ``k3jax.prefix_cache`` keeps for later prompts).
      prefix_rows: static bound on the cached tokens the MLA layers read back (``MlaLayer.prefill``): at least
        the sum of ``seq_lens[n]`` over the sequences with new tokens. None: ``needed_prefix_rows(cu_seqlens,
        seq_lens)`` when both are concrete, else every sequence's whole capacity (``ModelStep.prefill``, under
        its jit, passes the computed bound).

    Returns:
      ``logits [T, vocab]`` (``[N, vocab]`` with ``last_only``) f32 and the updated cache (``seq_lens + L``;
      the same cache when T = 0).

    Raises:
      ValueError: from ``check_prefill_inputs``; index values only when they are concrete (``k3jax.prefill``
        checks them before its jit).
    """
    check_prefill_inputs(tokens, cu_seqlens, cache, vocab_size=self.cfg.vocab_size, checkpoints=checkpoints,
                         prefix_rows=prefix_rows)
    if prefix_rows is None:
      prefix_rows = needed_prefix_rows(cu_seqlens, cache.seq_lens)
    t = tokens.shape[0]
    if t == 0:
      # Every L_n is 0: no sequence changes, and no layer has a row to run on.
      return empty_prefill_logits(cu_seqlens.shape[0] - 1, self.cfg.vocab_size, last_only), cache
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = (jnp.searchsorted(cu_seqlens, jnp.arange(t, dtype=jnp.int32), side="right") - 1).astype(jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32) - cu_seqlens[seq] + cache.seq_lens[seq]
    # Empty sequences get slot -1: the ops then neither read nor write their state.
    slots = jnp.where(lens > 0, cache.state_indices, -1)
    has_initial_state = cache.seq_lens > 0

    def kda_fn(attn: KdaLayer, h, state: KdaState):
      return attn.prefill(h, state, cu_seqlens=cu_seqlens, state_indices=slots,
                          has_initial_state=has_initial_state, checkpoints=checkpoints)

    def mla_fn(attn: MlaLayer, h, kv):
      return attn.prefill(h, kv, seq=seq, pos=pos, block_table=cache.block_table, prefix_lens=cache.seq_lens,
                          prefix_rows=prefix_rows)

    rows = jnp.maximum(cu_seqlens[1:] - 1, 0) if last_only else None
    logits, cache = self._run(tokens, cache, kda_fn, mla_fn, rows)
    if last_only:
      logits = jnp.where((lens > 0)[:, None], logits, jnp.nan)
    return logits, cache.replace(seq_lens=cache.seq_lens + lens)

  def decode(self, tokens: jax.Array, cache: ModelCache) -> tuple[jax.Array, ModelCache]:
    """One decode step: token n extends sequence n of the cache.

    Args:
      tokens: ``[N]`` int32 ids in ``[0, vocab_size)``. cache: ``ModelCache`` (every sequence must have room for
        one more token). An idle row (``state_indices[n] == -1``, e.g. one ``k3jax.serving`` has not admitted a
        request into) is skipped: nothing of it is read or written.

    Returns:
      ``logits [N, vocab]`` f32 (NaN rows for idle rows) and the updated cache (``seq_lens + 1`` for the
      active rows).

    Raises:
      ValueError: from ``check_decode_inputs``; index values only when they are concrete (``k3jax.decode``
        checks them before its jit).
    """
    check_decode_inputs(tokens, cache, vocab_size=self.cfg.vocab_size)
    active = cache.state_indices >= 0

    def kda_fn(attn: KdaLayer, h, state: KdaState):
      return attn.decode(h, state, state_indices=cache.state_indices)

    def mla_fn(attn: MlaLayer, h, kv):
      return attn.decode(h, kv, block_table=cache.block_table, seq_lens=cache.seq_lens, active=active)

    logits, cache = self._run(tokens, cache, kda_fn, mla_fn)
    logits = jnp.where(active[:, None], logits, jnp.nan)
    return logits, cache.replace(seq_lens=cache.seq_lens + active.astype(jnp.int32))

  def verify(self, tokens: jax.Array, cache: ModelCache, draft_slots: jax.Array) -> tuple[jax.Array, ModelCache]:
    """Speculative verify: scores 1 + S tokens per sequence in one step; ``k3jax.cache.accept`` then keeps the
    accepted ones.

    Row n's tokens are the token the previous step sampled (column 0, always kept) and S draft tokens. Every
    KDA layer runs its ops' speculative forms on the slots ``[state_indices[n] | draft_slots[n]]``: the
    recurrent and conv states after token t go to column t (so the sequence's own slot holds the state after
    token 0, and a draft slot one after a draft). The MLA layers run the ``(1 + S) N`` tokens as one decode
    batch: token t writes its latent row at position ``seq_lens[n] + t`` and attends to the ``seq_lens[n] + t +
    1`` rows up to it. ``seq_lens`` does not move: ``accept`` advances it by the accepted count, and the rows
    of rejected tokens, past it, are never read and are overwritten by the next step.

    Args:
      tokens: ``[N, 1 + S]`` int32 ids in ``[0, vocab_size)``.
      cache: ``ModelCache``; every active row has room for, and holds the pages of, ``seq_lens + 1 + S`` tokens.
        Idle rows (``state_indices`` -1) are skipped as in ``decode``.
      draft_slots: ``[N, S]`` int32 pool slots the states after the drafts go to: distinct, none of them a
        sequence's slot; -1 throughout in idle rows.

    Returns:
      ``logits [N, 1 + S, vocab]`` f32 (row t scores the token after token t, as ``decode`` of the tokens one
      by one would; NaN for idle rows) and the updated cache.

    Raises:
      ValueError: from ``check_decode_inputs``; index values only when they are concrete (``k3jax.verify``
        checks them before its jit).
    """
    check_decode_inputs(tokens, cache, vocab_size=self.cfg.vocab_size, draft_slots=draft_slots)
    n, width = tokens.shape
    active = cache.state_indices >= 0
    slots = jnp.concatenate([cache.state_indices[:, None], draft_slots], axis=1)
    # The ops' speculative forms read the state before the step from column num_accepted - 1: the own slot.
    first = jnp.ones((n,), jnp.int32)
    row = jnp.repeat(jnp.arange(n, dtype=jnp.int32), width)
    offset = jnp.tile(jnp.arange(width, dtype=jnp.int32), n)

    def kda_fn(attn: KdaLayer, h, state: KdaState):
      return attn.decode(h, state, state_indices=slots, num_accepted=first)

    def mla_fn(attn: MlaLayer, h, kv):
      return attn.decode(h, kv, block_table=cache.block_table[row], seq_lens=cache.seq_lens[row] + offset,
                         active=active[row])

    logits, cache = self._run(tokens.reshape(-1), cache, kda_fn, mla_fn)
    return jnp.where(active[:, None, None], logits.reshape(n, width, -1), jnp.nan), cache

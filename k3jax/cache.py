"""Inference caches: the KDA state pool (recurrent + conv) and the paged MLA latent cache.

Layout (one ``ModelCache`` for the whole model; ``N`` sequences, ``P`` pool slots):

* per KDA layer, ``KdaState``: ``recurrent [P, H, V, K]`` in ``state_dtype`` (V-first, as the KDA ops) and
  ``conv_q`` / ``conv_k`` / ``conv_v [P, W - 1, H*K]`` in ``conv_dtype`` (the last ``W - 1`` pre-conv rows).
* per MLA layer, ``kv [pages, 64, R + dr]`` in ``cache_dtype``: row = ``[kv_a_layernorm(c) | k_pe]``
  (``[pages, 64, R + dr + 64]`` for an fp8 cache: the row's scales follow its values, see
  ``pallas_kernels.mla.cache_format``).
* shared: ``state_indices [N]`` (pool slot of each sequence; -1: an idle row that decode skips),
  ``block_table [N, max_pages]`` (page ids of each sequence), ``seq_lens [N]`` (tokens cached per sequence).

Slots and pages are handed out on the host by ``SlotAllocator``; the device arrays only see their ids.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import KDA, PAGE_SIZE, K3Config
from pallas_kernels import util


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KdaState:
  """State of one KDA layer for every pool slot (shapes in the module docstring)."""

  recurrent: jax.Array
  conv_q: jax.Array
  conv_k: jax.Array
  conv_v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
  """Everything ``prefill`` / ``decode`` read and write; a pytree (donate it to jit)."""

  kda: tuple[KdaState, ...]
  mla: tuple[jax.Array, ...]
  state_indices: jax.Array
  block_table: jax.Array
  seq_lens: jax.Array

  def replace(self, **changes) -> ModelCache:
    return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Checkpoints:
  """Where a prefill saves KDA checkpoint states (every KDA layer's recurrent and conv states), as CSR over the
  batch's sequences: sequence n's checkpoints are entries ``indptr[n]:indptr[n + 1]``.

  Attributes:
    indptr: ``[N + 1]`` int32, non-decreasing from 0 to M.
    offsets: ``[M]`` int32 token counts from the start of the sequence's *new* tokens, multiples of 64 in
      ``(0, L_n]``: the states after ``seq_lens[n] + offsets[i]`` tokens go to ``slots[i]``.
    slots: ``[M]`` int32 pool slots (-1: skip); distinct, and none of them a slot this prefill reads or writes
      as a sequence's state.
  """

  indptr: jax.Array
  offsets: jax.Array
  slots: jax.Array

  @classmethod
  def from_lists(cls, per_seq: list[list[tuple[int, int]]]) -> Checkpoints:
    """From ``per_seq[n] = [(offset, slot), ...]`` for each sequence of the batch."""
    flat = [pair for seq in per_seq for pair in seq]
    indptr = np.concatenate([[0], np.cumsum([len(seq) for seq in per_seq])])
    offsets, slots = (np.asarray([pair[i] for pair in flat], np.int32) for i in (0, 1))
    return cls(jnp.asarray(indptr, jnp.int32), jnp.asarray(offsets), jnp.asarray(slots))


def copy_slots(cache: ModelCache, src: jax.Array, dst: jax.Array) -> ModelCache:
  """Every KDA layer's recurrent and conv states of pool slot ``src[i]`` copied into slot ``dst[i]``.

  What a prefix-cache hit does before prefilling the rest of a prompt: the sequence continues from a copy of a
  checkpoint, so the checkpoint stays intact for the next hit. ``src``, ``dst``: ``[M]`` int32 slots in
  ``[0, P)``, ``dst`` distinct and disjoint from ``src`` (checked by ``check_copy_slots`` when concrete).
  """

  def copy(pool: jax.Array) -> jax.Array:
    return pool.at[dst].set(pool[src], unique_indices=True)

  return cache.replace(kda=tuple(jax.tree.map(copy, state) for state in cache.kda))


def check_copy_slots(cache: ModelCache, src: jax.Array, dst: jax.Array) -> None:
  """``copy_slots``'s arguments: ``[M]`` int32 each; when concrete, slots in ``[0, P)``, ``dst`` distinct and
  disjoint from ``src``.

  Raises:
    ValueError: naming the argument, what was expected and what was given.
  """
  num_slots = cache.kda[0].recurrent.shape[0] if cache.kda else 0
  for name, x in (("src", src), ("dst", dst)):
    util.check_shape(name, x, (src.shape[0],))
    util.check_dtype(name, x, (jnp.int32,))
    v = util.concrete(x)
    if v is not None and v.size and (v.min() < 0 or v.max() >= num_slots):
      raise ValueError(f"{name} must be pool slots in [0, P = {num_slots}), got values in [{v.min()}, {v.max()}]")
  s, d = util.concrete(src), util.concrete(dst)
  if d is not None and len(set(d.tolist())) != d.size:
    raise ValueError(f"dst must be distinct slots, got {d.tolist()}")
  if s is not None and d is not None and set(s.tolist()) & set(d.tolist()):
    raise ValueError(f"dst must not overlap src, got src {s.tolist()} and dst {d.tolist()}")


def accept(cache: ModelCache, draft_slots: jax.Array, num_accepted: jax.Array) -> tuple[ModelCache, jax.Array]:
  """The accept step after ``KimiK3Model.verify``: each active sequence keeps its first ``num_accepted[n]``
  tokens and rolls back the rest.

  Verify left the KDA and conv states after token t of row n in column t of ``[state_indices[n] |
  draft_slots[n]]``. Keeping ``a`` tokens makes the slot of column ``a - 1`` the sequence's slot: the two ids
  trade places (``state_indices[n]`` and ``draft_slots[n, a - 2]`` when ``a > 1``), so no state is copied and
  the row keeps the same set of slots; the other draft slots hold rejected states that the next verify
  overwrites. ``seq_lens[n]`` grows by ``a``: the latent rows of rejected tokens lie past it, are never read,
  and the next step writes over them. Idle rows do not change. Checked by ``check_accept`` when concrete.

  Args:
    cache: ``ModelCache`` after ``verify``.
    draft_slots: ``[N, S]`` int32, the draft slots passed to ``verify``.
    num_accepted: ``[N]`` int32 tokens kept per active row, in ``[1, 1 + S]`` (ignored for idle rows).

  Returns:
    The cache (``state_indices`` and ``seq_lens`` changed) and the draft slots for the next verify, ``[N, S]``.
  """
  check_accept(cache, draft_slots, num_accepted)
  own = cache.state_indices
  active = own >= 0
  kept = jnp.where(active, num_accepted, 1)
  seq_lens = cache.seq_lens + jnp.where(active, kept, 0)
  drafts = draft_slots.shape[1]
  if drafts == 0:
    return cache.replace(seq_lens=seq_lens), draft_slots
  col = jnp.clip(kept - 2, 0, drafts - 1)
  swap = kept > 1
  new_own = jnp.where(swap, jnp.take_along_axis(draft_slots, col[:, None], axis=1)[:, 0], own)
  traded = swap[:, None] & (jnp.arange(drafts)[None, :] == col[:, None])
  return (cache.replace(state_indices=new_own, seq_lens=seq_lens),
          jnp.where(traded, own[:, None], draft_slots))


def check_accept(cache: ModelCache, draft_slots: jax.Array, num_accepted: jax.Array) -> None:
  """``accept``'s arguments: ``draft_slots [N, S]`` and ``num_accepted [N]`` int32; when concrete,
  ``num_accepted`` in ``[1, 1 + S]`` for every active row.

  Raises:
    ValueError: naming the argument, what was expected and what was given.
  """
  num_seqs = cache.state_indices.shape[0]
  util.check_shape("draft_slots", draft_slots, (num_seqs, None))
  util.check_shape("num_accepted", num_accepted, (num_seqs,))
  for name, x in (("draft_slots", draft_slots), ("num_accepted", num_accepted)):
    util.check_dtype(name, x, (jnp.int32,))
  a, own = util.concrete(num_accepted), util.concrete(cache.state_indices)
  if a is not None and own is not None:
    kept = a[own >= 0]
    if kept.size and (kept.min() < 1 or kept.max() > draft_slots.shape[1] + 1):
      raise ValueError(f"num_accepted must be in [1, 1 + S = {draft_slots.shape[1] + 1}] for active rows, got "
                       f"{a.tolist()} for state_indices {own.tolist()}")


class SlotAllocator:
  """Host-side free list of ``num`` ids (KDA pool slots or MLA pages), lowest ids first."""

  def __init__(self, num: int):
    if num < 1:
      raise ValueError(f"num must be >= 1, got {num}")
    self.num = num
    self._free = list(range(num - 1, -1, -1))

  @property
  def num_free(self) -> int:
    return len(self._free)

  def allocate(self, count: int) -> list[int]:
    if count > len(self._free):
      raise ValueError(f"cannot allocate {count} ids: only {len(self._free)} of {self.num} are free")
    return [self._free.pop() for _ in range(count)]

  def free(self, ids) -> None:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.num or i in self._free]
    if bad:
      raise ValueError(f"ids to free must be allocated ids in [0, {self.num}), got {bad}")
    self._free.extend(sorted(ids, reverse=True))
    self._free.sort(reverse=True)


def init_cache(cfg: K3Config, num_seqs: int, max_seq_len: int, *, num_slots: int | None = None,
               num_pages: int | None = None, slots: SlotAllocator | None = None,
               pages: SlotAllocator | None = None, fill: float = 0.0, idle: bool = False) -> ModelCache:
  """An empty cache for ``num_seqs`` sequences of up to ``max_seq_len`` tokens.

  Args:
    cfg: the model config (dims and the ``state_dtype`` / ``conv_dtype`` / ``cache_dtype``).
    num_seqs: N.
    max_seq_len: capacity per sequence; rounded up to whole pages of 64 tokens.
    num_slots: KDA pool size P (default N). num_pages: MLA pages (default N * pages per sequence).
    slots, pages: allocators to draw from (default: fresh ones of ``num_slots`` / ``num_pages``).
    fill: value of every pool/cache element at start (tests poison unused slots with NaN).
    idle: every row starts idle (``state_indices`` and ``block_table`` all -1; nothing allocated), for a
      scheduler that hands slots and pages out per request (``k3jax.serving``).

  Returns:
    A ``ModelCache`` with ``seq_lens = 0``; sequence n owns the slot and pages the allocators gave it (none when
    ``idle``).
  """
  if num_seqs < 1 or max_seq_len < 1:
    raise ValueError(f"num_seqs and max_seq_len must be >= 1, got {num_seqs} and {max_seq_len}")
  max_pages = util.cdiv(max_seq_len, PAGE_SIZE)
  slots = slots or SlotAllocator(num_slots or num_seqs)
  pages = pages or SlotAllocator(num_pages or num_seqs * max_pages)
  if idle:
    state_indices, block_table = np.full(num_seqs, -1, np.int32), np.full((num_seqs, max_pages), -1, np.int32)
  else:
    state_indices = np.asarray(slots.allocate(num_seqs), np.int32)
    block_table = np.asarray(pages.allocate(num_seqs * max_pages), np.int32).reshape(num_seqs, max_pages)
  h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
  p = slots.num

  def full(shape, dtype):
    return jnp.full(shape, fill, dtype)

  kda = tuple(
      KdaState(recurrent=full((p, h, k, k), cfg.state_dtype),
               **{name: full((p, w - 1, h * k), cfg.conv_dtype) for name in ("conv_q", "conv_k", "conv_v")})
      for t in cfg.layer_types if t == KDA)
  mla = tuple(full((pages.num, PAGE_SIZE, cfg.cache_row_width), cfg.cache_dtype)
              for t in cfg.layer_types if t != KDA)
  return ModelCache(kda=kda, mla=mla, state_indices=jnp.asarray(state_indices),
                    block_table=jnp.asarray(block_table), seq_lens=jnp.zeros((num_seqs,), jnp.int32))

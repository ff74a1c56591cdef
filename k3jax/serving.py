"""Prefix-cached prefill: the device side of ``k3jax.prefix_cache`` for a batch of new requests.

``admit`` puts each request into a row of the ``ModelCache``: it looks the prompt up in the ``PrefixCache``,
gives the row a fresh KDA pool slot and a block table that starts with the hit's shared pages, copies the hit's
checkpoint states into the row's slot, and prefills only the uncached suffix, writing a checkpoint at every
uncached boundary. The shared pages hold whole 64-token pages of the prefix only, so the suffix's latent rows
go to the row's own pages and a shared page is never written. ``finish`` gives a row's slot and pages back.

On a mesh the MLA cache is a DCP cache (``k3jax.dcp``): token ``t`` of a sequence lives on device ``t mod n`` and
one page id names a local page on every device, 64 tokens each. A boundary then ends on whole pages of every
device only at multiples of ``64 n`` tokens: the ``PrefixCache`` is made with ``devices=n`` (its
``page_tokens = 64 n``, and the interval a multiple of it).

Example (``step = k3jax.jit_model_step(model)``; the cache's slots and pages come from the two pools)::

  slots, pages = SlotAllocator(num_slots), PagePool(num_pages)
  cache = init_cache(cfg, N, max_len, num_slots=num_slots, num_pages=num_pages, idle=True)
  pc = PrefixCache(2048, slots=slots, pages=pages)
  logits, cache, seqs = admit(step, cache, pc, [Request(row=0, tokens=prompt, max_new_tokens=256)])
  ...                                                                  # decode with step.decode
  cache = finish(cache, pc, seqs[0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import dcp
from k3jax.cache import Checkpoints, ModelCache
from k3jax.config import PAGE_SIZE
from k3jax.prefix_cache import PrefixCache, PrefixHit, Reservation, _tokens
from k3jax.steps import ModelStep


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt to prefill into row ``row`` of the cache, with room for ``max_new_tokens`` decoded after it."""

  row: int
  tokens: Sequence[int] | np.ndarray
  max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class Admitted:
  """A request in the cache after ``admit``.

  Attributes:
    row: its cache row. slot: its KDA pool slot at admission (``state_indices[row]``; ``k3jax.accept`` may trade
      it for one of the row's draft slots, so ``finish`` frees the row's slot at that time).
    pages: its block table (page ids in token order; it holds one ``PagePool`` reference to each).
    prompt_len: tokens prefilled or taken from the cache. cached_tokens: tokens taken from the cache (skipped).
    new_boundaries: boundaries this prefill added to the prefix cache.
  """

  row: int
  slot: int
  pages: tuple[int, ...]
  prompt_len: int
  cached_tokens: int
  new_boundaries: tuple[int, ...]


def _check_requests(cache: ModelCache, requests: Sequence[Request], devices: int) -> list[np.ndarray]:
  num_seqs, max_pages = cache.block_table.shape
  capacity = dcp.capacity(max_pages, devices)
  prompts = []
  rows = [r.row for r in requests]
  if len(set(rows)) != len(rows) or any(not 0 <= r < num_seqs for r in rows):
    raise ValueError(f"requests' rows must be distinct rows of the cache in [0, {num_seqs}), got {rows}")
  slots = np.asarray(cache.state_indices)
  busy = [r for r in rows if slots[r] >= 0]
  if busy:
    raise ValueError(f"requests' rows must be idle (state_indices -1: finish their sequences first), got rows "
                     f"{busy} with slots {slots[busy].tolist()}")
  for r in requests:
    tokens = _tokens(r.tokens)
    if not tokens.size:
      raise ValueError(f"request for row {r.row}: tokens must not be empty")
    if isinstance(r.max_new_tokens, bool) or not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 0:
      raise ValueError(f"request for row {r.row}: max_new_tokens must be an int >= 0, got {r.max_new_tokens!r}")
    if len(tokens) + r.max_new_tokens > capacity:
      raise ValueError(f"request for row {r.row}: {len(tokens)} prompt + {r.max_new_tokens} new tokens must fit "
                       f"the cache capacity {capacity} (block_table.shape[1] x {PAGE_SIZE} x {devices} devices)")
    prompts.append(tokens)
  return prompts


def _undo(prefix_cache: PrefixCache, plans: list[_Plan]) -> None:
  """Give back everything ``admit`` took for ``plans`` (their prefill did not happen)."""
  for p in plans:
    prefix_cache.abort(p.reservation)
    prefix_cache.pages.release(p.table)
    prefix_cache.slots.free([p.slot])
    if p.hit:
      prefix_cache.release(p.hit)


@dataclasses.dataclass(frozen=True)
class _Plan:
  request: Request
  tokens: np.ndarray
  hit: PrefixHit | None
  slot: int
  table: tuple[int, ...]
  reservation: Reservation


def admit(step: ModelStep, cache: ModelCache, prefix_cache: PrefixCache,
          requests: Sequence[Request]) -> tuple[jax.Array, ModelCache, list[Admitted]]:
  """Prefill ``requests`` (one packed prefill), each starting from its longest cached prefix.

  For each request: ``lookup`` its prompt; a fresh pool slot for its row and
  ``cdiv(len(prompt) + max_new_tokens, 64)`` pages, the first ones the hit's (retained, never written);
  ``reserve`` its uncached boundaries. Then on the device: the hits' checkpoint states copied into the rows'
  slots (``ModelStep.copy_slots``), and one prefill of every suffix with ``seq_lens[row]`` = the cached tokens
  and the reserved boundaries as ``Checkpoints``. Finally ``commit`` the reservations and release the hits.
  Rows not named keep their state, pages and ``seq_lens``.

  Args:
    step: the model's step (``k3jax.jit_model_step(model[, mesh])``).
    cache: the ``ModelCache`` (donated), from ``init_cache(..., idle=True)`` with the pools' sizes; its slots
      and pages are the ones ``prefix_cache.slots`` and ``prefix_cache.pages`` hand out.
    prefix_cache: the ``PrefixCache`` (``devices`` = the step's devices).
    requests: distinct idle rows (``state_indices[row] == -1``: never admitted, or ``finish``-ed).

  Returns:
    ``logits [N, vocab]`` f32 of each row's last prompt token (NaN rows for rows not admitted), the cache, and
    one ``Admitted`` per request (in order).

  Raises:
    ValueError: bad requests, a prefix cache made for another device count, or not enough slots or pages even
      after evicting every unpinned prefix entry; nothing is allocated, and the cache is not donated, then.
  """
  n = step.num_devices
  if prefix_cache.page_tokens != PAGE_SIZE * n:
    raise ValueError(f"prefix_cache must be made with devices={n} (the step's mesh; page_tokens {PAGE_SIZE * n}), "
                     f"got page_tokens {prefix_cache.page_tokens}")
  prompts = _check_requests(cache, requests, n)
  plans: list[_Plan] = []
  try:
    for r, tokens in zip(requests, prompts):
      hit = prefix_cache.lookup(tokens)
      try:
        shared = hit.pages if hit else ()
        need = dcp.pages_per_device(len(tokens) + r.max_new_tokens, n) - len(shared)
        prefix_cache.ensure_free(slots=1, pages=need)
        slot = prefix_cache.slots.allocate(1)[0]
        own = prefix_cache.pages.allocate(need)
        prefix_cache.pages.retain(shared)
        res = prefix_cache.reserve(tokens, hit.num_tokens if hit else 0)
      except ValueError:
        if hit:
          prefix_cache.release(hit)
        raise
      plans.append(_Plan(r, tokens, hit, slot, shared + tuple(own), res))
  except ValueError:
    _undo(prefix_cache, plans)
    raise

  num_seqs = cache.block_table.shape[0]
  state_indices, block_table, seq_lens = (np.array(a) for a in (cache.state_indices, cache.block_table,
                                                                   cache.seq_lens))
  lens = np.zeros(num_seqs, np.int64)
  suffix = [np.zeros(0, np.int32)] * num_seqs
  ckpt: list[list[tuple[int, int]]] = [[] for _ in range(num_seqs)]
  for p in plans:
    row, start = p.request.row, p.reservation.start
    state_indices[row] = p.slot
    block_table[row] = -1  # past the row's pages: writes there are dropped and the checks reject reads
    block_table[row, :len(p.table)] = p.table
    seq_lens[row] = start
    suffix[row] = p.tokens[start:]
    lens[row] = len(p.tokens) - start
    ckpt[row] = list(zip(p.reservation.offsets, p.reservation.slots))
  # The index arrays keep their placement (replicated on a mesh).
  new = cache.replace(**{name: jax.device_put(value.astype(np.int32), getattr(cache, name).sharding)
                         for name, value in (("state_indices", state_indices), ("block_table", block_table),
                                             ("seq_lens", seq_lens))})
  tokens = jnp.asarray(np.concatenate(suffix), jnp.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  checkpoints = Checkpoints.from_lists(ckpt) if any(ckpt) else None
  try:
    # The host checks before any device work: a rejected batch leaves the caller's cache undonated.
    step.check_prefill(tokens, cu, new, checkpoints=checkpoints)
  except ValueError:
    _undo(prefix_cache, plans)
    raise
  hits = [(p.hit.slot, p.slot) for p in plans if p.hit]
  if hits:
    new = step.copy_slots(new, *(jnp.asarray([h[i] for h in hits], jnp.int32) for i in (0, 1)))
  logits, new = step.prefill(tokens, cu, new, last_only=True, checkpoints=checkpoints)
  out = []
  for p in plans:
    added = prefix_cache.commit(p.reservation, p.table)
    if p.hit:
      prefix_cache.release(p.hit)  # the row's slot holds a copy, and the row its own page references
    out.append(Admitted(row=p.request.row, slot=p.slot, pages=p.table, prompt_len=len(p.tokens),
                        cached_tokens=p.reservation.start, new_boundaries=added))
  return logits, new, out


def finish(cache: ModelCache, prefix_cache: PrefixCache, seq: Admitted) -> ModelCache:
  """End a sequence: its row becomes idle (slot and block table -1, ``seq_lens`` 0), and its pool slot (the row's
  current one) and page references go back. Pages the prefix cache still holds stay allocated and are never
  written again through this row; draft slots a speculative decoder took for the row stay the caller's to free.
  Returns the cache with the row idle."""
  row = seq.row
  slot = int(cache.state_indices[row])
  cache = cache.replace(state_indices=cache.state_indices.at[row].set(-1),
                        block_table=cache.block_table.at[row].set(-1), seq_lens=cache.seq_lens.at[row].set(0))
  prefix_cache.pages.release(seq.pages)
  prefix_cache.slots.free([slot])
  return cache

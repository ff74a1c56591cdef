"""Host-side prefix caching: KDA state checkpoints and shared MLA pages of prompt prefixes (plain Python/NumPy).

A prompt is cut into blocks of ``interval`` tokens (a multiple of the 64-token page and KDA chunk). The key of
the boundary after block ``i`` is ``blake2b(key of boundary i - 1 || int32 bytes of block i)``, so one key
identifies the whole prefix up to that boundary: two prompts share a key only if they agree on every token
before it.

What an entry (one cached boundary of ``b`` tokens) holds:

* one KDA pool slot. Every KDA layer's pools in ``ModelCache`` are indexed by the same slot ids (as
  ``state_indices``), so the slot names, in each KDA layer ``l``, ``cache.kda[l].recurrent[slot]`` (the
  recurrent state after ``b`` tokens) and ``cache.kda[l].conv_q/conv_k/conv_v[slot]`` (the conv states after
  ``b`` tokens). A prefill writes it by passing the slot as a ``checkpoint_slots`` entry, at checkpoint offset
  ``b - start``, to ``kda_prefill`` and to the three ``short_conv_prefill`` calls of every KDA layer.
* the ``b // page_tokens`` MLA page ids holding the latent rows of tokens ``[0, b)`` (the same ids in every MLA
  layer, as ``block_table``; ``page_tokens`` is 64, or ``64 * devices`` on a DCP cache). Each entry holds a reference to every page of its prefix; so do the live sequences that
  read them (through ``PagePool``): a page is freed only when no entry and no sequence references it.

Entries are independent (each has its own slot and references all of its pages), so any unpinned one may be
evicted. Eviction takes the least recently used unpinned entry. Every use of a boundary (``lookup``, ``commit``)
also refreshes the cached boundaries before it on the same prompt, shorter ones last, so an ancestor is always
more recent than its cached descendants and eviction removes the ends of chains first; only a pinned
descendant can make an inner boundary go first, which is harmless.

The life of a request (the scheduler's side; the device work is the model's)::

  hit = prefix_cache.lookup(tokens)                  # longest cached boundary < len(tokens), pinned, or None
  start = hit.num_tokens if hit else 0
  prefix_cache.ensure_free(slots=1, pages=n_new)     # evicts unpinned entries if the pools are short
  seq_slot, new_pages = slots.allocate(1)[0], pages.allocate(n_new)
  if hit: pages.retain(hit.pages)                    # the sequence's own references to the shared pages
  block_table = (hit.pages if hit else ()) + tuple(new_pages)
  res = prefix_cache.reserve(tokens, start)          # slots for the uncached boundaries in (start, len]
  # device: copy the state of hit.slot into seq_slot (every KDA layer), then prefill tokens[start:] with
  # has_initial_state = hit is not None, checkpoint_offsets = res.offsets, checkpoint_slots = res.slots
  prefix_cache.commit(res, block_table)              # or abort(res) when the prefill failed
  if hit: prefix_cache.release(hit)                  # the slot was copied; the pages are the sequence's now
  ...                                                # decode; at the end: pages.release(block_table)

The checkpoint memory is large on K3 (69 KDA layers x 96 heads x 128 x 128 x 4 bytes per slot), so the
interval sets the cost per cached token: see ``memory_report``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from k3jax.cache import SlotAllocator
from k3jax.config import KDA, MLA, PAGE_SIZE, K3Config

_KEY_BYTES = 16
_CACHE_IDS = itertools.count()  # tells the handles of different PrefixCache objects apart


def _count(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def _interval(interval, page_tokens: int = PAGE_SIZE) -> int:
  if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1 or interval % page_tokens:
    whole = ("the page size 64 (the KDA chunk)" if page_tokens == PAGE_SIZE else
             f"page_tokens = {page_tokens} (64 tokens x {page_tokens // PAGE_SIZE} devices: whole pages on each)")
    raise ValueError(f"interval must be a positive multiple of {whole}, got {interval!r}")
  return interval


def _tokens(tokens) -> np.ndarray:
  """``tokens`` as a 1-D little-endian int32 array (the bytes the keys hash)."""
  arr = np.asarray(tokens)
  if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
    raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape} of {arr.dtype}")
  if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
    raise ValueError(f"tokens must fit in int32, got values in [{arr.min()}, {arr.max()}]")
  return arr.astype("<i4")


def block_keys(tokens, interval: int) -> list[bytes]:
  """The chained keys of the prefixes of ``tokens`` ending at ``interval``, ``2 * interval``, ... ``<= len``.

  ``keys[i]`` identifies ``tokens[:(i + 1) * interval]``: it hashes ``keys[i - 1]`` with block ``i``.
  """
  arr = _tokens(tokens)
  keys, key = [], b""
  for i in range(len(arr) // interval):
    key = hashlib.blake2b(key + arr[i * interval:(i + 1) * interval].tobytes(), digest_size=_KEY_BYTES).digest()
    keys.append(key)
  return keys


class PagePool:
  """Reference-counted page ids (MLA latent pages) over a ``SlotAllocator`` free list.

  ``allocate`` hands out free ids with one reference each; ``retain`` adds a reference; ``release`` drops one
  and returns an id to the free list when its count reaches zero. The scheduler holds one reference per page of
  each live sequence's block table, the ``PrefixCache`` one per page of each entry.
  """

  def __init__(self, pages: SlotAllocator | int):
    self._ids = pages if isinstance(pages, SlotAllocator) else SlotAllocator(pages)
    self._refs: dict[int, int] = {}

  @property
  def num(self) -> int:
    """All page ids, free or not."""
    return self._ids.num

  @property
  def num_free(self) -> int:
    return self._ids.num_free

  def refcount(self, page: int) -> int:
    """References to ``page`` (0: free)."""
    return self._refs.get(int(page), 0)

  def allocate(self, count: int) -> list[int]:
    """``count`` free ids, one reference each. Raises ValueError when fewer are free."""
    ids = self._ids.allocate(_count("count", count, 0))
    self._refs.update((i, 1) for i in ids)
    return ids

  def retain(self, ids: Sequence[int]) -> None:
    """One more reference to each of ``ids`` (an id named twice gets two). Raises ValueError on a free id."""
    ids = [int(i) for i in ids]
    free = sorted({i for i in ids if i not in self._refs})
    if free:
      raise ValueError(f"cannot retain pages {free}: they are not allocated")
    for i in ids:
      self._refs[i] += 1

  def release(self, ids: Sequence[int]) -> list[int]:
    """Drop one reference to each of ``ids``; returns the ids freed (count reached 0).

    Raises:
      ValueError: an id would drop below zero references (released more often than held); nothing changes.
    """
    drops = collections.Counter(int(i) for i in ids)
    over = sorted(i for i, n in drops.items() if n > self._refs.get(i, 0))
    if over:
      raise ValueError(f"cannot release pages {over}: released more often than referenced "
                       f"(refcounts {[self._refs.get(i, 0) for i in over]})")
    freed = []
    for i, n in drops.items():
      self._refs[i] -= n
      if not self._refs[i]:
        del self._refs[i]
        freed.append(i)
    if freed:
      self._ids.free(freed)
    return freed


@dataclasses.dataclass(frozen=True)
class PrefixHit:
  """A cached boundary, pinned (not evictable) until ``PrefixCache.release``.

  Attributes:
    num_tokens: the boundary: tokens ``[0, num_tokens)`` of the prompt are cached (a multiple of the interval).
    slot: the KDA pool slot holding the recurrent and conv states after ``num_tokens`` tokens in every KDA layer.
    pages: the ``num_tokens // page_tokens`` MLA page ids of those tokens, in order (the start of a block
      table; on a DCP cache each id is a local page on every device).
    cache_id, serial: identify the pin (which cache, which lookup).
  """

  num_tokens: int
  slot: int
  pages: tuple[int, ...]
  cache_id: int
  serial: int


@dataclasses.dataclass(frozen=True)
class Reservation:
  """Pool slots handed out for the uncached boundaries of a prompt, before the prefill that fills them.

  Attributes:
    start: tokens already in the sequence's state when the prefill begins (0 or a hit's ``num_tokens``).
    boundaries: the reserved boundaries (tokens from the prompt start), ascending, in ``(start, len(tokens)]``.
    slots: one fresh pool slot per boundary.
    keys: the chained keys of every boundary of the prompt up to ``len(tokens)`` (reserved ones included).
    cache_id, serial: identify the reservation.
  """

  start: int
  boundaries: tuple[int, ...]
  slots: tuple[int, ...]
  keys: tuple[bytes, ...] = dataclasses.field(repr=False)
  cache_id: int
  serial: int

  @property
  def offsets(self) -> tuple[int, ...]:
    """``checkpoint_offsets`` of a prefill of ``tokens[start:]``: the boundaries counted from ``start``."""
    return tuple(b - self.start for b in self.boundaries)


@dataclasses.dataclass
class _Entry:
  num_tokens: int
  slot: int
  pages: tuple[int, ...]
  pins: int = 0


class PrefixCache:
  """Cached prompt prefixes at every ``interval`` tokens: KDA checkpoint slots and references to MLA pages.

  The slot allocator and the page pool are shared with the live sequences (the same ``ModelCache`` pools); the
  cache owns the slots of its entries and open reservations and one reference per page of each entry.

  Args:
    interval: tokens between cached boundaries; a multiple of the page size 64 (also the KDA chunk size, so
      checkpoints land on chunk ends).
    slots: the KDA pool slot allocator the sequences' ``state_indices`` come from.
    pages: the MLA page pool the sequences' block tables come from.
    max_checkpoints: at most this many slots held by entries and open reservations together (default: all).
    devices: the devices the MLA cache is split over (``k3jax.dcp``; 1 without a mesh). A sequence's token ``t``
      lives on device ``t mod devices``, so a page id names ``64 * devices`` tokens (``page_tokens``; 64 on each
      device), and ``interval`` must be a multiple of that for a boundary to end on whole pages everywhere.

  Raises:
    ValueError: ``interval`` not a positive multiple of ``page_tokens``, or ``max_checkpoints`` not in
      ``[1, slots.num]``.
  """

  def __init__(self, interval: int, *, slots: SlotAllocator, pages: PagePool, max_checkpoints: int | None = None,
               devices: int = 1):
    self.page_tokens = PAGE_SIZE * _count("devices", devices, 1)
    interval = _interval(interval, self.page_tokens)
    limit = slots.num if max_checkpoints is None else _count("max_checkpoints", max_checkpoints, 1)
    if limit > slots.num:
      raise ValueError(f"max_checkpoints must be <= the {slots.num} pool slots, got {limit}")
    self.interval = interval
    self.max_checkpoints = limit
    self._slots = slots
    self._pages = pages
    self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # least recent first
    self._pins: dict[int, bytes] = {}  # serial -> key of the pinned entry
    self._reservations: dict[int, tuple[int, ...]] = {}  # serial -> reserved slots
    self._serials = itertools.count()
    self._id = next(_CACHE_IDS)

  @property
  def slots(self) -> SlotAllocator:
    """The KDA pool slot allocator shared with the live sequences."""
    return self._slots

  @property
  def pages(self) -> PagePool:
    """The MLA page pool shared with the live sequences."""
    return self._pages

  def __len__(self) -> int:
    """Cached boundaries."""
    return len(self._entries)

  @property
  def num_pinned(self) -> int:
    """Entries with at least one pin."""
    return sum(1 for e in self._entries.values() if e.pins)

  def slots_in_use(self) -> frozenset[int]:
    """Slots held by entries and open reservations."""
    held = {e.slot for e in self._entries.values()}
    return frozenset(held.union(*self._reservations.values()))

  def page_refs(self) -> collections.Counter:
    """References the entries hold, per page."""
    return collections.Counter(p for e in self._entries.values() for p in e.pages)

  def boundaries(self, tokens) -> tuple[int, ...]:
    """The cached boundaries of ``tokens`` (up to ``len(tokens)``), ascending; pins and refreshes nothing."""
    keys = block_keys(tokens, self.interval)
    return tuple((i + 1) * self.interval for i, k in enumerate(keys) if k in self._entries)

  def lookup(self, tokens) -> PrefixHit | None:
    """The longest cached boundary ``b < len(tokens)`` of ``tokens``, pinned; None when none is cached.

    ``b`` stays below ``len(tokens)`` because producing the next token's logits needs at least one token to
    prefill; a prompt of exactly ``b`` tokens therefore hits at ``b - interval`` at best. The hit and the cached
    boundaries before it become the most recently used. Release the hit once its slot has been copied (the
    sequence keeps the pages through its own ``PagePool`` references) or when the sequence ends.
    """
    arr = _tokens(tokens)
    keys = block_keys(arr[:max(len(arr) - 1, 0)], self.interval)
    hit = next((i for i in range(len(keys) - 1, -1, -1) if keys[i] in self._entries), None)
    if hit is None:
      return None
    self._refresh(keys[:hit + 1])
    entry = self._entries[keys[hit]]
    entry.pins += 1
    serial = next(self._serials)
    self._pins[serial] = keys[hit]
    return PrefixHit(num_tokens=entry.num_tokens, slot=entry.slot, pages=entry.pages, cache_id=self._id,
                     serial=serial)

  def release(self, hit: PrefixHit) -> None:
    """Unpin ``hit``. Raises ValueError for a hit of another cache or one already released (a stale handle)."""
    self._check_own(hit, PrefixHit)
    key = self._pins.pop(hit.serial, None)
    if key is None:
      raise ValueError(f"hit {hit.serial} (boundary {hit.num_tokens}, slot {hit.slot}) was already released: "
                       f"a stale handle")
    self._entries[key].pins -= 1

  def ensure_free(self, *, slots: int = 0, pages: int = 0) -> int:
    """Evict least recently used unpinned entries until ``slots`` slots and ``pages`` pages are free.

    Evicting an entry frees its slot, and its pages whose last reference it held. Returns the number evicted.

    Raises:
      ValueError: even evicting every unpinned entry would not free enough (pinned entries and live sequences
        hold the rest); then nothing is evicted.
    """
    return self._evict_until(_count("slots", slots, 0), _count("pages", pages, 0), checkpoints=0)

  def reserve(self, tokens, start: int = 0) -> Reservation:
    """Fresh slots for the uncached boundaries of ``tokens`` in ``(start, len(tokens)]``, evicting if needed.

    Args:
      tokens: the whole prompt.
      start: tokens the sequence's state already holds (its hit's ``num_tokens``, or 0); a multiple of the
        interval, at most ``len(tokens)``.

    Returns:
      A ``Reservation`` whose ``offsets`` / ``slots`` are the ``checkpoint_offsets`` / ``checkpoint_slots`` of
      the prefill of ``tokens[start:]``; ``commit`` or ``abort`` it exactly once.

    Raises:
      ValueError: a bad ``start``, or not enough slots even after evicting every unpinned entry (nothing is
        evicted then; the request can still go on without checkpoints).
    """
    arr = _tokens(tokens)
    keys, n = block_keys(arr, self.interval), len(arr)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= n or start % self.interval:
      raise ValueError(f"start must be a multiple of the interval {self.interval} in [0, {n}], got {start!r}")
    boundaries = tuple((i + 1) * self.interval for i in range(start // self.interval, len(keys))
                       if keys[i] not in self._entries)
    self._evict_until(len(boundaries), 0, checkpoints=len(boundaries))
    slots = tuple(self._slots.allocate(len(boundaries)))
    serial = next(self._serials)
    self._reservations[serial] = slots
    return Reservation(start=start, boundaries=boundaries, slots=slots, keys=tuple(keys), cache_id=self._id,
                       serial=serial)

  def commit(self, reservation: Reservation, pages: Sequence[int]) -> tuple[int, ...]:
    """Cache the reserved boundaries after the prefill wrote their checkpoints.

    Args:
      reservation: from ``reserve`` of this cache, not yet committed or aborted.
      pages: the sequence's block table (page ids in token order), covering at least the last boundary.

    Returns:
      The boundaries that became entries. A boundary that another sequence cached meanwhile keeps that entry,
      and this reservation's slot for it is freed.

    Raises:
      ValueError: a stale or foreign reservation, too few pages, or a page that is not allocated.
    """
    self._check_reservation(reservation)
    pages = tuple(int(p) for p in pages)
    need = max(reservation.boundaries, default=0) // self.page_tokens
    if len(pages) < need:
      raise ValueError(f"pages must cover the last reserved boundary {need * self.page_tokens} ({need} pages), "
                       f"got {len(pages)}")
    unallocated = sorted({p for p in pages[:need] if not self._pages.refcount(p)})
    if unallocated or len(set(pages[:need])) < need:
      raise ValueError(f"pages must be distinct allocated ids (the sequence's live block table), got "
                       f"{list(pages[:need])} (not allocated: {unallocated})")
    del self._reservations[reservation.serial]
    added, dropped = [], []
    for b, slot in zip(reservation.boundaries, reservation.slots):
      key = reservation.keys[b // self.interval - 1]
      if key in self._entries:
        dropped.append(slot)
        continue
      self._pages.retain(pages[:b // self.page_tokens])
      self._entries[key] = _Entry(num_tokens=b, slot=slot, pages=pages[:b // self.page_tokens])
      added.append(b)
    if dropped:
      self._slots.free(dropped)
    self._refresh(reservation.keys)
    return tuple(added)

  def abort(self, reservation: Reservation) -> None:
    """Free the slots of a reservation whose prefill did not happen or failed. Raises ValueError if stale."""
    self._check_reservation(reservation)
    if reservation.slots:
      self._slots.free(reservation.slots)
    del self._reservations[reservation.serial]

  def _check_own(self, handle, kind: type) -> None:
    if not isinstance(handle, kind) or handle.cache_id != self._id:
      raise ValueError(f"expected a {kind.__name__} of this PrefixCache, got {handle!r}")

  def _check_reservation(self, reservation: Reservation) -> None:
    self._check_own(reservation, Reservation)
    if reservation.serial not in self._reservations:
      raise ValueError(f"reservation {reservation.serial} was already committed or aborted: a stale handle")

  def _refresh(self, keys: Sequence[bytes]) -> None:
    """Make the cached ones of a prompt's ``keys`` (ascending boundaries) most recent, the shortest last."""
    for key in reversed(keys):
      if key in self._entries:
        self._entries.move_to_end(key)

  def _evict_until(self, slots: int, pages: int, *, checkpoints: int) -> int:
    """Evict LRU unpinned entries until ``slots`` slots and ``pages`` pages are free and ``checkpoints`` more
    slots fit under ``max_checkpoints``; all or nothing."""
    reserved = sum(len(s) for s in self._reservations.values())

    def short(more_slots: int, more_pages: int) -> bool:  # with ``more_*`` freed by evicting more_slots entries
      held = len(self._entries) + reserved - more_slots
      return (self._slots.num_free + more_slots < slots or self._pages.num_free + more_pages < pages
              or held + checkpoints > self.max_checkpoints)

    if not short(0, 0):
      return 0
    unpinned = [k for k, e in self._entries.items() if not e.pins]
    refs = collections.Counter(p for k in unpinned for p in self._entries[k].pages)
    if short(len(unpinned), sum(1 for p, n in refs.items() if self._pages.refcount(p) == n)):
      raise ValueError(
          f"cannot make room for {slots} slots, {pages} pages and {checkpoints} checkpoints: "
          f"{self._slots.num_free} slots and {self._pages.num_free} pages are free, "
          f"{len(self._entries) + reserved} of max_checkpoints={self.max_checkpoints} held, and only "
          f"{len(unpinned)} of {len(self._entries)} entries are unpinned (the rest are pinned; live sequences "
          f"hold the other slots and pages)")
    evicted = 0
    while short(0, 0):
      entry = self._entries.pop(unpinned[evicted])
      self._slots.free([entry.slot])
      self._pages.release(entry.pages)
      evicted += 1
    return evicted


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """What caching costs per checkpoint and per cached token (``memory_report``).

  Attributes:
    interval: tokens between checkpoints.
    recurrent_bytes: KDA recurrent states of one checkpoint (KDA layers x H x V x K x state bytes).
    conv_bytes: KDA conv states of one checkpoint (KDA layers x 3 x (W - 1) x H*K x conv bytes).
    page_bytes_per_token: MLA latent rows of one token (MLA layers x (R + dr) x cache bytes), held in pages.
  """

  interval: int
  recurrent_bytes: int
  conv_bytes: int
  page_bytes_per_token: int

  @property
  def checkpoint_bytes(self) -> int:
    """One pool slot: recurrent plus conv states of every KDA layer."""
    return self.recurrent_bytes + self.conv_bytes

  @property
  def checkpoint_bytes_per_token(self) -> float:
    """Checkpoint bytes per cached token: one checkpoint every ``interval`` tokens."""
    return self.checkpoint_bytes / self.interval

  @property
  def bytes_per_cached_token(self) -> float:
    """Checkpoint plus MLA page bytes per cached token."""
    return self.checkpoint_bytes_per_token + self.page_bytes_per_token

  def __str__(self) -> str:
    return (f"prefix cache, interval {self.interval}: {self.checkpoint_bytes:,} B per checkpoint "
            f"(recurrent {self.recurrent_bytes:,} + conv {self.conv_bytes:,}); per cached token "
            f"{self.checkpoint_bytes_per_token:,.0f} B of KDA checkpoints + {self.page_bytes_per_token:,} B of "
            f"MLA pages = {self.bytes_per_cached_token:,.0f} B")


def memory_report(cfg: K3Config, interval: int, state_dtype=None) -> MemoryReport:
  """Bytes per checkpoint and per cached token of ``PrefixCache(interval)`` for ``cfg``'s pools.

  ``state_dtype`` (default ``cfg.state_dtype``) is the recurrent pool's; the conv and MLA pools use
  ``cfg.conv_dtype`` and ``cfg.cache_dtype``. Raises ValueError for an interval not a multiple of 64.
  """
  interval = _interval(interval)
  state = jnp.dtype(cfg.state_dtype if state_dtype is None else state_dtype).itemsize
  kda = cfg.layer_types.count(KDA)
  h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
  return MemoryReport(
      interval=interval, recurrent_bytes=kda * h * k * k * state,
      conv_bytes=kda * 3 * (w - 1) * h * k * jnp.dtype(cfg.conv_dtype).itemsize,
      page_bytes_per_token=cfg.layer_types.count(MLA) * cfg.cache_row_width
      * jnp.dtype(cfg.cache_dtype).itemsize)

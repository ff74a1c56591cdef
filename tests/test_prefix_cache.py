"""PrefixCache: chained keys and longest-prefix lookup, shared page refcounts, LRU eviction and pins, reserve /
commit / abort, every error, the K3 memory report by hand, and random request streams against fake pools."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from k3jax import config as cfg_lib
from k3jax.cache import SlotAllocator
from k3jax.prefix_cache import PagePool, PrefixCache, PrefixHit, Reservation, block_keys, memory_report
from pallas_kernels import util
from tests.support import budget

B = 64  # interval of most tests: one page per block


def _prompt(*blocks: int, extra: int = 0) -> list[int]:
  """Blocks of 64 equal tokens, then ``extra`` tokens 1000, 1001, ..."""
  return [t for b in blocks for t in [b] * B] + list(range(1000, 1000 + extra))


def _cache(num_slots: int = 8, num_pages: int = 32, interval: int = B, **kw):
  slots, pages = SlotAllocator(num_slots), PagePool(num_pages)
  return PrefixCache(interval, slots=slots, pages=pages, **kw), slots, pages


def _cache_prompt(pc: PrefixCache, pages: PagePool, tokens: list[int]) -> tuple[int, ...]:
  """A whole request without a hit: its pages, its checkpoints committed, the sequence ended; its page ids."""
  res = pc.reserve(tokens)
  table = pages.allocate(util.cdiv(len(tokens), 64))
  pc.commit(res, table)
  pages.release(table)
  return tuple(table)


def test_chained_keys_longest_prefix():
  pc, _, pages = _cache()
  table = _cache_prompt(pc, pages, _prompt(1, 2, 3))
  assert pc.boundaries(_prompt(1, 2, 3)) == (64, 128, 192) and len(pc) == 3
  hit = pc.lookup(_prompt(1, 2, 4, 5))  # shares the first 2 blocks
  assert hit.num_tokens == 128 and hit.pages == table[:2]
  assert pc.lookup(_prompt(9, 2, 3, extra=5)) is None  # a different first block misses, later blocks equal
  assert pc.lookup(_prompt(1, 2, 3)).num_tokens == 128  # a full hit leaves at least one token to prefill
  assert pc.lookup(_prompt(1, 2, 3, extra=1)).num_tokens == 192
  assert pc.lookup(_prompt(1, extra=63)).num_tokens == 64
  assert pc.lookup(_prompt(1)) is None and pc.lookup([]) is None
  assert len({pc.lookup(_prompt(1, 2, 3, extra=1)).slot, pc.lookup(_prompt(1, 2, extra=1)).slot, hit.slot}) == 2
  keys = block_keys(_prompt(1, 2, 3, extra=10), B)
  assert len(keys) == 3 and keys[:2] == block_keys(_prompt(1, 2), B)
  assert block_keys(_prompt(9, 2), B)[1] != keys[1] and block_keys(np.asarray(_prompt(1, 2), np.int64), B) == keys[:2]


def test_interval_of_several_pages():
  pc, _, pages = _cache(interval=128)
  table = _cache_prompt(pc, pages, _prompt(1, 2, 3, 4, 5))  # boundaries 128 and 256
  assert pc.boundaries(_prompt(1, 2, 3, 4, 5)) == (128, 256)
  hit = pc.lookup(_prompt(1, 2, 3, 7))
  assert hit.num_tokens == 128 and hit.pages == table[:2]
  res = pc.reserve(_prompt(1, 2, 3, 7, 8, 9), start=128)
  assert res.boundaries == (256, 384) and res.offsets == (128, 256)


def test_shared_page_refcounts():
  pc, _, pages = _cache()
  p0, p1, p2 = _cache_prompt(pc, pages, _prompt(1, 2, 3))
  assert [pages.refcount(p) for p in (p0, p1, p2)] == [3, 2, 1]  # entries 64, 128, 192
  # A second request shares blocks 1, 2: the sequence references them, its new boundary references them too.
  tokens = _prompt(1, 2, 7, extra=10)
  hit = pc.lookup(tokens)
  pages.retain(hit.pages)
  table = list(hit.pages) + pages.allocate(2)
  res = pc.reserve(tokens, hit.num_tokens)
  assert res.boundaries == (192,) and res.offsets == (64,)
  assert pc.commit(res, table) == (192,)
  pc.release(hit)
  assert [pages.refcount(p) for p in table] == [5, 4, 2, 1]  # 4 entries + sequence / 3 + seq / 1 + seq / seq
  assert pc.page_refs() == {p0: 4, p1: 3, p2: 1, table[2]: 1}
  assert pc.ensure_free(slots=8) == 4  # evicting everything frees the pages the sequence does not hold
  assert [pages.refcount(p) for p in table] == [1, 1, 1, 1] and pages.refcount(p2) == 0
  assert pages.release(table) == table and pages.num_free == pages.num


def test_lru_eviction_order_and_hits_survive():
  pc, slots, pages = _cache(max_checkpoints=3)
  for b in (1, 2, 3):
    _cache_prompt(pc, pages, _prompt(b))
  pc.release(pc.lookup(_prompt(1, extra=1)))  # 1 is now the most recent: 2, 3, 1
  _cache_prompt(pc, pages, _prompt(4))
  assert [pc.boundaries(_prompt(b)) for b in (1, 2, 3, 4)] == [(64,), (), (64,), (64,)]
  _cache_prompt(pc, pages, _prompt(5))
  assert [pc.boundaries(_prompt(b)) for b in (1, 3, 4, 5)] == [(64,), (), (64,), (64,)]
  assert pc.lookup(_prompt(1, extra=1)).num_tokens == 64  # survived the eviction of two others
  assert len(pc) == 3 and slots.num_free == 5


def test_eviction_takes_the_end_of_a_chain_first():
  pc, _, pages = _cache(max_checkpoints=3)
  _cache_prompt(pc, pages, _prompt(1, 2, 3))
  _cache_prompt(pc, pages, _prompt(5))
  assert pc.boundaries(_prompt(1, 2, 3)) == (64, 128)
  pc.release(pc.lookup(_prompt(1, 2, extra=1)))  # refreshes 128, then 64: the order is 5, 128, 64
  _cache_prompt(pc, pages, _prompt(6))
  assert pc.boundaries(_prompt(1, 2, 3)) == (64, 128) and pc.boundaries(_prompt(5)) == ()
  _cache_prompt(pc, pages, _prompt(7))
  assert pc.boundaries(_prompt(1, 2, 3)) == (64,)


def test_pinned_entries_never_evicted():
  pc, _, pages = _cache(max_checkpoints=2)
  _cache_prompt(pc, pages, _prompt(1))
  _cache_prompt(pc, pages, _prompt(2))
  hit = pc.lookup(_prompt(1, extra=1))
  pc.release(pc.lookup(_prompt(2, extra=1)))  # 1 is least recent, but pinned
  _cache_prompt(pc, pages, _prompt(3))
  assert pc.boundaries(_prompt(1)) == (64,) and pc.boundaries(_prompt(2)) == () and pc.num_pinned == 1
  hit3 = pc.lookup(_prompt(3, extra=1))
  with pytest.raises(ValueError, match=r"cannot make room for 1 slots.*only 0 of 2 entries are unpinned"):
    pc.reserve(_prompt(4))
  assert len(pc) == 2 and pc.slots_in_use() == {hit.slot, hit3.slot}
  pc.release(hit3)
  _cache_prompt(pc, pages, _prompt(4))
  assert pc.boundaries(_prompt(1)) == (64,) and pc.boundaries(_prompt(3)) == ()


def test_a_pinned_descendant_outlives_its_ancestor():
  pc, _, pages = _cache(max_checkpoints=2)
  _cache_prompt(pc, pages, _prompt(1, 2))
  hit = pc.lookup(_prompt(1, 2, extra=1))
  _cache_prompt(pc, pages, _prompt(5))  # 64 is the only unpinned entry
  assert pc.boundaries(_prompt(1, 2)) == (128,)
  assert pc.lookup(_prompt(1, 2, extra=1)).pages == hit.pages


def test_ensure_free_pages_is_all_or_nothing():
  pc, slots, pages = _cache(num_pages=4)
  _cache_prompt(pc, pages, _prompt(1, 2))  # entries 128 (p0, p1) and 64 (p0)
  live = pages.allocate(2)  # a live sequence's pages
  with pytest.raises(ValueError, match=r"cannot make room for 0 slots, 3 pages"):
    pc.ensure_free(pages=3)
  assert len(pc) == 2 and pages.num_free == 0
  assert pc.ensure_free(pages=1) == 1  # 128 goes first and frees p1 (p0 is still 64's)
  assert pc.boundaries(_prompt(1, 2)) == (64,) and pages.num_free == 1
  assert pc.ensure_free(pages=2, slots=8) == 1 and pages.num_free == 2 and slots.num_free == 8
  pages.release(live)
  assert pc.ensure_free(pages=4) == 0


def test_reserve_skips_cached_boundaries_and_commit_keeps_the_first():
  pc, slots, pages = _cache()
  tokens = _prompt(1, 2)
  first, second = pc.reserve(tokens), pc.reserve(tokens)  # two requests with the same new prompt
  assert first.boundaries == second.boundaries == (64, 128) and not set(first.slots) & set(second.slots)
  assert pc.slots_in_use() == set(first.slots + second.slots) and slots.num_free == 4
  t1, t2 = pages.allocate(2), pages.allocate(2)
  assert pc.commit(first, t1) == (64, 128)
  assert pc.commit(second, t2) == () and slots.num_free == 6  # already cached: the second's slots are freed
  assert pc.lookup(tokens + [0]).pages == tuple(t1) and pages.refcount(t2[0]) == 1
  assert pc.reserve(tokens).boundaries == ()  # nothing left to checkpoint
  res = pc.reserve(_prompt(1, 2, 3))
  assert res.boundaries == (192,) and res.offsets == (192,)
  pc.abort(res)
  assert slots.num_free == 6 and pc.boundaries(_prompt(1, 2, 3)) == (64, 128)


def test_errors():
  slots, pages = SlotAllocator(4), PagePool(8)
  for interval in (0, 32, 100, 96, -64, True, 64.0):
    with pytest.raises(ValueError, match="interval must be a positive multiple of the page size 64"):
      PrefixCache(interval, slots=slots, pages=pages)
  with pytest.raises(ValueError, match="interval must be a positive multiple"):
    memory_report(cfg_lib.preset("tiny"), 96)
  with pytest.raises(ValueError, match="max_checkpoints must be <= the 4 pool slots"):
    PrefixCache(64, slots=slots, pages=pages, max_checkpoints=5)
  with pytest.raises(ValueError, match="max_checkpoints must be an int >= 1"):
    PrefixCache(64, slots=slots, pages=pages, max_checkpoints=0)
  pc = PrefixCache(64, slots=slots, pages=pages, max_checkpoints=2)
  other = PrefixCache(64, slots=SlotAllocator(4), pages=PagePool(8))
  _cache_prompt(pc, pages, _prompt(1))
  hit = pc.lookup(_prompt(1, extra=1))
  with pytest.raises(ValueError, match="expected a PrefixHit of this PrefixCache"):
    other.release(hit)
  pc.release(hit)
  with pytest.raises(ValueError, match=r"hit \d+ \(boundary 64, slot \d\) was already released: a stale handle"):
    pc.release(hit)
  _cache_prompt(pc, pages, _prompt(2))
  _cache_prompt(pc, pages, _prompt(3))  # evicts 1: the released hit is stale
  assert pc.boundaries(_prompt(1)) == ()
  with pytest.raises(ValueError, match="already released: a stale handle"):
    pc.release(hit)
  with pytest.raises(ValueError, match="expected a PrefixHit"):
    pc.release(dataclasses.replace(hit, serial=10**6, cache_id=-1))
  res = pc.reserve(_prompt(4, 5, extra=3))
  with pytest.raises(ValueError, match="expected a Reservation of this PrefixCache"):
    pc.commit(hit, [])
  with pytest.raises(ValueError, match=r"pages must cover the last reserved boundary 128 \(2 pages\), got 1"):
    pc.commit(res, pages.allocate(1))
  with pytest.raises(ValueError, match=r"pages must be distinct allocated ids .* \(not allocated: \[7\]\)"):
    pc.commit(res, [pages.allocate(1)[0], 7])
  table = pages.allocate(2)
  with pytest.raises(ValueError, match="pages must be distinct allocated ids"):
    pc.commit(res, [table[0], table[0]])
  pc.commit(res, table)
  for fn in (lambda: pc.commit(res, table), lambda: pc.abort(res)):
    with pytest.raises(ValueError, match="already committed or aborted: a stale handle"):
      fn()
  pins = [pc.lookup(_prompt(4, 5, extra=1)), pc.lookup(_prompt(4, extra=1))]
  with pytest.raises(ValueError, match="cannot make room for 1 slots, 0 pages and 1 checkpoints"):
    pc.reserve(_prompt(6))  # over capacity with everything pinned
  with pytest.raises(ValueError, match="cannot make room for 9 slots"):
    pc.ensure_free(slots=9)
  for p in pins:
    pc.release(p)
  for start in (32, 128, -64):
    with pytest.raises(ValueError, match=r"start must be a multiple of the interval 64 in \[0, 100\]"):
      pc.reserve(_prompt(1, extra=36), start)
  for bad in ([[1, 2]], [1.5, 2.0], [2**31]):
    with pytest.raises(ValueError, match="tokens must"):
      pc.lookup(bad)
  with pytest.raises(ValueError, match="slots must be an int >= 0"):
    pc.ensure_free(slots=-1)


def test_page_pool_errors():
  pool = PagePool(SlotAllocator(3))
  a, b = pool.allocate(2)
  pool.retain([a, a])
  assert pool.refcount(a) == 3 and pool.release([a, a, b]) == [b] and pool.num_free == 2
  with pytest.raises(ValueError, match=r"cannot release pages \[0\]: released more often than referenced"):
    pool.release([a, a])
  assert pool.refcount(a) == 1  # nothing changed
  with pytest.raises(ValueError, match=r"cannot retain pages \[1\]: they are not allocated"):
    pool.retain([b])
  with pytest.raises(ValueError, match="cannot allocate 3 ids: only 2 of 3 are free"):
    pool.allocate(3)


def test_memory_report_k3_by_hand(capsys):
  k3 = cfg_lib.preset("kimi_k3")
  kda, mla = 69, 24  # 93 layers, MLA at 4, 8, ..., 88, 92, 93
  recurrent = kda * 96 * 128 * 128 * 4  # f32 state
  conv = kda * 3 * (4 - 1) * (96 * 128) * 2  # q, k, v conv states of W - 1 rows, bf16
  rep = memory_report(k3, 64)
  assert (rep.recurrent_bytes, rep.conv_bytes) == (recurrent, conv) == (434_110_464, 15_261_696)
  assert rep.checkpoint_bytes == 449_372_160 and rep.checkpoint_bytes_per_token == 7_021_440
  assert rep.page_bytes_per_token == mla * (512 + 64) * 2 == 27_648
  assert rep.bytes_per_cached_token == 7_049_088
  rep16 = memory_report(k3, 1024, jnp.bfloat16)
  assert rep16.recurrent_bytes == recurrent // 2 and rep16.checkpoint_bytes_per_token == (recurrent // 2 + conv) / 1024
  print(rep, rep16, sep="\n")
  out = capsys.readouterr().out
  assert "449,372,160 B per checkpoint" in out and "7,049,088 B" in out and "interval 1024" in out


# ---------------------------------------------------------------------------- random request streams
@dataclasses.dataclass
class _Seq:
  tokens: tuple[int, ...]
  slot: int
  table: list[int]
  hit: PrefixHit | None  # still pinned by this sequence
  res: Reservation | None  # its prefill's checkpoints, not yet committed or aborted


def _check_invariants(pc: PrefixCache, slots: SlotAllocator, pages: PagePool, live: list[_Seq]):
  cached = pc.slots_in_use()  # entries and open reservations
  assert len(cached) == len(pc) + sum(len(s.res.slots) for s in live if s.res)
  seq_slots = {s.slot for s in live}
  assert len(seq_slots) == len(live) and not cached & seq_slots  # no slot handed out twice ...
  assert len(cached) + len(live) + slots.num_free == slots.num  # ... and none lost
  refs = pc.page_refs()
  for s in live:
    refs.update(s.table)
  for p in range(pages.num):  # a page is free exactly when nothing references it
    assert pages.refcount(p) == refs[p]
  assert len(refs) + pages.num_free == pages.num
  assert len(cached) <= pc.max_checkpoints and pc.num_pinned == len({s.hit.slot for s in live if s.hit})


def _complete(pc: PrefixCache, seq: _Seq, commit: bool) -> None:
  if commit:
    assert set(pc.commit(seq.res, seq.table)) <= set(seq.res.boundaries)
  else:
    pc.abort(seq.res)
  seq.res = None


def _request(pc: PrefixCache, slots: SlotAllocator, pages: PagePool, slot_mem: dict, page_mem: dict,
             tokens: tuple[int, ...]) -> _Seq | None:
  """Lookup, allocation, reservation and the fake prefill of one request; None when there is no room for the
  sequence, no checkpoints (``res`` None) when there is none for them."""
  hit = pc.lookup(tokens)
  start = hit.num_tokens if hit else 0
  if hit:  # the longest cached boundary below len(tokens), holding exactly that prefix's state and rows
    assert start < len(tokens) and start % pc.interval == 0
    assert start == max(b for b in pc.boundaries(tokens) if b < len(tokens))
    assert slot_mem[hit.slot] == tokens[:start] and sum((page_mem[p] for p in hit.pages), ()) == tokens[:start]
  else:
    assert all(b >= len(tokens) for b in pc.boundaries(tokens))
  n_new = util.cdiv(len(tokens), 64) - start // 64
  try:
    pc.ensure_free(slots=1, pages=n_new)
  except ValueError as e:  # pinned entries and live sequences hold too much: nothing was evicted
    assert "cannot make room" in str(e)
    if hit:
      pc.release(hit)
    return None
  seq = _Seq(tokens, slots.allocate(1)[0], list(hit.pages if hit else ()) + pages.allocate(n_new), hit, None)
  if hit:
    pages.retain(hit.pages)
  try:
    seq.res = pc.reserve(tokens, start)
  except ValueError as e:  # the request goes on without checkpoints
    assert "cannot make room" in str(e)
  slot_mem[seq.slot] = tokens  # the prefill writes the sequence's slot, its new pages and the checkpoints
  for j in range(start // 64, len(seq.table)):
    page_mem[seq.table[j]] = tokens[64 * j:64 * (j + 1)]
  if seq.res:
    assert seq.res.offsets == tuple(b - start for b in seq.res.boundaries)
    for b, s in zip(seq.res.boundaries, seq.res.slots):
      slot_mem[s] = tokens[:b]
  return seq


@budget(cpu=100, gpu=100)
@given(data=st.data())
def test_random_requests_keep_the_invariants(data):
  """Requests (lookup, room, reserve, fake prefill, commit/abort now or later), sequence ends and repeated
  releases on fake pools: every hit reads the state and rows of exactly its prefix (so nothing it holds was
  handed out again), and slots and page refcounts add up after every step."""
  interval = data.draw(st.sampled_from([64, 128]), label="interval")
  num_slots = data.draw(st.integers(4, 10), label="slots")
  pc, slots, pages = _cache(num_slots, data.draw(st.integers(6, 32), label="pages"), interval,
                            max_checkpoints=data.draw(st.integers(2, num_slots), label="max_checkpoints"))
  prompts = st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=3), st.lists(st.integers(5, 6), max_size=2))
  slot_mem: dict[int, tuple] = {}  # the fake pools: which prefix's state a slot holds, which tokens a page
  page_mem: dict[int, tuple] = {}
  live: list[_Seq] = []
  released: list[PrefixHit] = []
  for _ in range(data.draw(st.integers(5, 40), label="ops")):
    op = data.draw(st.sampled_from(["request", "request", "complete", "finish", "finish", "release_again"]))
    if op == "request":
      blocks, extra = data.draw(prompts)
      tokens = tuple(t for b in blocks for t in [b] * 64) + tuple(extra)
      seq = _request(pc, slots, pages, slot_mem, page_mem, tokens)
      if seq is not None:
        if seq.res and data.draw(st.booleans(), label="complete now"):
          _complete(pc, seq, data.draw(st.booleans(), label="commit"))
        if seq.hit and data.draw(st.booleans(), label="unpin now"):  # the state was copied: only pages needed
          pc.release(seq.hit)
          released.append(seq.hit)
          seq.hit = None
        live.append(seq)
    elif op == "complete" and any(s.res for s in live):
      _complete(pc, data.draw(st.sampled_from([s for s in live if s.res])), data.draw(st.booleans()))
    elif op == "finish" and live:
      seq = live.pop(data.draw(st.integers(0, len(live) - 1)))
      if seq.res:
        pc.abort(seq.res)
      if seq.hit:
        pc.release(seq.hit)
        released.append(seq.hit)
      pages.release(seq.table)
      slots.free([seq.slot])
    elif op == "release_again" and released:
      with pytest.raises(ValueError, match="already released"):
        pc.release(data.draw(st.sampled_from(released)))
    _check_invariants(pc, slots, pages, live)
  for seq in live:
    if seq.res:
      pc.abort(seq.res)
    if seq.hit:
      pc.release(seq.hit)
    pages.release(seq.table)
    slots.free([seq.slot])
  pc.ensure_free(slots=slots.num, pages=pages.num)
  assert len(pc) == 0 and slots.num_free == slots.num and pages.num_free == pages.num

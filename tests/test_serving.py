"""Prefix-cached prefill through the model (``k3jax.serving``): a hit skips the cached prefix and gives the logits of
an uncached prefill; shared pages are never written; idle rows; checkpoints and slot copies; every rejected
request leaves the pools and the cache as they were.

The model is the tiny preset in float32 (impl xla) on one CPU device. Prompts are 200 tokens at a 64-token
interval: an uncached prompt saves checkpoints at 64, 128 and 192, and a repeat of it hits at 192.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hypothesis import given
from hypothesis import strategies as st
from layer_oracles import tiny
from support import budget, device_mesh

import k3jax
from k3jax import serving, sharding, steps
from k3jax.cache import Checkpoints, SlotAllocator, init_cache
from k3jax.config import preset
from k3jax.prefix_cache import PagePool, PrefixCache

INTERVAL, PROMPT, NEW = 64, 200, 8
MAX_LEN = 320  # 5 pages per row: a 208-token request takes 4 of them
FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def setup():
  cfg = tiny()
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(0))
  return cfg, k3jax.jit_model_step(model, compiler_options=FAST)


def fresh(cfg, num_slots=8, num_pages=16, rows=2):
  """An idle NaN-poisoned cache and a prefix cache over its pools."""
  cache = init_cache(cfg, rows, MAX_LEN, num_slots=num_slots, num_pages=num_pages, fill=np.nan, idle=True)
  return cache, PrefixCache(INTERVAL, slots=SlotAllocator(num_slots), pages=PagePool(num_pages))


def prompt(cfg, seed, n=PROMPT):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


def decode(step, cache, row, tokens):
  """Decode ``tokens`` one by one into ``row`` (the other row idle); that row's logits per step."""
  out = []
  for t in tokens:
    ids = np.zeros(2, np.int32)
    ids[row] = t
    logits, cache = step.decode(jnp.asarray(ids), cache)
    logits = np.asarray(logits)
    assert np.isnan(logits[1 - row]).all()  # the idle row
    out.append(logits[row])
  return np.stack(out), cache


def close(a, b):
  """float32 tolerance: 1e-4 of the largest logit."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.isfinite(a).all() and np.isfinite(b).all()
  err = np.max(np.abs(a - b)) / np.max(np.abs(b))
  assert err <= 1e-4, err


def test_hit_skips_the_prefix_and_matches_the_uncached_prefill(setup):
  cfg, step = setup
  cache, pc = fresh(cfg)
  p, follow = prompt(cfg, 1), prompt(cfg, 2, 3)
  logits, cache, (a,) = serving.admit(step, cache, pc, [serving.Request(row=0, tokens=p, max_new_tokens=NEW)])
  assert (a.cached_tokens, a.new_boundaries, len(a.pages)) == (0, (64, 128, 192), 4)
  ref_prefill = np.asarray(logits)[0]
  assert np.isnan(np.asarray(logits)[1]).all()
  ref_decode, cache = decode(step, cache, 0, follow)
  cache = serving.finish(cache, pc, a)
  shared = a.pages[:3]  # the entry at 192 holds them; the finished row does not
  assert [pc.pages.refcount(x) for x in a.pages] == [3, 2, 1, 0]

  # Row 1 repeats the prompt and hits at 192 (8 tokens prefilled); row 0 takes a new 70-token prompt at the same
  # time (a miss, with a checkpoint at 64).
  other = prompt(cfg, 3, 70)
  before = [np.asarray(kv[np.asarray(shared)]) for kv in cache.mla]
  logits, cache, (b, c) = serving.admit(step, cache, pc, [
      serving.Request(row=1, tokens=p, max_new_tokens=NEW), serving.Request(row=0, tokens=other, max_new_tokens=0)])
  assert (b.cached_tokens, b.new_boundaries, b.pages[:3]) == (192, (), shared)
  assert (c.cached_tokens, c.new_boundaries) == (0, (64,))
  close(np.asarray(logits)[1], ref_prefill)
  assert np.isfinite(np.asarray(logits)[0]).all()
  cache = serving.finish(cache, pc, c)
  got, cache = decode(step, cache, 1, follow)
  close(got, ref_decode)
  # The shared pages hold the prefix's latent rows, bit for bit, after the hit's prefill and decode steps.
  for kv, old in zip(cache.mla, before):
    np.testing.assert_array_equal(np.asarray(kv[np.asarray(shared)]), old)
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), [0, PROMPT + 3])
  # Decoding past the row's pages (max_new_tokens, rounded up to whole pages) is refused rather than read
  # outside the cache.
  for t in range(4 * 64 - PROMPT - 3):
    _, cache = step.decode(jnp.asarray([0, t], jnp.int32), cache)
  with pytest.raises(ValueError, match=r"block_table\[1\] must hold page ids >= 0"):
    step.decode(jnp.asarray([0, 0], jnp.int32), cache)
  cache = serving.finish(cache, pc, b)
  assert pc.pages.num_free == 16 - 3 - 1 and len(pc) == 4  # entries 64/128/192 of p and 64 of other


def test_hits_after_evicting_other_entries(setup):
  cfg, step = setup
  # 3 slots: a running sequence's slot and two checkpoints at most; caching a second prompt evicts the first.
  cache, pc = fresh(cfg, num_slots=4, num_pages=12)
  p, q = prompt(cfg, 4, 130), prompt(cfg, 5, 130)
  logits_p, cache, (a,) = serving.admit(step, cache, pc, [serving.Request(0, p, 0)])
  cache = serving.finish(cache, pc, a)
  assert pc.boundaries(p) == (64, 128)
  _, cache, (b,) = serving.admit(step, cache, pc, [serving.Request(0, q, 0)])
  cache = serving.finish(cache, pc, b)
  assert pc.boundaries(q) == (64, 128) and pc.boundaries(p) == (64,)  # LRU: p's longer entry went first
  logits, cache, (c,) = serving.admit(step, cache, pc, [serving.Request(1, p, 0)])
  assert c.cached_tokens == 64
  close(np.asarray(logits)[1], np.asarray(logits_p)[0])


def test_rejected_requests_change_nothing(setup):
  cfg, step = setup
  cache, pc = fresh(cfg, num_pages=8, rows=3)
  p = prompt(cfg, 6)
  _, cache, (a,) = serving.admit(step, cache, pc, [serving.Request(0, p, 0)])  # 4 of the 8 pages
  state = (pc.slots.num_free, pc.pages.num_free, len(pc), pc.num_pinned)
  bad = {
      "rows must be distinct": [serving.Request(1, p, 0), serving.Request(1, p, 0)],
      "must be idle": [serving.Request(0, p, 0)],
      "must fit the cache capacity": [serving.Request(1, p, MAX_LEN)],
      "must not be empty": [serving.Request(1, [], 0)],
      "max_new_tokens must be an int": [serving.Request(1, p, -1)],
  }
  for match, requests in bad.items():
    with pytest.raises(ValueError, match=match):
      serving.admit(step, cache, pc, requests)
  # Too few pages for the second request (evicting the unpinned entries frees none: row 0 holds their pages):
  # the first one's slot, page and reservation go back too.
  with pytest.raises(ValueError, match="cannot make room"):
    serving.admit(step, cache, pc, [serving.Request(1, prompt(cfg, 7, 10), 0),
                                    serving.Request(2, prompt(cfg, 8, 250), 0)])
  assert (pc.slots.num_free, pc.pages.num_free, len(pc), pc.num_pinned) == state
  np.testing.assert_array_equal(np.asarray(cache.state_indices), [a.slot, -1, -1])  # the cache was not donated


def test_checkpoint_and_copy_slot_checks(setup):
  cfg, step = setup
  cache = init_cache(cfg, 2, MAX_LEN, num_slots=6)
  toks, cu = jnp.zeros(130, jnp.int32), jnp.asarray([0, 130, 130], jnp.int32)
  cases = {
      "multiples of chunk_size": Checkpoints.from_lists([[(100, 3)], []]),
      r"in \(0, L_n\]": Checkpoints.from_lists([[(192, 3)], []]),
      "must not be any sequence's slot": Checkpoints.from_lists([[(64, 1)], []]),
      "must be distinct": Checkpoints.from_lists([[(64, 3), (128, 3)], []]),
      r"pool slots in \[-1, 6\)": Checkpoints.from_lists([[(64, 6)], []]),
  }
  for match, ckpt in cases.items():
    with pytest.raises(ValueError, match=match):
      step.prefill(toks, cu, cache, checkpoints=ckpt)
  with pytest.raises(ValueError, match="dst must not overlap src"):
    step.copy_slots(cache, jnp.asarray([2, 3], jnp.int32), jnp.asarray([3, 4], jnp.int32))
  with pytest.raises(ValueError, match=r"src must be pool slots in \[0, P = 6\)"):
    step.copy_slots(cache, jnp.asarray([-1], jnp.int32), jnp.asarray([4], jnp.int32))
  idle = init_cache(cfg, 2, MAX_LEN, num_slots=6, idle=True)
  with pytest.raises(ValueError, match="no tokens to idle rows"):
    step.prefill(toks, cu, idle)


def test_checkpoints_hold_the_states_of_a_prefill_stopped_there(setup):
  cfg, step = setup
  cache = init_cache(cfg, 2, MAX_LEN, num_slots=6, fill=np.nan)
  p = prompt(cfg, 8, 130)
  _, full = step.prefill(jnp.asarray(p), jnp.asarray([0, 130, 130], jnp.int32), cache,
                         checkpoints=Checkpoints.from_lists([[(64, 4), (128, 5)], []]))
  for stop, slot in ((64, 4), (128, 5)):
    cache = init_cache(cfg, 2, MAX_LEN, num_slots=6, fill=np.nan)
    _, part = step.prefill(jnp.asarray(p[:stop]), jnp.asarray([0, stop, stop], jnp.int32), cache)
    for got, want in zip(full.kda, part.kda):
      for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
        a, b = np.asarray(getattr(got, name)[slot]), np.asarray(getattr(want, name)[0])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=f"{name} at {stop}")
  # Slots no one asked for keep their poison.
  for state in full.kda:
    assert np.isnan(np.asarray(state.recurrent)[[2, 3]]).all() and np.isnan(np.asarray(state.conv_q)[[2, 3]]).all()


def test_hit_on_a_mesh_matches_one_device(setup):
  """On a 3-device mesh (KDA heads split, the MLA cache split over tokens by DCP) a boundary is a multiple of
  64 x 3 tokens: the repeat of a 200-token prompt hits at 192 and matches the one-device uncached logits."""
  cfg, step = setup
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(0))  # the parameters of ``step``'s model (same seed)
  mesh = device_mesh(3)
  placed, _ = sharding.shard_model(model, mesh)
  mstep = k3jax.jit_model_step(placed, mesh, vocab_size=cfg.vocab_size, compiler_options=FAST)
  cache = steps.init_mesh_cache(placed.cfg, 2, MAX_LEN, mesh, fill=np.nan, num_slots=6, num_pages=8, idle=True)
  with pytest.raises(ValueError, match="must be made with devices=3"):
    serving.admit(mstep, cache, PrefixCache(64, slots=SlotAllocator(6), pages=PagePool(8)), [])
  with pytest.raises(ValueError, match="positive multiple of page_tokens = 192"):
    PrefixCache(64, slots=SlotAllocator(6), pages=PagePool(8), devices=3)
  pc = PrefixCache(192, slots=SlotAllocator(6), pages=PagePool(8), devices=3)
  p, follow = prompt(cfg, 1), prompt(cfg, 2, 1)
  ref, ref_cache, _ = serving.admit(step, *fresh(cfg), [serving.Request(0, p, NEW)])
  ref_next, _ = step.decode(jnp.asarray([follow[0], 0], jnp.int32), ref_cache)
  _, cache, (a,) = serving.admit(mstep, cache, pc, [serving.Request(0, p, NEW)])
  assert (a.new_boundaries, len(a.pages)) == ((192,), 2)  # 208 tokens: up to 70 per device, 2 local pages
  cache = serving.finish(cache, pc, a)
  logits, cache, (b,) = serving.admit(mstep, cache, pc, [serving.Request(1, p, NEW)])
  assert b.cached_tokens == 192 and b.pages[:1] == a.pages[:1]
  close(np.asarray(logits)[1], np.asarray(ref)[0])
  got, _ = mstep.decode(jnp.asarray([0, follow[0]], jnp.int32), cache)
  close(np.asarray(got)[1], np.asarray(ref_next)[0])


@pytest.mark.slow
@budget(cpu=2, gpu=6)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([70, 130, 200]), st.booleans()), min_size=3,
                    max_size=7))
def test_randomized_admit_and_finish_match_uncached_prefills(setup, ops):
  """Random admissions of prompts sharing prefixes (three base prompts cut at 70, 130 or 200 tokens) into two
  rows, each finished at once or left running, under a pool small enough to evict: every admission's last-token
  logits equal an uncached prefill of its prompt, and when no sequence runs every slot and page is back.
  Full-precision f32 matmuls: on a GPU, XLA's default would round f32 dots to TF32."""
  with jax.default_matmul_precision("highest"):
    _admit_and_finish(*setup, ops)


def _admit_and_finish(cfg, step, ops):
  bases = [prompt(cfg, 40 + i) for i in range(3)]
  cache, pc = fresh(cfg, num_slots=6, num_pages=14)
  running: list[serving.Admitted] = []
  for base, length, keep in ops:
    p = bases[base][:length]
    if len(running) == 2:
      cache = serving.finish(cache, pc, running.pop(0))
    row = next(r for r in (0, 1) if all(a.row != r for a in running))
    try:
      logits, cache, (a,) = serving.admit(step, cache, pc, [serving.Request(row, p, 0)])
    except ValueError as e:  # the running sequence pins what an eviction would need: end it and retry
      assert "cannot make room" in str(e) and running
      cache = serving.finish(cache, pc, running.pop(0))
      logits, cache, (a,) = serving.admit(step, cache, pc, [serving.Request(row, p, 0)])
    assert a.cached_tokens <= length - 1 and a.cached_tokens % INTERVAL == 0
    close(np.asarray(logits)[row], uncached(cfg, step, tuple(p.tolist())))
    if keep:
      running.append(a)
    else:
      cache = serving.finish(cache, pc, a)
  for a in running:
    cache = serving.finish(cache, pc, a)
  # Nothing leaked: with every entry evicted, every slot and page is free again.
  pc.ensure_free(slots=6, pages=14)
  assert (pc.slots.num_free, pc.pages.num_free, len(pc)) == (6, 14, 0)
  np.testing.assert_array_equal(np.asarray(cache.state_indices), [-1, -1])


_UNCACHED: dict = {}


def uncached(cfg, step, tokens: tuple) -> np.ndarray:
  """Last-token logits of a plain prefill of ``tokens`` into a fresh cache (memoised across examples)."""
  if tokens not in _UNCACHED:
    cache = init_cache(cfg, 1, MAX_LEN)
    logits, _ = step.prefill(jnp.asarray(tokens, jnp.int32), jnp.asarray([0, len(tokens)], jnp.int32), cache,
                             last_only=True)
    _UNCACHED[tokens] = np.asarray(logits)[0]
  return _UNCACHED[tokens]


# ------------------------------------------------------------------------------------- speculative verify
S = 3  # drafts per verify
DRAFTS = np.asarray([[2, 3, 4], [-1, -1, -1], [5, 6, 7]], np.int32)


def running(cfg, step):
  """Rows 0 and 2 prefilled with 70 and 131 tokens (slots 0 and 1, pages 0-4 and 5-9), row 1 idle; every
  pool element NaN before, so a slot or page no one wrote stays NaN."""
  cache = init_cache(cfg, 3, MAX_LEN, num_slots=10, num_pages=16, fill=np.nan, idle=True)
  table = np.full((3, MAX_LEN // 64), -1, np.int32)
  table[0], table[2] = np.arange(5), np.arange(5, 10)
  cache = cache.replace(state_indices=jnp.asarray([0, -1, 1], jnp.int32), block_table=jnp.asarray(table))
  toks = np.concatenate([prompt(cfg, 20, 70), prompt(cfg, 21, 131)])
  _, cache = step.prefill(jnp.asarray(toks), jnp.asarray([0, 70, 70, 201], jnp.int32), cache)
  return cache


def one_by_one(step, cache, columns):
  """``step.decode`` of each ``[N]`` column in turn; logits ``[N, len(columns), vocab]`` and the cache."""
  out = []
  for col in columns:
    logits, cache = step.decode(jnp.asarray(col, jnp.int32), cache)
    out.append(np.asarray(logits))
  return np.stack(out, axis=1), cache


def test_verify_then_accept_equals_decoding_one_by_one(setup):
  cfg, step = setup
  rng = np.random.default_rng(22)
  first, second = (rng.integers(0, cfg.vocab_size, (3, 1 + S)).astype(np.int32) for _ in range(2))
  first[1] = second[1] = 0  # the idle row's tokens are not looked at
  logits, cache = step.verify(jnp.asarray(first), running(cfg, step), jnp.asarray(DRAFTS))
  logits = np.asarray(logits)
  want, _ = one_by_one(step, running(cfg, step), first.T)
  assert logits.shape == (3, 1 + S, cfg.vocab_size) and np.isnan(logits[1]).all()
  close(logits[[0, 2]], want[[0, 2]])
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), [70, 0, 131])  # verify alone moves nothing
  # Row 0 keeps 2 tokens (the state after its first draft, in slot 2, becomes its slot), row 2 all 4 (slot 7).
  cache, drafts = k3jax.accept(cache, jnp.asarray(DRAFTS), jnp.asarray([2, 0, 4], jnp.int32))
  np.testing.assert_array_equal(np.asarray(cache.state_indices), [2, -1, 7])
  np.testing.assert_array_equal(np.asarray(drafts), [[0, 3, 4], [-1, -1, -1], [5, 6, 1]])
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), [72, 0, 135])
  # The next verify continues from exactly the accepted tokens: row 0 as if it had decoded 2 tokens, row 2 4.
  logits, cache = step.verify(jnp.asarray(second), cache, drafts)
  logits = np.asarray(logits)
  for row, kept in ((0, 2), (2, 4)):
    want, _ = one_by_one(step, running(cfg, step), list(first.T[:kept]) + list(second.T))
    close(logits[row], want[row, kept:])
  for state in cache.kda:  # slots 8 and 9 were never anyone's
    assert np.isnan(np.asarray(state.recurrent)[8:]).all() and np.isnan(np.asarray(state.conv_v)[8:]).all()
  assert all(np.isnan(np.asarray(kv)[10:]).all() for kv in cache.mla)  # pages no row holds


@budget(cpu=2, gpu=4)
@given(kept=st.tuples(st.integers(1, 1 + S), st.integers(1, 1 + S)), seed=st.integers(0, 2 ** 16))
def test_randomized_verify_accept_equals_decoding_the_kept_tokens(setup, kept, seed):
  """Random drafts and accepted counts per row: after verify + accept, a decode step equals decoding exactly the
  kept tokens one by one (full-precision f32 matmuls, as above)."""
  cfg, step = setup
  with jax.default_matmul_precision("highest"):
    toks = np.random.default_rng(seed).integers(0, cfg.vocab_size, (3, 2 + S)).astype(np.int32)
    toks[1] = 0
    _, cache = step.verify(jnp.asarray(toks[:, :1 + S]), running(cfg, step), jnp.asarray(DRAFTS))
    cache, _ = k3jax.accept(cache, jnp.asarray(DRAFTS), jnp.asarray([kept[0], 0, kept[1]], jnp.int32))
    got, _ = step.decode(jnp.asarray(toks[:, -1]), cache)
    for row, n in ((0, kept[0]), (2, kept[1])):
      want, _ = one_by_one(step, running(cfg, step), list(toks.T[:n]) + [toks[:, -1]])
      close(np.asarray(got)[row], want[row, -1])


def test_verify_and_accept_checks(setup):
  cfg, step = setup
  cache = running(cfg, step)
  toks = jnp.zeros((3, 1 + S), jnp.int32)
  cases = {
      "draft_slots must be -1 in idle rows": [[2, 3, 4], [8, -1, -1], [5, 6, 7]],
      "must be distinct and none of them a sequence's slot": [[2, 3, 4], [-1, -1, -1], [5, 6, 2]],
      r"none of them a sequence's slot \(cache.state_indices": [[0, 3, 4], [-1, -1, -1], [5, 6, 7]],
      r"pool slots in \[0, P = 10\)": [[2, 3, 10], [-1, -1, -1], [5, 6, 7]],
  }
  for match, drafts in cases.items():
    with pytest.raises(ValueError, match=match):
      step.verify(toks, cache, jnp.asarray(drafts, jnp.int32))
  with pytest.raises(ValueError, match=r"tokens must have shape \(3, 4\)"):
    step.verify(jnp.zeros((3, 3), jnp.int32), cache, jnp.asarray(DRAFTS))
  # Row 0 holds 5 pages (320 tokens) and its block table ends there: 318 + 4 tokens do not fit.
  full = cache.replace(seq_lens=jnp.asarray([318, 0, 131], jnp.int32))
  with pytest.raises(ValueError, match="room for 4 more token"):
    step.verify(toks, full, jnp.asarray(DRAFTS))
  holes = cache.replace(block_table=cache.block_table.at[2, 2].set(-1))  # row 2's 131 + 4 tokens need 3 pages
  with pytest.raises(ValueError, match=r"block_table\[2\] must hold page ids"):
    step.verify(toks, holes, jnp.asarray(DRAFTS))
  for bad in ([0, 1, 2], [2, 1, 5]):
    with pytest.raises(ValueError, match=r"num_accepted must be in \[1, 1 \+ S = 4\]"):
      k3jax.accept(cache, jnp.asarray(DRAFTS), jnp.asarray(bad, jnp.int32))


@pytest.mark.slow
def test_verify_on_a_mesh_matches_one_device(setup):
  """3 devices: KDA heads split, the verify's latent rows written by DCP to their owner devices."""
  cfg, step = setup
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(0))  # the parameters of ``step``'s model (same seed)
  mesh = device_mesh(3)
  placed, _ = sharding.shard_model(model, mesh)
  mstep = k3jax.jit_model_step(placed, mesh, vocab_size=cfg.vocab_size, compiler_options=FAST)
  toks = np.random.default_rng(23).integers(0, cfg.vocab_size, (2, 1 + S)).astype(np.int32)
  drafts = jnp.asarray(DRAFTS[[0, 2]])
  results = []
  for runner, cache in ((step, init_cache(cfg, 2, MAX_LEN, num_slots=10)),
                    (mstep, steps.init_mesh_cache(placed.cfg, 2, MAX_LEN, mesh, num_slots=10))):
    p = np.concatenate([prompt(cfg, 24, 100), prompt(cfg, 25, 61)])
    _, cache = runner.prefill(jnp.asarray(p), jnp.asarray([0, 100, 161], jnp.int32), cache)
    logits, cache = runner.verify(jnp.asarray(toks), cache, drafts)
    cache, next_drafts = k3jax.accept(cache, drafts, jnp.asarray([3, 1], jnp.int32))
    after, _ = runner.decode(jnp.asarray(toks[:, 0]), cache)
    results.append((np.asarray(logits), np.asarray(after), np.asarray(next_drafts)))
  (one, one_after, one_drafts), (many, many_after, many_drafts) = results
  close(many, one)
  close(many_after, one_after)
  np.testing.assert_array_equal(many_drafts, one_drafts)


def flows(cfg):
  """A prefix hit (a 130-token prompt admitted twice at a 64-token interval: the second skips 128 tokens) and a
  verify + accept, with the row's KDA states after each: the arrays ``test_serving_under_the_kernels``
  compares between impls."""
  step = k3jax.jit_model_step(k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(3)), compiler_options=FAST)
  cache, pc = fresh(cfg)
  p = prompt(cfg, 30, 130)
  _, cache, (a,) = serving.admit(step, cache, pc, [serving.Request(0, p, NEW)])
  cache = serving.finish(cache, pc, a)
  hit, cache, (b,) = serving.admit(step, cache, pc, [serving.Request(1, p, NEW)])
  assert b.cached_tokens == 128
  states = lambda c, slot: [np.asarray(getattr(state, n)[slot], np.float64) for state in c.kda
                            for n in ("recurrent", "conv_v")]
  out = {"hit": np.asarray(hit)[1], "hit_states": states(cache, b.slot)}
  toks = jnp.asarray(np.stack([np.zeros(1 + S, np.int32), prompt(cfg, 31, 1 + S)]))
  drafts = jnp.asarray([[-1] * S, list(pc.slots.allocate(S))], jnp.int32)
  logits, cache = step.verify(toks, cache, drafts)
  cache, _ = k3jax.accept(cache, drafts, jnp.asarray([0, 3], jnp.int32))
  out.update(verify=np.asarray(logits)[1], accepted_states=states(cache, int(cache.state_indices[1])))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_serving_under_the_kernels(impl):
  """Prefix hit and verify + accept with the Mosaic GPU kernels (interpret mode on the CPU) equal the xla run.

  bf16 activations and cache (the kernels take bf16), K and the MLA head dims 64 (the kernels' multiples), dense
  FFNs (a rounding difference could flip a top-k choice); the states are f32: the kernels and the references
  round the bf16 inputs differently."""
  base = preset("tiny", impl="xla", num_hidden_layers=2, layer_types=("kda", "mla"), kda_head_dim=64,
                qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2)
  want, got = flows(base), flows(base.replace(impl=impl))
  for key in ("hit", "verify"):
    a, b = got[key], want[key]
    assert a.shape == b.shape and np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=5e-2, rtol=5e-2, err_msg=key)
  for key in ("hit_states", "accepted_states"):
    for a, b in zip(got[key], want[key]):
      assert np.isfinite(a).all()
      err = np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))
      assert err <= 0.01, (key, err)  # the f32-state checkpoint tolerance

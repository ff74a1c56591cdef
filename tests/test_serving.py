"""Prefix-cached prefill through the model (``k3jax.serving``): a hit skips the cached prefix and gives the logits of
an uncached prefill; shared pages are never written; idle rows; checkpoints and slot copies; every rejected
request leaves the pools and the cache as they were.

The model is the tiny preset in float32 (impl xla) on one CPU device. Prompts are 200 tokens at a 64-token
interval: an uncached prompt saves checkpoints at 64, 128 and 192, and a repeat of it hits at 192.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layer_oracles import tiny

import k3jax
from k3jax import serving, sharding, steps
from k3jax.cache import Checkpoints, SlotAllocator, init_cache
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
  for st in full.kda:
    assert np.isnan(np.asarray(st.recurrent)[[2, 3]]).all() and np.isnan(np.asarray(st.conv_q)[[2, 3]]).all()


def test_hit_on_a_mesh_matches_one_device(setup):
  """On a 3-device mesh (KDA heads split, the MLA cache split over tokens by DCP) a boundary is a multiple of
  64 x 3 tokens: the repeat of a 200-token prompt hits at 192 and matches the one-device uncached logits."""
  cfg, step = setup
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(0))  # the parameters of ``step``'s model (same seed)
  mesh = sharding.make_mesh(3)
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

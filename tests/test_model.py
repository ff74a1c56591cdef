"""Whole model: prefill vs a float64 NumPy forward, prefill == prefill + decodes, varlen == alone, impls,
storage dtypes, the jitted API with a donated cache (its host checks of index values, an empty prefill), and
input validation.

Every prefill here has the same T and N so that one compiled prefill and one compiled decode serve a
config: a third "filler" sequence takes whatever tokens the two real sequences do not use.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layer_oracles import F32, assert_close, np_attn_res, np_kda, np_mla, np_mlp, np_moe, np_rms, npf, tiny
from support import device_mesh, fast_jit

import k3jax
from k3jax import config as cfg_lib
from k3jax import nn_util, ops
from k3jax.cache import SlotAllocator, init_cache
from pallas_kernels.mla import cache_format

T = 20  # packed tokens of every prefill below
MAX_LEN = 80


class Runner:
  """A model with ``fast_jit`` prefill/decode compiled once per input structure."""

  def __init__(self, cfg, seed=0):
    self.cfg = cfg
    self.model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(seed))
    graph, self.state = nnx.split(self.model)
    self._prefill = fast_jit(lambda st, tok, cu, cache: nnx.merge(graph, st).prefill(tok, cu, cache))
    self._decode = fast_jit(lambda st, tok, cache: nnx.merge(graph, st).decode(tok, cache))

  def cache(self):
    return init_cache(self.cfg, 3, MAX_LEN, num_slots=4, fill=np.nan)

  def prefill(self, tokens, lens, cache):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return self._prefill(self.state, jnp.asarray(tokens, jnp.int32), jnp.asarray(cu), cache)

  def decode(self, tokens, cache):
    return self._decode(self.state, jnp.asarray(tokens, jnp.int32), cache)


_RUNNERS = {}


def runner(name):
  if name not in _RUNNERS:
    _RUNNERS[name] = Runner(tiny(name))
  return _RUNNERS[name]


def tokens_for(cfg, seed, n=T):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


def np_model(cfg, model, tokens, cu):
  """Float64 HF forward of fresh packed sequences: ``logits [T, vocab]``."""
  x = npf(model.embed_tokens)[tokens]
  blocks = []
  for i, layer in enumerate(model.layers):
    a_mod = layer.self_attn

    def attn(h, a_mod=a_mod, i=i):
      return (np_kda if cfg.layer_types[i] == "kda" else np_mla)(cfg, a_mod, h, cu)[0]

    def ffn(h, layer=layer, i=i):
      return np_moe(cfg, layer.block_sparse_moe, h) if cfg.is_moe(i) else np_mlp(cfg, layer.mlp, h)

    ln1, ln2 = npf(layer.input_layernorm.weight), npf(layer.post_attention_layernorm.weight)
    eps = cfg.rms_norm_eps
    if cfg.attn_res_block_size is None:
      x = x + attn(np_rms(x, ln1, eps))
      x = x + ffn(np_rms(x, ln2, eps))
      continue
    h = np_attn_res(layer.self_attention_res, x, blocks, eps)
    prefix = x
    if i % cfg.attn_res_block_size == 0:
      blocks.append(x)
      prefix = None
    a = attn(np_rms(h, ln1, eps))
    prefix = a if prefix is None else prefix + a
    h = np_attn_res(layer.mlp_res, prefix, blocks, eps)
    x = prefix + ffn(np_rms(h, ln2, eps))
  if cfg.attn_res_block_size is not None:
    x = np_attn_res(model.output_attn_res, x, blocks, cfg.rms_norm_eps)
  x = np_rms(x, npf(model.norm.weight), cfg.rms_norm_eps)
  head = npf(model.embed_tokens).T if cfg.tie_word_embeddings else npf(model.lm_head.kernel)
  return x @ head


FORMATS = ["tiny", "tiny_linear"]


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_matches_numpy_forward(name):
  r = runner(name)
  lens = [9, 5, T - 14]
  toks = tokens_for(r.cfg, 1)
  logits, cache = r.prefill(toks, lens, r.cache())
  assert logits.shape == (T, r.cfg.vocab_size) and logits.dtype == jnp.float32
  ref = np_model(r.cfg, r.model, toks, np.concatenate([[0], np.cumsum(lens)]))
  # f32 through 6 layers of O(1)-scaled activations against float64.
  assert_close(logits, ref, atol=5e-4, rtol=5e-4)
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), lens)


def _cache_rows(cache, n, length):
  """Sequence n's KDA slot states and its first ``length`` latent rows of every MLA layer (f64)."""
  slot = int(cache.state_indices[n])
  out = []
  for st in cache.kda:
    out += [np.asarray(a[slot], np.float64) for a in (st.recurrent, st.conv_q, st.conv_k, st.conv_v)]
  table = np.asarray(cache.block_table[n])
  pos = np.arange(length)
  for kv in cache.mla:
    out.append(np.asarray(kv, np.float64)[table[pos // 64], pos % 64])
  return out


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_equals_prefill_then_decodes(name):
  r = runner(name)
  j = 3
  toks = tokens_for(r.cfg, 2)
  full_lens = [9, 5, T - 14]
  full_logits, full_cache = r.prefill(toks, full_lens, r.cache())
  seq0, seq1 = toks[:9], toks[9:14]
  short_toks = np.concatenate([seq0[:9 - j], seq1[:5 - j], tokens_for(r.cfg, 3, T - 14 + 2 * j)])
  logits, cache = r.prefill(short_toks, [9 - j, 5 - j, T - 14 + 2 * j], r.cache())
  # The prefix logits are those of the full prefill (causality), then each decode step gives the next row.
  assert_close(logits[:9 - j], np.asarray(full_logits[:9 - j]), atol=2e-5, rtol=2e-5)
  for i in range(j):
    step_logits, cache = r.decode([seq0[9 - j + i], seq1[5 - j + i], 7], cache)
    assert step_logits.shape == (3, r.cfg.vocab_size) and step_logits.dtype == jnp.float32
    # Chunked vs recurrent KDA and non-absorbed vs absorbed MLA: same math, f32 rounding differs.
    assert_close(step_logits[0], np.asarray(full_logits[9 - j + i]), atol=2e-4, rtol=2e-4)
    assert_close(step_logits[1], np.asarray(full_logits[9 + 5 - j + i]), atol=2e-4, rtol=2e-4)
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), [9, 5, T - 14 + 3 * j])
  for n, length in ((0, 9), (1, 5)):
    for a, b in zip(_cache_rows(cache, n, length), _cache_rows(full_cache, n, length)):
      assert_close(a, b, atol=1e-4, rtol=1e-4)
  # The spare pool slot (3) was never assigned to a sequence: still NaN everywhere.
  for st in cache.kda:
    assert np.isnan(np.asarray(st.recurrent[3])).all() and np.isnan(np.asarray(st.conv_v[3])).all()


@pytest.mark.parametrize("name", FORMATS)
def test_chunked_prefill_equals_one_prefill(name):
  r = runner(name)
  toks = tokens_for(r.cfg, 2)  # the full prefill of test_prefill_equals_prefill_then_decodes
  full_logits, full_cache = r.prefill(toks, [9, 5, T - 14], r.cache())
  seq0, seq1 = toks[:9], toks[9:14]
  first = np.concatenate([seq0[:6], seq1[:3], tokens_for(r.cfg, 8, T - 9)])
  _, cache = r.prefill(first, [6, 3, T - 9], r.cache())
  second = np.concatenate([seq0[6:], seq1[3:], tokens_for(r.cfg, 9, T - 5)])
  logits, cache = r.prefill(second, [3, 2, T - 5], cache)
  # The second chunk reads the KDA states, conv windows and latent rows the first one left.
  assert_close(logits[:3], np.asarray(full_logits[6:9]), atol=2e-4, rtol=2e-4)
  assert_close(logits[3:5], np.asarray(full_logits[12:14]), atol=2e-4, rtol=2e-4)
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), [9, 5, 2 * T - 14])
  for n, length in ((0, 9), (1, 5)):
    for a, b in zip(_cache_rows(cache, n, length), _cache_rows(full_cache, n, length)):
      assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
def test_varlen_batch_equals_each_sequence_alone(name):
  r = runner(name)
  toks = tokens_for(r.cfg, 4)
  lens = [9, 5, T - 14]
  batch_logits, batch_cache = r.prefill(toks, lens, r.cache())
  for n, (s, e) in enumerate(((0, 9), (9, 14))):
    alone_lens = [0, 0, 0]
    alone_lens[n] = e - s
    alone_lens[2] = T - (e - s)
    filler = tokens_for(r.cfg, 5 + n, T - (e - s))
    alone_toks = np.concatenate([toks[s:e], filler])
    logits, cache = r.prefill(alone_toks, alone_lens, r.cache())
    # Same ops on the same rows; only the packing (and so the MoE token order) differs.
    assert_close(logits[:e - s], np.asarray(batch_logits[s:e]), atol=1e-5, rtol=1e-5)
    for a, b in zip(_cache_rows(cache, n, e - s), _cache_rows(batch_cache, n, e - s)):
      assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The sequence left out (length 0) keeps its NaN slot and its length 0.
    other = 1 - n
    assert int(cache.seq_lens[other]) == 0
    assert all(np.isnan(a).all() for a in _cache_rows(cache, other, 0))


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("impl", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_block_under_every_supported_impl(impl, cache_dtype):
  """A K3 decoder layer per mixer kind (prefill + one decode) under ``impl`` equals the ``xla`` result, with a
  bf16 and with an fp8 latent cache."""
  # bf16 activations and cache (the Mosaic GPU kernels take bf16 q/kv); K = 64 (the KDA kernel needs 64 or
  # 128) and MLA head dims 64 (the prefill kernel's multiple). Dense FFNs: the MoE runs no kernel, and a
  # bf16-rounding difference could flip a top-k choice. MLA first, for the same reason: its input (the
  # embeddings) is then the same under both impls, and so are its fp8 cache rows; behind a KDA layer the impls'
  # bf16 rounding moves some e4m3 values by one unit (2^-3 relative), and that moves the logits by more than the
  # kernels' own rounding.
  base = cfg_lib.preset("tiny", impl="xla", num_hidden_layers=2, layer_types=("mla", "kda"), kda_head_dim=64,
                        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2, cache_dtype=cache_dtype)
  results = {}
  for name in ("xla", impl):
    cfg = base.replace(impl=name)
    model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(11))
    graph, state = nnx.split(model)
    toks = tokens_for(cfg, 12, 12)
    cu = jnp.asarray([0, 7, 12], jnp.int32)

    def run(state, toks, cu, cache, graph=graph):
      m = nnx.merge(graph, state)
      logits, cache = m.prefill(toks, cu, cache)
      step, cache = m.decode(jnp.asarray([1, 2], jnp.int32), cache)
      return logits, step, cache

    results[name] = fast_jit(run)(state, jnp.asarray(toks), cu, init_cache(cfg, 2, 64))
  got, want = results[impl], results["xla"]
  # bf16 activations: kernels and references round differently; logits are O(1).
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == jnp.float8_e4m3fn:
      # Compared as the values the rows hold (their scale bytes are no fp8 numbers). With MLA first their
      # input is the same under both impls; one e4m3 unit (2^-3 relative) is still allowed for a rounding
      # difference in how an impl computes a row before it is quantized.
      a, b = (cache_format.dequantize_rows(x, cfg.kv_lora_rank) for x in (a, b))
      np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=5e-2, rtol=2.0 ** -3)
      continue
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a64).any()
    np.testing.assert_allclose(a64, b64, atol=5e-2, rtol=5e-2)


def test_storage_dtypes_follow_the_config(monkeypatch):
  """``state_dtype``, ``cache_dtype``, ``conv_dtype`` set the stored arrays (here opposite to the f32 default
  of ``tiny`` / the activations) and ``partial_dtype`` reaches ``mla_decode`` (decode: a prefill reads its
  cached prefix non-absorbed, without it)."""
  seen = []
  real = ops.mesh_mla_decode

  def spy(*args, config, **kw):
    seen.append(config.partial_dtype)
    return real(*args, config=config, **kw)

  monkeypatch.setattr(ops, "mesh_mla_decode", spy)
  cfg = cfg_lib.preset("tiny", **{**F32, "num_hidden_layers": 2, "layer_types": ("kda", "mla"),
                                  "state_dtype": jnp.bfloat16, "cache_dtype": jnp.bfloat16,
                                  "conv_dtype": jnp.bfloat16, "partial_dtype": jnp.bfloat16})
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(13))
  graph, state = nnx.split(model)

  def run(state, cache):
    m = nnx.merge(graph, state)
    _, cache = m.prefill(jnp.arange(9, dtype=jnp.int32), jnp.asarray([0, 9], jnp.int32), cache)
    return m.decode(jnp.asarray([3], jnp.int32), cache)

  logits, cache = fast_jit(run)(state, init_cache(cfg, 1, 64))
  assert seen == [jnp.bfloat16]
  assert cache.kda[0].recurrent.dtype == jnp.bfloat16 and cache.mla[0].dtype == jnp.bfloat16
  assert cache.kda[0].conv_q.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()


def test_jitted_api_donates_the_cache():
  cfg = cfg_lib.preset("tiny_linear", **{**F32, "num_hidden_layers": 1, "layer_types": ("kda",)})
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(14))
  cache = init_cache(cfg, 2, 64)
  old = cache.kda[0].recurrent
  logits, cache = k3jax.prefill(model, jnp.arange(10, dtype=jnp.int32), jnp.asarray([0, 4, 10], jnp.int32),
                                cache)
  assert old.is_deleted()
  step, cache = k3jax.decode(model, jnp.asarray([5, 6], jnp.int32), cache)
  assert logits.shape == (10, cfg.vocab_size) and step.shape == (2, cfg.vocab_size)
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), [5, 7])


def test_one_device_step_is_the_mesh_step_without_a_mesh():
  """``k3jax.prefill``/``decode`` are ``jit_model_step(model)``: one jitted pair per model graph, reused by every
  call (no re-trace for a second call or a second model of the same structure), equal to the model's own
  methods."""
  cfg = cfg_lib.preset("tiny_linear", **{**F32, "num_hidden_layers": 1, "layer_types": ("kda",)})
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(17))
  step = k3jax.jit_model_step(model)
  assert step.mesh is None and step.vocab_size == cfg.vocab_size
  again = k3jax.jit_model_step(k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(18)))
  assert again.prefill_jit is step.prefill_jit and again.decode_jit is step.decode_jit
  tokens, cu = jnp.arange(10, dtype=jnp.int32), jnp.asarray([0, 4, 10], jnp.int32)
  logits, cache = step.prefill(tokens, cu, init_cache(cfg, 2, 64))
  want, want_cache = model.prefill(tokens, cu, init_cache(cfg, 2, 64))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
  logits, _ = k3jax.decode(model, jnp.asarray([5, 6], jnp.int32), cache)
  want, _ = model.decode(jnp.asarray([5, 6], jnp.int32), want_cache)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_prefill_last_only_gives_each_sequences_last_logits():
  """``last_only`` returns row ``cu_seqlens[n + 1] - 1`` of the full logits per sequence (NaN for an empty one),
  leaves the same cache, and an all-empty prefill gives N NaN rows."""
  cfg, model = _kda_mla_model(19)
  tokens, cu = jnp.arange(10, dtype=jnp.int32), jnp.asarray([0, 4, 4, 10], jnp.int32)
  full, cache_full = k3jax.prefill(model, tokens, cu, init_cache(cfg, 3, 64))
  last, cache_last = k3jax.prefill(model, tokens, cu, init_cache(cfg, 3, 64), last_only=True)
  assert last.shape == (3, cfg.vocab_size) and last.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(last)[[0, 2]], np.asarray(full)[[3, 9]], rtol=1e-5, atol=1e-5)
  assert np.isnan(np.asarray(last)[1]).all()
  for a, b in zip(jax.tree.leaves(cache_last), jax.tree.leaves(cache_full), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  empty, _ = k3jax.prefill(model, jnp.zeros((0,), jnp.int32), jnp.zeros(4, jnp.int32), cache_last, last_only=True)
  assert empty.shape == (3, cfg.vocab_size) and np.isnan(np.asarray(empty)).all()


def _kda_mla_model(seed: int):
  """A 2-layer model (one KDA, one MLA layer) for the tests of the jitted API."""
  cfg = cfg_lib.preset("tiny_linear", **{**F32, "num_hidden_layers": 2, "layer_types": ("kda", "mla")})
  return cfg, k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(seed))


def test_jitted_api_checks_index_values_before_running():
  """Under ``nnx.jit`` the model's own value checks see tracers; ``k3jax.prefill`` / ``decode`` check the concrete
  values first, so a bad call raises and leaves the (otherwise donated) cache alive."""
  cfg, model = _kda_mla_model(15)
  cache = init_cache(cfg, 2, 64)  # capacity 64 tokens per sequence
  vocab = cfg.vocab_size
  with pytest.raises(ValueError, match="cu_seqlens must give lengths that fit the cache capacity 64 "):
    k3jax.prefill(model, jnp.zeros(200, jnp.int32), jnp.asarray([0, 200, 200], jnp.int32), cache)
  with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing from 0 to T = 5, got \[1, 3, 4\]"):
    k3jax.prefill(model, jnp.zeros(5, jnp.int32), jnp.asarray([1, 3, 4], jnp.int32), cache)
  with pytest.raises(ValueError, match=rf"tokens must be ids in \[0, vocab_size = {vocab}\), got values in "
                                       rf"\[0, {vocab}\]"):
    k3jax.prefill(model, jnp.asarray([0, vocab], jnp.int32), jnp.asarray([0, 1, 2], jnp.int32), cache)
  with pytest.raises(ValueError, match=rf"tokens must be ids in \[0, vocab_size = {vocab}\), got values in "
                                       r"\[-1, 0\]"):
    k3jax.decode(model, jnp.asarray([-1, 0], jnp.int32), cache)
  full = cache.replace(seq_lens=jnp.asarray([64, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"cache.seq_lens must leave room for 1 more token\(s\) per active sequence "
                                        r"\(the cache capacity is 64\), got \[64, 3\]"):
    k3jax.decode(model, jnp.asarray([1, 2], jnp.int32), full)
  with pytest.raises(ValueError, match=r"cache capacity 64 after the cached tokens \[64, 3\], got \[0, 0, 62\]"):
    k3jax.prefill(model, jnp.zeros(62, jnp.int32), jnp.asarray([0, 0, 62], jnp.int32), full)
  assert not any(a.is_deleted() for a in jax.tree.leaves((cache, full)))


def test_empty_prefill_returns_no_logits_and_the_cache_unchanged():
  cfg, model = _kda_mla_model(16)
  cache = init_cache(cfg, 2, 64, fill=np.nan).replace(seq_lens=jnp.asarray([3, 0], jnp.int32))
  before = [np.asarray(a) for a in jax.tree.leaves(cache)]
  logits, cache = k3jax.prefill(model, jnp.zeros((0,), jnp.int32), jnp.zeros(3, jnp.int32), cache)
  assert logits.shape == (0, cfg.vocab_size) and logits.dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(cache), before, strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_parameter_paths_carry_logical_axes():
  model = k3jax.KimiK3Model(tiny("tiny"), rngs=nnx.Rngs(0))
  axes = nn_util.logical_axes(model)
  assert axes["embed_tokens"] == ("vocab", "embed")
  assert axes["layers.0.self_attn.q_proj.kernel"] == ("embed", "kda_heads", "kda_head_dim")
  assert axes["layers.2.self_attn.kv_b_proj.w_uk"] == ("kv_lora", "heads", "qk_nope_dim")
  assert axes["layers.1.block_sparse_moe.experts.w1"] == ("experts", "moe_embed", "moe_mlp")
  assert axes["layers.0.mlp.down_proj.kernel"] == ("mlp", "embed")
  assert axes["output_attn_res.proj"] == ("embed", None)
  for path, names in axes.items():
    assert all(n is None or n in nn_util.LOGICAL_AXES for n in names), path


def test_bad_inputs_raise():
  r = runner("tiny")
  cache = r.cache()
  with pytest.raises(ValueError, match="cu_seqlens must have shape"):
    r.model.prefill(jnp.zeros(4, jnp.int32), jnp.asarray([0, 4], jnp.int32), cache)
  with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing from 0 to T = 4, got \[0, 3, 2, 4\]"):
    r.model.prefill(jnp.zeros(4, jnp.int32), jnp.asarray([0, 3, 2, 4], jnp.int32), cache)
  with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing from 0 to T = 4, got \[0, 4, 4, 3\]"):
    r.model.prefill(jnp.zeros(4, jnp.int32), jnp.asarray([0, 4, 4, 3], jnp.int32), cache)
  with pytest.raises(ValueError, match="cache capacity 128 "):
    r.model.prefill(jnp.zeros(130, jnp.int32), jnp.asarray([0, 130, 130, 130], jnp.int32), cache)
  # On a mesh the same block table addresses a DCP cache: 2 local pages on each of 9 devices.
  with jax.set_mesh(device_mesh(9)), pytest.raises(ValueError, match="cache capacity 1152 "):
    r.model.prefill(jnp.zeros(1153, jnp.int32), jnp.asarray([0, 1153, 1153, 1153], jnp.int32), cache)
  _, cache = r.prefill(tokens_for(r.cfg, 0), [T, 0, 0], cache)
  with pytest.raises(ValueError, match="cache capacity"):  # 20 cached + 110 new > 128
    r.model.prefill(jnp.zeros(110, jnp.int32), jnp.asarray([0, 110, 110, 110], jnp.int32), cache)
  with pytest.raises(ValueError, match=r"prefix_rows must be an int >= the cached tokens of the sequences with new "
                                        r"tokens \(20\), got 19"):
    r.model.prefill(jnp.zeros(4, jnp.int32), jnp.asarray([0, 4, 4, 4], jnp.int32), cache, prefix_rows=19)
  with pytest.raises(ValueError, match="tokens must have dtype"):
    r.model.prefill(jnp.zeros(4, jnp.float32), jnp.asarray([0, 4, 4, 4], jnp.int32), cache)
  with pytest.raises(ValueError, match="tokens must have shape"):
    r.model.decode(jnp.zeros(2, jnp.int32), cache)
  with pytest.raises(ValueError, match=r"cache.seq_lens must leave room for 1 more token\(s\) per active sequence "
                                        r"\(the cache capacity is 128\), got \[128, 0, 0\]"):
    r.model.decode(jnp.zeros(3, jnp.int32), cache.replace(seq_lens=jnp.asarray([128, 0, 0], jnp.int32)))
  with pytest.raises(ValueError, match="names must have one entry"):
    nn_util.param(nnx.Rngs(0), nn_util.norm_weight, (3, 4), jnp.float32, ("embed",))
  with pytest.raises(ValueError, match="logical axes"):
    nn_util.param(nnx.Rngs(0), nn_util.norm_weight, (3,), jnp.float32, ("hidden",))


def test_slot_allocator_and_init_cache():
  slots = SlotAllocator(4)
  assert slots.allocate(2) == [0, 1] and slots.num_free == 2
  slots.free([0])
  assert slots.allocate(2) == [0, 2]
  with pytest.raises(ValueError, match="cannot allocate 2 ids"):
    slots.allocate(2)
  with pytest.raises(ValueError, match="ids to free must be allocated"):
    slots.free([3])  # never allocated
  with pytest.raises(ValueError, match="ids to free must be allocated"):
    slots.free([7])
  with pytest.raises(ValueError, match="num must be >= 1"):
    SlotAllocator(0)
  cfg = tiny("tiny", state_dtype=jnp.bfloat16)
  cache = init_cache(cfg, 2, 65, num_slots=3)
  assert cache.block_table.shape == (2, 2) and cache.state_indices.tolist() == [0, 1]
  assert len(cache.kda) == 3 and len(cache.mla) == 3
  assert cache.kda[0].recurrent.shape == (3, 4, 16, 16) and cache.kda[0].recurrent.dtype == jnp.bfloat16
  assert cache.kda[0].conv_q.shape == (3, 3, 64) and cache.mla[0].shape == (4, 64, 576)
  with pytest.raises(ValueError, match="num_seqs and max_seq_len must be >= 1"):
    init_cache(cfg, 0, 10)
  with pytest.raises(ValueError, match="cannot allocate 3 ids"):
    init_cache(cfg, 3, 10, num_slots=2)


def test_tiny9_sharded_dims_divide_by_9():
  model = k3jax.KimiK3Model(tiny("tiny9"), rngs=nnx.Rngs(0))
  shapes = {p: v.shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  for path, names in nn_util.logical_axes(model).items():
    shape = shapes[tuple(int(p) if p.isdigit() else p for p in path.split("."))]
    for dim, name in zip(shape, names):
      if name in ("heads", "kda_heads", "experts", "mlp", "vocab"):
        assert dim % 9 == 0, (path, name, dim)

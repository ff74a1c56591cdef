"""The Kimi-K3 model sharded over 9 CPU devices (impl="xla"): parameter layout, padding, the jitted step."""

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from support import device_mesh, fast_jit

from k3jax import cache as cache_lib, model as model_lib, ops, padding, sharding, steps
from k3jax.config import KDA, PAGE_SIZE, preset
from pallas_kernels.mla import cache_format

M = sharding.MODEL
N = 9

# Expected layout of every parameter, by its path inside a decoder layer (or at the top level).
GOLDEN = {
    "embed_tokens": P(M, None), "lm_head.kernel": P(None, M), "norm.weight": P(None),
    "output_attn_res.norm": P(None), "output_attn_res.proj": P(None, None),
    "input_layernorm.weight": P(None), "post_attention_layernorm.weight": P(None),
    "self_attention_res.norm": P(None), "self_attention_res.proj": P(None, None),
    "mlp_res.norm": P(None), "mlp_res.proj": P(None, None),
    # MLA: column-parallel into heads, row-parallel out of them; the latent projections stay whole.
    "self_attn.q_a_proj.kernel": P(None, None), "self_attn.q_a_layernorm.weight": P(None),
    "self_attn.q_b_proj.kernel": P(None, M, None), "self_attn.kv_a_proj_with_mqa.kernel": P(None, None),
    "self_attn.kv_a_layernorm.weight": P(None), "self_attn.kv_b_proj.w_uk": P(None, M, None),
    "self_attn.kv_b_proj.w_uv": P(None, M, None), "self_attn.g_proj.kernel": P(None, M, None),
    "self_attn.o_proj.kernel": P(M, None, None),
    # KDA: everything per head is split by heads (g_proj and o_proj share their names with MLA's).
    "self_attn.q_proj.kernel": P(None, M, None), "self_attn.k_proj.kernel": P(None, M, None),
    "self_attn.v_proj.kernel": P(None, M, None), "self_attn.q_conv1d.weight": P(M, None, None),
    "self_attn.k_conv1d.weight": P(M, None, None), "self_attn.v_conv1d.weight": P(M, None, None),
    "self_attn.f_a_proj.kernel": P(None, None), "self_attn.f_b_proj.kernel": P(None, M, None),
    "self_attn.b_proj.kernel": P(None, M), "self_attn.A_log": P(M), "self_attn.dt_bias": P(M, None),
    "self_attn.o_norm.weight": P(None),
    # Dense MLP and shared experts: split FFN width. Routed experts: expert parallel.
    "mlp.gate_proj.kernel": P(None, M), "mlp.up_proj.kernel": P(None, M), "mlp.down_proj.kernel": P(M, None),
    "block_sparse_moe.gate.kernel": P(None, M), "block_sparse_moe.gate.e_score_correction_bias": P(M),
    "block_sparse_moe.experts.w1": P(M, None, None), "block_sparse_moe.experts.w3": P(M, None, None),
    "block_sparse_moe.experts.w2": P(M, None, None),
    "block_sparse_moe.shared_experts.gate_proj.kernel": P(None, M),
    "block_sparse_moe.shared_experts.up_proj.kernel": P(None, M),
    "block_sparse_moe.shared_experts.down_proj.kernel": P(M, None),
    "block_sparse_moe.routed_expert_down_proj.kernel": P(None, None),
    "block_sparse_moe.routed_expert_up_proj.kernel": P(None, None),
    "block_sparse_moe.routed_expert_norm.weight": P(None),
}
# Parameters allowed to stay whole on every device: norms, AttnRes queries and the low-rank/latent projections.
REPLICATED = re.compile(r"(norm|_res\.proj|q_a_proj|kv_a_proj_with_mqa|f_a_proj|g_a_proj|"
                        r"routed_expert_(down|up)_proj)")


def flat_specs(model):
  return {re.sub(r"^layers\.\d+\.", "", ".".join(map(str, path))): spec
          for path, spec in nnx.to_flat_state(sharding.param_specs(model))}


@pytest.fixture(scope="module")
def tiny():
  """A 2-layer K3 block pair: MLA + dense MLP, then KDA + latent MoE (4 heads, 8 experts: none divide by 9)."""
  cfg = preset("tiny", impl="xla", dtype=jnp.float32, param_dtype=jnp.float32, num_hidden_layers=2,
               layer_types=("mla", "kda"), partial_dtype=jnp.float32, state_dtype=jnp.float32)
  return model_lib.KimiK3Model(cfg, rngs=nnx.Rngs(0))


def test_golden_partition_specs_and_padding(tiny):
  mesh = device_mesh(N)
  model, plan = sharding.shard_model(tiny, mesh)
  assert plan.applied == {"num_attention_heads": (4, 9), "kda_num_heads": (4, 9), "num_experts": (8, 9),
                          "vocab_size": (256, 261), "intermediate_size": (96, 99),
                          "moe_intermediate_size": (32, 36)}
  specs = flat_specs(model)
  assert set(specs) <= set(GOLDEN) and len(set(specs)) >= 45
  for path, spec in specs.items():
    assert spec == GOLDEN[path], path
  for path, var in nnx.to_flat_state(nnx.state(model)):
    assert var.get_value().sharding.is_equivalent_to(sharding.named_sharding(mesh, *var.logical_axes), var.ndim)
  # Padded units: zero weights, a -inf correction bias; the real ones keep their values.
  moe, attn = model.layers[1].block_sparse_moe, model.layers[1].self_attn
  bias = np.asarray(moe.gate.e_score_correction_bias[...])
  assert np.isneginf(bias[8:]).all() and np.isfinite(bias[:8]).all()
  np.testing.assert_array_equal(bias[:8], np.asarray(tiny.layers[1].block_sparse_moe.gate.e_score_correction_bias[...]))
  assert (np.asarray(moe.experts.w1[...])[8:] == 0).all() and (np.asarray(attn.o_proj.kernel[...])[4:] == 0).all()
  with pytest.raises(ValueError, match="made for other sizes"):
    plan.config(model.cfg)


def test_k3_layout_on_9_and_8_devices():
  cfg = preset("kimi_k3", impl="xla").replace(num_hidden_layers=4, layer_types=(KDA, KDA, KDA, "mla"))
  plan = padding.PaddingPlan.for_config(cfg, 9)
  assert plan.applied == {"num_attention_heads": (96, 99), "kda_num_heads": (96, 99), "num_experts": (896, 900),
                          "vocab_size": (163840, 163845), "intermediate_size": (33792, 33795),
                          "moe_intermediate_size": (3072, 3078)}
  assert padding.PaddingPlan.for_config(cfg, 8).applied == {}
  model = nnx.eval_shape(lambda: model_lib.KimiK3Model(plan.config(cfg), rngs=nnx.Rngs(0)))
  specs = flat_specs(model)
  assert all(spec == GOLDEN[path] for path, spec in specs.items())
  # No large parameter is replicated: the whole ones are exactly the allowed kinds, and hold under 3% of a
  # device's parameter bytes at real K3 sizes (the routed experts dominate, split 9 ways).
  per_device = replicated = 0
  for path, var in nnx.to_flat_state(nnx.state(model)):
    name, size = ".".join(map(str, path)), math.prod(var.shape) * var.dtype.itemsize
    split = any(a is not None for a in sharding.spec(*var.logical_axes))
    if not split:
      assert REPLICATED.search(name), name
      replicated += size
    per_device += size / N if split else size
  assert replicated < 0.03 * per_device, (replicated, per_device)


def test_unpadded_model_is_refused(tiny):
  mesh = device_mesh(N)
  with pytest.raises(ValueError, match=r"layers.0.self_attn.q_b_proj.kernel: dim 1 \('heads'\)"):
    sharding.check_divisible("layers.0.self_attn.q_b_proj.kernel", tiny.layers[0].self_attn.q_b_proj.kernel.shape,
                             ("q_lora", "heads", "qk_head_dim"), mesh)
  with pytest.raises(ValueError, match="tp must be an int >= 1"):
    padding.PaddingPlan.for_config(tiny.cfg, 0)
  with pytest.raises(ValueError, match="field must be one of"):
    padding.PaddingPlan.for_config(tiny.cfg, N).padded("hidden_size")


def test_layers_run_the_mesh_aware_ops(tiny, monkeypatch):
  # The DCP latent cache is only correct when every MLA write and read goes through k3jax.ops, and the KDA
  # pools when the KDA and conv ops run per device: a spy counts the calls the sharded step traces.
  seen = collections.Counter()
  for name in ("mesh_write_rows", "mesh_read_rows", "mesh_mla_decode", "mesh_mla_prefill_attention",
               "mesh_kda_prefill", "mesh_kda_decode", "mesh_short_conv_prefill", "mesh_short_conv_update"):
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **kw: seen.update([_name]) or _real(*a, **kw))
  mesh = device_mesh(N)
  placed, _ = sharding.shard_model(tiny, mesh)
  step = steps.jit_model_step(placed, mesh, vocab_size=tiny.cfg.vocab_size, compiler_options=FAST)
  _, cache = step.prefill(jnp.zeros(4, jnp.int32), jnp.asarray([0, 1, 4], jnp.int32),
                          steps.init_mesh_cache(placed.cfg, 2, 64, mesh))
  # One MLA layer (a fresh prefill: write, attention among the new tokens) and one KDA layer (q, k and v
  # convolutions).
  kda_prefill = {"mesh_kda_prefill": 1, "mesh_short_conv_prefill": 3}
  assert seen == {"mesh_write_rows": 1, "mesh_mla_prefill_attention": 1, **kda_prefill}
  seen.clear()
  # A chunk after cached tokens also reads them back.
  _, cache = step.prefill(jnp.zeros(3, jnp.int32), jnp.asarray([0, 2, 3], jnp.int32), cache)
  assert seen == {"mesh_write_rows": 1, "mesh_read_rows": 1, "mesh_mla_prefill_attention": 1, **kda_prefill}
  seen.clear()
  step.decode(jnp.zeros(2, jnp.int32), cache)
  assert seen == {"mesh_write_rows": 1, "mesh_mla_decode": 1, "mesh_kda_decode": 1, "mesh_short_conv_update": 3}


def test_sharded_step_checks_values_and_runs_an_empty_prefill(tiny):
  mesh = device_mesh(N)
  placed, _ = sharding.shard_model(tiny, mesh)
  step = steps.jit_model_step(placed, mesh, vocab_size=tiny.cfg.vocab_size)
  cache = steps.init_mesh_cache(placed.cfg, 2, 64, mesh)
  # The padded vocabulary's extra rows are not tokens; the capacity is counted on the mesh (DCP).
  with pytest.raises(ValueError, match=r"tokens must be ids in \[0, vocab_size = 256\)"):
    step.prefill(jnp.asarray([1, tiny.cfg.vocab_size], jnp.int32), jnp.asarray([0, 1, 2], jnp.int32), cache)
  with pytest.raises(ValueError, match="cu_seqlens"):
    step.prefill(jnp.zeros(5, jnp.int32), jnp.asarray([1, 3, 4], jnp.int32), cache)
  with pytest.raises(ValueError, match="tokens must be ids"):
    step.decode(jnp.asarray([-1, 0], jnp.int32), cache)
  assert not any(x.is_deleted() for x in jax.tree.leaves(cache))  # a rejected call donates nothing
  # An all-empty prefill changes nothing (it once failed the DCP wiring check: no row was written).
  logits, out = step.prefill(jnp.zeros(0, jnp.int32), jnp.zeros(3, jnp.int32), cache)
  assert logits.shape == (0, tiny.cfg.vocab_size) and logits.dtype == jnp.float32
  assert out is cache
  last, out = step.prefill(jnp.zeros(0, jnp.int32), jnp.zeros(3, jnp.int32), cache, last_only=True)
  assert last.shape == (2, tiny.cfg.vocab_size) and np.isnan(np.asarray(last)).all() and out is cache


# CPU compiles at XLA backend optimisation level 0 (support.fast_jit): several times faster, same ops.
FAST = {"xla_backend_optimization_level": 0}


def run_sharded_and_single(model, num_decodes=2):
  """Packed prefill of a ragged batch then ``num_decodes`` decodes, sharded over 9 devices and on one device."""
  cfg = model.cfg
  rng = np.random.default_rng(0)
  lens = [3, 11, 0]  # ragged, shorter than 9 (empty DCP shards), and an empty sequence
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, cu[-1]).astype(np.int32))
  steps_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (num_decodes, len(lens))).astype(np.int32))
  mesh = device_mesh(N)
  placed, _ = sharding.shard_model(model, mesh)
  step = steps.jit_model_step(placed, mesh, vocab_size=cfg.vocab_size, compiler_options=FAST)
  cache = steps.init_mesh_cache(placed.cfg, len(lens), 64, mesh, fill=0.0)
  first = cache
  sharded = [step.prefill(tokens, jnp.asarray(cu), cache)]
  assert all(x.is_deleted() for x in jax.tree.leaves(first))  # donated
  for t in steps_tokens:
    sharded.append(step.decode(t, sharded[-1][1]))
  graph, state = nnx.split(model)
  prefill = fast_jit(lambda st, tok, cu, cache: nnx.merge(graph, st).prefill(tok, cu, cache))
  decode = fast_jit(lambda st, tok, cache: nnx.merge(graph, st).decode(tok, cache))
  single = [prefill(state, tokens, jnp.asarray(cu), cache_lib.init_cache(cfg, len(lens), 64))]
  for t in steps_tokens:
    single.append(decode(state, t, single[-1][1]))
  hlo = {"prefill": step.compiled_text("prefill", tokens, jnp.asarray(cu), sharded[-1][1]),
         "decode": step.compiled_text("decode", steps_tokens[0], sharded[-1][1])}
  return sharded, single, placed, mesh, hlo


def relayout_dcp(cache, n, seq_lens, block_table):
  """Host copy of a DCP latent cache as token rows ``[B, L_max, D]`` (test-local, from the layout rule)."""
  pages = cache.shape[0] // n
  out = np.zeros((len(seq_lens), max(seq_lens), cache.shape[-1]), cache.dtype)
  for b, length in enumerate(seq_lens):
    for t in range(length):
      c = t // n
      out[b, t] = cache[(t % n) * pages + block_table[b, c // PAGE_SIZE], c % PAGE_SIZE]
  return out


def plain_rows(cache, seq_lens, block_table):
  out = np.zeros((len(seq_lens), max(seq_lens), cache.shape[-1]), cache.dtype)
  for b, length in enumerate(seq_lens):
    for t in range(length):
      out[b, t] = cache[block_table[b, t // PAGE_SIZE], t % PAGE_SIZE]
  return out


# (partial_dtype, state_dtype, storage dtype of the MLA latent cache and the KDA conv windows, logits atol,
# KDA state atol). f32: everything is f32, so only reduction orders differ (row-parallel all-reduces, the DCP
# LSE merge, expert-parallel partial sums): a few f32 ulps of the O(1)-O(10) logits and O(1) states. The
# caches stay f32 here on purpose: rounding a value to bf16 turns an f32 difference of ~1e-6 into a whole
# bf16 ulp (2^-8 relative) whenever the value lies within ~1e-6 of a rounding midpoint, which a stored
# conv-window entry does on some CPUs' f32 dot kernels (the next decode's logits then differ by ~2e-3).
# bf16: the sharded run
# rounds each device's MLA partial to bf16 where one device rounds its single split (an O(2^-9) relative
# change of the attention output, measured 8.5e-3 on logits of 3.6), a state entry may round to the
# neighbouring bf16 value (one ulp of |state| < 2 is 2^-7), and a cached latent or conv-window entry to its
# neighbour as above (1.7e-3 on logits).
# fp8 latent cache, f32 elsewhere: each token's row is quantised on its owner device from its f32 latent, which the
# sharded run sums in another order (a few f32 ulps). That can move a row's scale by an ulp, hence a held value's
# bf16 rounding (2^-9 of it) or, rarely, its e4m3 rounding (2^-3 of one element): logits of O(1) move by up to
# ~1e-3, and the held values by at most one e4m3 unit.
FP8_ATOL = 2e-3
DTYPE_CASES = [(jnp.float32, jnp.float32, jnp.float32, 2e-5, 4e-6),
               (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 2e-2, 2.0 ** -6)]


@pytest.mark.parametrize("partial_dtype, state_dtype, store_dtype, atol, state_atol", DTYPE_CASES)
def test_sharded_step_matches_single_device(tiny, partial_dtype, state_dtype, store_dtype, atol, state_atol):
  model = padding.rebuild(tiny, tiny.cfg.replace(partial_dtype=partial_dtype, state_dtype=state_dtype,
                                                  cache_dtype=store_dtype, conv_dtype=store_dtype))
  sharded, single, placed, mesh, hlo = run_sharded_and_single(model)
  vocab = tiny.cfg.vocab_size
  for (logits, cache), (ref_logits, ref_cache) in zip(sharded, single):
    assert logits.shape == ref_logits.shape and logits.dtype == jnp.float32
    assert logits.shape[-1] == vocab and logits.sharding.is_fully_replicated
    logits = np.asarray(logits)
    assert not np.isnan(logits).any()
    np.testing.assert_allclose(logits, np.asarray(ref_logits), rtol=0, atol=atol)
  cache, ref_cache = sharded[-1][1], single[-1][1]
  specs = sharding.tree_shardings(mesh, sharding.cache_specs(placed.cfg))
  for x, s in zip(jax.tree.leaves(cache), jax.tree.leaves(specs)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  assert cache.kda[0].recurrent.dtype == state_dtype
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), np.asarray(ref_cache.seq_lens))
  # KDA state: the real heads match, the padded heads stayed exactly zero.
  state, ref_state = (np.asarray(c.kda[0].recurrent, np.float32) for c in (cache, ref_cache))
  slots, ref_slots = np.asarray(cache.state_indices), np.asarray(ref_cache.state_indices)
  np.testing.assert_allclose(state[slots][:, :4], ref_state[ref_slots], rtol=0, atol=state_atol)
  assert (state[:, 4:] == 0).all()
  assert (np.asarray(cache.kda[0].conv_q, np.float32).reshape(-1, 3, 9, 16)[:, :, 4:] == 0).all()
  # MLA latent rows: bitwise the same tokens (the same projection per token), each on its owner device.
  lens = np.asarray(ref_cache.seq_lens).tolist()
  rows = relayout_dcp(np.asarray(cache.mla[0], np.float32), N, lens, np.asarray(cache.block_table))
  ref_rows = plain_rows(np.asarray(ref_cache.mla[0], np.float32), lens, np.asarray(ref_cache.block_table))
  np.testing.assert_array_equal(rows, ref_rows)
  check_collectives(placed.cfg, hlo)


def check_collectives(cfg, hlo):
  """Decode moves the queries and the packed partials; no cache row, KDA state or conv window moves."""
  latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
  decode, prefill = (steps.collectives(hlo[k]) for k in ("decode", "prefill"))
  for op, _, shape in decode + prefill:
    assert shape[-2:] != (PAGE_SIZE, latent) and shape[-2:] != (cfg.kda_head_dim, cfg.kda_head_dim), (op, shape)
    assert not (len(shape) == 3 and shape[1] == cfg.short_conv_kernel_size - 1), (op, shape)
  # Expert parallel: no expert weight and no [T * k, I] expert intermediate crosses devices.
  moe = {(cfg.moe_hidden_size, cfg.moe_intermediate_size), (cfg.moe_intermediate_size, cfg.moe_hidden_size)}
  assert not [s for _, _, s in decode + prefill if s[-2:] in moe or s[-1:] == (cfg.moe_intermediate_size,)]
  # One all-gather of the queries over heads and one all-to-all of the packed (o, lse) per MLA layer.
  lse_width = 4 // cfg.partial_dtype.itemsize  # the f32 LSE travels bit-packed in the partial dtype
  assert [s for op, _, s in decode if op == "all-to-all"] == [(1, 3, 1, cfg.kv_lora_rank + lse_width)]
  assert (3, 9, latent) in [s for op, _, s in decode if op == "all-gather"]
  # Prefill attends to cached prefixes the same way: its all-to-alls carry partials of its tokens only.
  assert all(s[::2] == (1, 1) and s[-1] == cfg.kv_lora_rank + lse_width
             for op, _, s in prefill if op == "all-to-all")


def test_sharded_step_with_an_fp8_cache_matches_single_device(tiny):
  """The fp8 latent rows (values and their scales) are written to and read from each token's owner device: the
  rows each device holds, read back, are those of one device."""
  model = padding.rebuild(tiny, tiny.cfg.replace(cache_dtype=cache_format.FP8))
  sharded, single, placed, mesh, _ = run_sharded_and_single(model)
  for (logits, _), (ref_logits, _) in zip(sharded, single):
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=0, atol=FP8_ATOL)
  cache, ref_cache = sharded[-1][1], single[-1][1]
  assert cache.mla[0].dtype == cache_format.FP8 and cache.mla[0].shape[-1] == placed.cfg.cache_row_width
  lens = np.asarray(ref_cache.seq_lens).tolist()
  held = lambda c: np.asarray(cache_format.dequantize_rows(c.mla[0], placed.cfg.kv_lora_rank), np.float32)
  rows = relayout_dcp(held(cache), N, lens, np.asarray(cache.block_table))
  ref_rows = plain_rows(held(ref_cache), lens, np.asarray(ref_cache.block_table))
  assert np.isfinite(rows).all()
  np.testing.assert_allclose(rows, ref_rows, rtol=2.0 ** -3, atol=1e-6)

"""K3Config: presets, HF config.json parsing (both formats), round trips and every validation error."""

import copy
import dataclasses
import json
import re

import jax.numpy as jnp
import pytest

from k3jax import config as cfg_lib
from k3jax.config import K3Config


def _k3_json() -> dict:
  return cfg_lib.preset("kimi_k3").to_hf("kimi_k3")


def _linear_json() -> dict:
  return cfg_lib.preset("kimi_linear_48b").to_hf("kimi_linear")


def test_presets_match_the_published_configs():
  lin = cfg_lib.preset("kimi_linear_48b")
  assert lin.full_attn_layers == (4, 8, 12, 16, 20, 24, 27)
  assert len(lin.kda_layers) == 20 and lin.kda_layers[:4] == (1, 2, 3, 5)
  assert lin.layer_types[3] == "mla" and lin.layer_types[26] == "mla" and lin.layer_types[25] == "kda"
  k3 = cfg_lib.preset("kimi_k3")
  assert len(k3.full_attn_layers) == 24 and len(k3.kda_layers) == 69
  assert k3.full_attn_layers[-3:] == (88, 92, 93)
  assert k3.moe_hidden_size == 3584 and lin.moe_hidden_size == 2304
  assert k3.mla_scale == pytest.approx(192 ** -0.5)
  tiny = cfg_lib.preset("tiny")
  assert tiny.layer_types[-2:] == ("mla", "mla") and "kda" in tiny.layer_types
  t9 = cfg_lib.preset("tiny9")
  for d in (t9.hidden_size, t9.vocab_size, t9.kda_num_heads, t9.num_attention_heads, t9.num_experts,
            t9.intermediate_size, t9.moe_intermediate_size, t9.routed_expert_hidden_size):
    assert d % 9 == 0


@pytest.mark.parametrize("name", sorted(cfg_lib.PRESETS))
def test_preset_overrides_replace_preset_fields(name):
  """An override of a field the preset sets replaces it (no duplicate-keyword TypeError); the rest stays."""
  base = cfg_lib.preset(name)
  two = cfg_lib.preset(name, num_hidden_layers=2, layer_types=("kda", "mla"), first_k_dense_replace=0,
                       num_experts=base.num_experts + 1)
  assert (two.num_hidden_layers, two.layer_types, two.first_k_dense_replace) == (2, ("kda", "mla"), 0)
  assert two.num_experts == base.num_experts + 1
  assert two == dataclasses.replace(base, num_hidden_layers=2, layer_types=("kda", "mla"),
                                    first_k_dense_replace=0, num_experts=base.num_experts + 1)


@pytest.mark.parametrize("name", sorted(cfg_lib.PRESETS))
@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
def test_hf_round_trip(name, fmt):
  c = cfg_lib.preset(name, impl="xla")
  back = K3Config.from_hf(json.loads(json.dumps(c.to_hf(fmt))), impl="xla")
  assert back == c


def test_from_hf_reads_a_file_and_a_directory(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(_k3_json()))
  a = K3Config.from_hf(tmp_path, impl="xla")
  b = K3Config.from_hf(tmp_path / "config.json", impl="xla")
  assert a == b == cfg_lib.preset("kimi_k3", impl="xla")


def test_from_hf_names_a_file_that_is_not_a_json_object(tmp_path):
  path = tmp_path / "config.json"
  path.write_bytes(b"\x89PNG\r\n")
  with pytest.raises(ValueError, match=re.escape(f"{path}: not valid JSON")) as info:
    K3Config.from_hf(tmp_path, impl="xla")
  assert isinstance(info.value.__cause__, UnicodeDecodeError)
  path.write_text('{"model_type": ')
  with pytest.raises(ValueError, match=re.escape(f"{path}: not valid JSON")) as info:
    K3Config.from_hf(path, impl="xla")
  assert isinstance(info.value.__cause__, json.JSONDecodeError)
  path.write_text("null")
  with pytest.raises(ValueError, match=re.escape(f"{path}: must hold a JSON object, got NoneType")):
    K3Config.from_hf(path, impl="xla")


def test_hf_layer_lists_are_one_indexed():
  j = _linear_json()
  c = K3Config.from_hf(j, impl="xla")
  assert c.layer_types[0] == "kda" and c.layer_types[3] == "mla"


def test_runtime_fields_and_op_configs():
  c = cfg_lib.preset("tiny", state_dtype="bfloat16", partial_dtype=jnp.float32, impl="xla")
  assert c.state_dtype == jnp.bfloat16 and c.partial_dtype == jnp.float32
  assert c.kda_op_config().state_dtype == jnp.bfloat16 and c.kda_op_config().lower_bound == -5.0
  assert c.mla_op_config().partial_dtype == jnp.float32 and c.mla_op_config().impl == "xla"
  assert hash(c) == hash(cfg_lib.preset("tiny", state_dtype=jnp.bfloat16, partial_dtype="float32", impl="xla"))
  # The MLA prefill kernel takes 16-bit activations and head dims that are multiples of 64 (K3's); other models
  # run the op's XLA path under every impl.
  k3 = cfg_lib.preset("kimi_k3", impl="pallas", dtype=jnp.bfloat16)
  assert k3.mla_prefill_op_config().impl == "pallas" and k3.mla_prefill_op_config().scale == k3.mla_scale
  for other in (k3.replace(dtype=jnp.float32), cfg_lib.preset("tiny", impl="pallas", dtype=jnp.bfloat16)):
    assert other.mla_prefill_op_config().impl == "xla"
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.hidden_size = 3


def _mutate(base, path, value):
  j = copy.deepcopy(base)
  d = j
  for p in path[:-1]:
    d = d[p]
  if value is _DELETE:
    del d[path[-1]]
  else:
    d[path[-1]] = value
  return j


_DELETE = object()


@pytest.mark.parametrize("base,path,value,match", [
    ("lin", ("unknown_key",), 1, "unknown keys \\['unknown_key'\\]"),
    ("lin", ("linear_attn_config", "mystery"), 1, "linear_attn_config: unknown keys"),
    ("k3", ("vision_tower_x",), 1, "unknown keys"),
    ("k3", ("text_config", "bogus"), 1, "text_config: unknown keys"),
    ("lin", ("model_type",), "deepseek_v3", "model_type must be"),
    ("k3", ("text_config", "model_type"), "llama", "text_config.model_type"),
    ("lin", ("hidden_size",), _DELETE, "missing required key 'hidden_size'"),
    ("lin", ("linear_attn_config", "kda_layers"), [1, 2, 3], "in neither"),
    ("lin", ("linear_attn_config", "kda_layers"), [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21,
                                                   22, 23, 25, 26], "in both"),
    ("lin", ("linear_attn_config", "kda_layers"), [0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21,
                                                   22, 23, 25, 26], "1-indexed"),
    ("lin", ("linear_attn_config", "full_attn_layers"), [4, 4, 8, 12, 16, 20, 24, 27], "duplicates"),
    ("lin", ("num_key_value_heads",), 8, "num_key_value_heads"),
    ("lin", ("rope_scaling",), {"type": "yarn"}, "rope_scaling"),
    ("lin", ("rope_parameters",), {"rope_type": "default", "rope_theta": 1e4}, "rope_parameters=.*mla_use_nope"),
    ("lin", ("hidden_act",), "gelu", "hidden_act"),
    ("lin", ("num_experts_per_token",), 300, "num_experts_per_token"),
    ("lin", ("latent_moe_use_norm",), True, "latent_moe_use_norm"),
    ("k3", ("tie_word_embeddings",), True, "tie_word_embeddings"),
    ("k3", ("text_config", "linear_attn_config", "gate_lower_bound"), -6.0, "gate_lower_bound"),
])
def test_bad_hf_configs_raise(base, path, value, match):
  """Each bad key is named (``rope_parameters`` is transformers 5.x's name for the RoPE settings)."""
  j = _mutate(_linear_json() if base == "lin" else _k3_json(), path, value)
  with pytest.raises(ValueError, match=match):
    K3Config.from_hf(j, impl="xla")


@pytest.mark.parametrize("key,value", [("mla_use_nope", False), ("num_nextn_predict_layers", 1),
                                       ("moe_router_activation_func", "softmax"), ("num_expert_group", 8),
                                       ("topk_group", 2), ("moe_layer_freq", 2), ("topk_method", "greedy"),
                                       ("kv_lora_rank", 256), ("qk_rope_head_dim", 128)])
def test_unsupported_hf_settings_raise_not_implemented(key, value):
  with pytest.raises(NotImplementedError, match=key):
    K3Config.from_hf(_mutate(_linear_json(), (key,), value), impl="xla")


def _transformers_json() -> dict:
  """The Kimi-Linear 48B config.json as transformers saves it: the primary keys plus the keys it derives."""
  c = cfg_lib.preset("kimi_linear_48b")
  return {**c.to_hf("kimi_linear"), **c.transformers_keys(), "transformers_version": "5.24.0", "head_dim": 64}


def test_transformers_keys_are_accepted():
  j = _transformers_json()
  assert j["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]  # 0-indexed, transformers' spelling
  assert j["mlp_layer_types"][:2] == ["dense", "sparse"] and j["qk_head_dim"] == 192
  assert (j["linear_num_heads"], j["linear_head_dim"], j["linear_conv_kernel_dim"]) == (32, 128, 4)
  want = cfg_lib.preset("kimi_linear_48b", impl="xla")
  assert K3Config.from_hf(j, impl="xla") == want
  # output_router_logits only asks transformers for the router logits: either value is the same model.
  assert K3Config.from_hf({**j, "output_router_logits": True}, impl="xla") == want
  assert K3Config.from_hf({**j, "pretraining_tp": None}, impl="xla") == want  # transformers allows null
  assert K3Config.from_hf({**j, "rope_parameters": None}, impl="xla") == want  # saved when rope_scaling is given
  k3 = cfg_lib.preset("kimi_k3", impl="xla")
  nested = _k3_json()
  nested["text_config"].update(k3.transformers_keys())
  assert K3Config.from_hf(nested, impl="xla") == k3
  assert not set(cfg_lib.TRANSFORMERS_KEYS) & set(want.to_hf("kimi_linear"))  # to_hf writes the published form


_LAYERS = ("linear_attn_config.kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26] "
           "/ full_attn_layers=[4, 8, 12, 16, 20, 24, 27] (1-indexed)")


@pytest.mark.parametrize("key,value,message", [
    ("layer_types", ["linear_attention"] * 27,
     f"layer_types[3]='linear_attention' contradicts {_LAYERS} (from which layer_types[3]='full_attention'"),
    ("layer_types", ["linear_attention"] * 26,
     "layer_types has 26 entries, contradicting num_hidden_layers=27 (one entry per layer)"),
    ("layer_types", ["kda"] * 27, f"layer_types[0]='kda' contradicts {_LAYERS} (from which "
                                  f"layer_types[0]='linear_attention'"),
    ("layer_types", "linear_attention", "layer_types='linear_attention' contradicts linear_attn_config"),
    ("mlp_layer_types", ["sparse"] * 27,
     "mlp_layer_types[0]='sparse' contradicts first_k_dense_replace=1 (from which mlp_layer_types[0]='dense'"),
    ("mlp_layer_types", ["dense"] * 2 + ["sparse"] * 25,
     "mlp_layer_types[1]='dense' contradicts first_k_dense_replace=1 (from which mlp_layer_types[1]='sparse'"),
    ("linear_num_heads", 16,
     "linear_num_heads=16 contradicts linear_attn_config.num_heads=32 (from which linear_num_heads=32)"),
    ("linear_head_dim", 64,
     "linear_head_dim=64 contradicts linear_attn_config.head_dim=128 (from which linear_head_dim=128)"),
    ("linear_conv_kernel_dim", 3, "linear_conv_kernel_dim=3 contradicts "
                                  "linear_attn_config.short_conv_kernel_size=4 (from which linear_conv_kernel_dim=4)"),
    ("qk_head_dim", 128, "qk_head_dim=128 contradicts qk_nope_head_dim=128 + qk_rope_head_dim=64 "
                         "(from which qk_head_dim=192)"),
    ("qk_head_dim", 192.0, "qk_head_dim=192.0 contradicts"),
    ("attention_bias", 0, "attention_bias must be true or false, got 0"),
    ("output_router_logits", "no", "output_router_logits must be true or false, got 'no'"),
    ("pretraining_tp", 1.0, "pretraining_tp must be an int or null, got 1.0"),
])
def test_transformers_keys_contradicting_primary_keys_raise(key, value, message):
  with pytest.raises(ValueError, match=re.escape(f"config.json: {message}")):
    K3Config.from_hf({**_transformers_json(), key: value}, impl="xla")


def test_transformers_keys_in_text_config_are_checked():
  j = _k3_json()
  j["text_config"]["linear_head_dim"] = 64
  with pytest.raises(ValueError, match=re.escape("text_config: linear_head_dim=64 contradicts "
                                                 "linear_attn_config.head_dim=128")):
    K3Config.from_hf(j, impl="xla")


def test_transformers_key_checked_against_a_defaulted_primary_key():
  """A primary key left out takes k3jax's default (short_conv_kernel_size 4, first_k_dense_replace 0)."""
  j = _transformers_json()
  del j["linear_attn_config"]["short_conv_kernel_size"], j["first_k_dense_replace"]
  with pytest.raises(ValueError, match=re.escape("mlp_layer_types[0]='dense' contradicts first_k_dense_replace=0")):
    K3Config.from_hf(j, impl="xla")
  j["mlp_layer_types"] = ["sparse"] * 27
  assert K3Config.from_hf(j, impl="xla").first_k_dense_replace == 0
  j["linear_conv_kernel_dim"] = 5
  with pytest.raises(ValueError, match="linear_conv_kernel_dim=5 contradicts .*short_conv_kernel_size=4"):
    K3Config.from_hf(j, impl="xla")


@pytest.mark.parametrize("key,value,message", [
    ("attention_bias", True, "attention_bias must be false (the MLA projections have no biases), got true"),
    ("pretraining_tp", 2, "pretraining_tp must be 1 or null (k3jax does not split the projections into "
     "pretraining_tp slices), got 2"),
    ("pretraining_tp", 0, "pretraining_tp must be 1 or null (k3jax does not split the projections into "
     "pretraining_tp slices), got 0"),
])
def test_transformers_settings_k3jax_does_not_run_raise(key, value, message):
  with pytest.raises(NotImplementedError, match=re.escape(f"config.json: {message}")):
    K3Config.from_hf({**_transformers_json(), key: value}, impl="xla")


def test_k3_text_config_missing_raises():
  j = _k3_json()
  del j["text_config"]
  with pytest.raises(ValueError, match="text_config"):
    K3Config.from_hf(j, impl="xla")


def test_bad_runtime_kwarg_raises():
  with pytest.raises(ValueError, match="runtime keyword"):
    K3Config.from_hf(_linear_json(), impl="xla", state_dtyp=jnp.float32)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 0, "hidden_size must be an int >= 1"),
    ("kda_num_heads", 2.5, "kda_num_heads must be an int"),
    ("q_lora_rank", 0, "q_lora_rank must be None or an int >= 1"),
    ("num_shared_experts", -1, "num_shared_experts must be an int >= 0"),
    ("rms_norm_eps", 0.0, "rms_norm_eps must be > 0"),
    ("layer_types", ("kda",) * 5, "layer_types must have"),
    ("layer_types", ("kda", "attn", "mla", "kda", "mla", "mla"), "layer_types entries"),
    ("state_dtype", jnp.float16, "state_dtype must be one of"),
    ("partial_dtype", jnp.int32, "partial_dtype must be one of"),
    ("cache_dtype", "float64", "cache_dtype must be one of"),
    ("impl", "cuda", "impl must be one of"),
    ("gate_lower_bound", 0.0, "gate_lower_bound"),
    ("first_k_dense_replace", 7, "first_k_dense_replace"),
    ("hidden_act", "relu", "hidden_act"),
])
def test_bad_fields_raise(field, value, match):
  with pytest.raises(ValueError, match=match):
    cfg_lib.preset("tiny", **{field: value})


@pytest.mark.parametrize("field,value,supported", [("kv_lora_rank", 256, 512), ("kv_lora_rank", 448, 512),
                                                   ("qk_rope_head_dim", 128, 64)])
def test_mla_dims_the_ops_do_not_implement_raise(field, value, supported):
  """The MLA ops are specialised to the Kimi latent (512 + 64): other widths fail in the config, not at the first
  prefill (448 + 128 has the same 576 cache columns, so a width check on the ops' inputs alone would pass it)."""
  with pytest.raises(NotImplementedError, match=rf"{field} must be {supported} .*, got {value}"):
    cfg_lib.preset("tiny", **{field: value})


def test_unknown_preset_and_fmt_raise():
  with pytest.raises(ValueError, match="preset name"):
    cfg_lib.preset("tiny3")
  with pytest.raises(ValueError, match="fmt must be"):
    cfg_lib.preset("tiny").to_hf("kimi_k2")

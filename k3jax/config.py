"""``K3Config``: the one frozen, validated description of a Kimi-Linear / Kimi-K3 text model.

Every K3 feature has its own switch, so the same modules run both checkpoint formats:

==========================  ==============================  ====================================
field                       Kimi-Linear-48B                 Kimi-K3
==========================  ==============================  ====================================
hidden_act                  "silu"                          "situ" (``situ_beta``, ``situ_linear_beta``)
q_lora_rank                 None (one ``q_proj``)           1536 (``q_a_proj``/norm/``q_b_proj``)
mla_use_output_gate         False                           True (``g_proj``)
gate_lower_bound            None (softplus gate)            -5.0 (lower-bound sigmoid gate)
use_full_rank_gate          False (``g_a``/``g_b``)         True (``g_proj``)
routed_expert_hidden_size   None                            3584 (latent MoE)
attn_res_block_size         None                            12 (block attention residuals)
==========================  ==============================  ====================================

``from_hf`` reads an HF ``config.json`` (the flat Kimi-Linear form or the K3 form with ``text_config``);
``kda_layers`` / ``full_attn_layers`` there are 1-indexed. ``layer_types`` here is 0-indexed.

A ``config.json`` saved by ``transformers`` (5.x, its native ``KimiLinearConfig``) also holds the keys that
class derives from the primary ones (``TRANSFORMERS_KEYS``): ``layer_types`` ("full_attention" /
"linear_attention", 0-indexed, from ``linear_attn_config``), ``mlp_layer_types`` ("dense" / "sparse", from
``first_k_dense_replace``), ``linear_num_heads`` / ``linear_head_dim`` / ``linear_conv_kernel_dim`` (from
``linear_attn_config``), ``qk_head_dim`` (``qk_nope_head_dim + qk_rope_head_dim``), and the flags
``attention_bias``, ``pretraining_tp`` and ``output_router_logits``. ``from_hf`` checks each against what the
primary keys give.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from pallas_kernels import KdaConfig, MlaDecodeConfig, MlaPrefillConfig, ShortConvConfig
from pallas_kernels import util
from pallas_kernels.mla import cache_format
from pallas_kernels.mla import config as mla_config
from pallas_kernels.mla_prefill import kernel as mla_prefill_kernel
from pallas_kernels.mla.config import LATENT_DIM, ROPE_DIM

PAGE_SIZE = mla_config.PAGE_SIZE  # tokens per page of the MLA latent cache (the MLA ops')
KDA = "kda"
MLA = "mla"
# How transformers' KimiLinearConfig spells the layer kinds in ``layer_types`` and ``mlp_layer_types``.
TRANSFORMERS_LAYER_TYPES = {KDA: "linear_attention", MLA: "full_attention"}
TRANSFORMERS_DENSE, TRANSFORMERS_MOE = "dense", "sparse"

_FLOAT = (jnp.float32, jnp.bfloat16)


def read_json(path: str) -> dict:
  """The JSON object held by the file ``path`` (``config.json``, a safetensors index).

  Raises:
    ValueError: the file is not UTF-8 JSON, or holds something other than an object; the message names it.
  """
  with open(path) as f:
    try:
      raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(raw, dict):
    raise ValueError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
  return raw


@dataclasses.dataclass(frozen=True, kw_only=True)
class K3Config:
  """Architecture plus storage/compute dtypes and the kernel backend.

  Attributes:
    vocab_size, hidden_size, num_hidden_layers: as in HF.
    intermediate_size: width of the dense MLP of the first ``first_k_dense_replace`` layers.
    rms_norm_eps: eps of every RMSNorm except the MLA latent norms (``latent_norm_eps``).
    hidden_act: "silu" (SwiGLU) or "situ" (K3 ``SituAndMul``).
    situ_beta, situ_linear_beta: SiTU constants (only read when ``hidden_act == "situ"``).
    num_attention_heads: MLA heads (``num_key_value_heads`` must equal it).
    q_lora_rank: None for a single ``q_proj``, else the rank of ``q_a_proj``.
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA dims (R, dn, dr, dv); with MLA layers
      R must be 512 and dr 64 (the MLA ops are specialised to the Kimi latent).
    mla_use_output_gate: ``attn *= sigmoid(g_proj x)`` before ``o_proj``.
    latent_norm_eps: eps of ``q_a_layernorm`` / ``kv_a_layernorm`` (HF builds them with the default 1e-6).
    kda_num_heads, kda_head_dim, short_conv_kernel_size: KDA H, K (= V) and the conv width W.
    gate_lower_bound: None (softplus gate) or the K3 lower bound in [-5, 0).
    use_full_rank_gate: full-rank ``g_proj`` output gate instead of ``g_a_proj``/``g_b_proj``.
    layer_types: per layer (0-indexed) "kda" or "mla".
    num_experts, num_experts_per_token, num_shared_experts, moe_intermediate_size: MoE sizes.
    routed_expert_hidden_size: None, or the latent width of the routed experts (latent MoE).
    latent_moe_use_norm: RMSNorm on the latent expert sum before ``routed_expert_up_proj``.
    moe_renormalize: divide the top-k weights by their sum.
    routed_scaling_factor: multiplies the top-k weights.
    first_k_dense_replace: the first k layers use the dense MLP; every later layer is MoE.
    attn_res_block_size: None (plain residual stream) or the block size of attention residuals.
    tie_word_embeddings: LM head shares the embedding matrix.
    dtype: activation/compute dtype. param_dtype: weight storage dtype (router, ``A_log``,
      ``dt_bias`` are always f32).
    state_dtype: KDA recurrent state pool dtype. partial_dtype: MLA split-K partials dtype.
    cache_dtype: MLA latent cache dtype: f32, bf16, or ``float8_e4m3fn`` with per-token scales kept in each row
      (``pallas_kernels.mla.cache_format``). conv_dtype: KDA conv state dtype.
    impl: kernel backend of the ops ("xla", "pallas", "interpret").
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  rms_norm_eps: float = 1e-5
  hidden_act: str = "silu"
  situ_beta: float = 4.0
  situ_linear_beta: float = 25.0
  # MLA
  num_attention_heads: int
  q_lora_rank: int | None = None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  mla_use_output_gate: bool = False
  latent_norm_eps: float = 1e-6
  # KDA
  kda_num_heads: int
  kda_head_dim: int
  short_conv_kernel_size: int = 4
  gate_lower_bound: float | None = None
  use_full_rank_gate: bool = False
  layer_types: tuple[str, ...]
  # MoE
  num_experts: int
  num_experts_per_token: int
  num_shared_experts: int = 1
  moe_intermediate_size: int
  routed_expert_hidden_size: int | None = None
  latent_moe_use_norm: bool = False
  moe_renormalize: bool = True
  routed_scaling_factor: float = 1.0
  first_k_dense_replace: int = 1
  # residual stream
  attn_res_block_size: int | None = None
  tie_word_embeddings: bool = False
  # runtime
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.bfloat16
  state_dtype: Any = jnp.float32
  partial_dtype: Any = jnp.bfloat16
  cache_dtype: Any = jnp.bfloat16
  conv_dtype: Any = jnp.bfloat16
  impl: str = dataclasses.field(default_factory=util.default_impl)

  def __post_init__(self):
    for name in ("dtype", "param_dtype", "state_dtype", "partial_dtype", "conv_dtype"):
      object.__setattr__(self, name, util.canonical_dtype(name, getattr(self, name), _FLOAT))
    object.__setattr__(self, "cache_dtype", util.canonical_dtype("cache_dtype", self.cache_dtype,
                                                                 _FLOAT + (cache_format.FP8,)))
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads",
                "kda_head_dim", "short_conv_kernel_size", "num_experts", "num_experts_per_token",
                "moe_intermediate_size")
    for name in positive:
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    for name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
    for name in ("num_shared_experts", "first_k_dense_replace"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    for name in ("rms_norm_eps", "latent_norm_eps", "situ_beta", "situ_linear_beta", "routed_scaling_factor"):
      v = getattr(self, name)
      if not float(v) > 0.0:
        raise ValueError(f"{name} must be > 0, got {v!r}")
    if self.hidden_act not in ("silu", "situ"):
      raise ValueError(f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(f"layer_types must have num_hidden_layers={self.num_hidden_layers} entries, "
                       f"got {len(self.layer_types)}")
    bad = [t for t in self.layer_types if t not in (KDA, MLA)]
    if bad:
      raise ValueError(f"layer_types entries must be {KDA!r} or {MLA!r}, got {bad}")
    if MLA in self.layer_types:
      # mla_decode reads V as the first LATENT_DIM cache columns, so only the Kimi split of the latent row works
      # (another split of the same width would pass its shape checks and compute the wrong attention).
      for name, supported in (("kv_lora_rank", LATENT_DIM), ("qk_rope_head_dim", ROPE_DIM)):
        if getattr(self, name) != supported:
          raise NotImplementedError(f"{name} must be {supported} (the MLA ops are specialised to the Kimi latent "
                                    f"{LATENT_DIM} + {ROPE_DIM}), got {getattr(self, name)}")
    if self.num_experts_per_token > self.num_experts:
      raise ValueError(f"num_experts_per_token={self.num_experts_per_token} must be <= "
                       f"num_experts={self.num_experts}")
    if self.gate_lower_bound is not None:
      lb = float(self.gate_lower_bound)
      if not -5.0 <= lb < 0.0:
        raise ValueError(f"gate_lower_bound must be None or in [-5, 0), got {self.gate_lower_bound!r}")
      object.__setattr__(self, "gate_lower_bound", lb)
    if self.first_k_dense_replace > self.num_hidden_layers:
      raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                       f"num_hidden_layers={self.num_hidden_layers}")

  # ------------------------------------------------------------------ derived
  @property
  def kda_layers(self) -> tuple[int, ...]:
    """1-indexed KDA layers (the HF convention)."""
    return tuple(i + 1 for i, t in enumerate(self.layer_types) if t == KDA)

  @property
  def full_attn_layers(self) -> tuple[int, ...]:
    """1-indexed MLA layers (the HF convention)."""
    return tuple(i + 1 for i, t in enumerate(self.layer_types) if t == MLA)

  def is_moe(self, layer: int) -> bool:
    return layer >= self.first_k_dense_replace

  def is_attn_res_checkpoint(self, layer: int) -> bool:
    return self.attn_res_block_size is not None and layer % self.attn_res_block_size == 0

  @property
  def moe_hidden_size(self) -> int:
    """Width the routed experts run at (the latent width with a latent MoE)."""
    return self.routed_expert_hidden_size or self.hidden_size

  @property
  def mla_scale(self) -> float:
    """Softmax scale: ``(dn + dr) ** -0.5`` (NoPE, no YaRN term)."""
    return float(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

  def kda_op_config(self) -> KdaConfig:
    return KdaConfig(lower_bound=self.gate_lower_bound, state_dtype=self.state_dtype, impl=self.impl)

  @property
  def cache_row_width(self) -> int:
    """Elements of one MLA cache row: ``R + dr``, plus the scales' 16 for an fp8 cache."""
    return cache_format.row_width(self.kv_lora_rank + self.qk_rope_head_dim, self.cache_dtype)

  def mla_op_config(self) -> MlaDecodeConfig:
    return MlaDecodeConfig(scale=self.mla_scale, partial_dtype=self.partial_dtype, impl=self.impl)

  def mla_prefill_op_config(self) -> MlaPrefillConfig:
    """The Mosaic GPU prefill attention takes 16-bit inputs and head dims that are multiples of 64 (Kimi's 128,
    64 and 128): another model (an f32 one, a toy preset) runs the op's blockwise XLA path, the same function."""
    kernel_ok = mla_prefill_kernel.unsupported(self.dtype, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                               self.v_head_dim) is None
    return MlaPrefillConfig(scale=self.mla_scale, impl=self.impl if kernel_ok else "xla")

  def short_conv_op_config(self) -> ShortConvConfig:
    """Kimi-Linear's q/k/v convolutions: SiLU after the convolution."""
    return ShortConvConfig(activation="silu", impl=self.impl)

  def replace(self, **changes) -> K3Config:
    return dataclasses.replace(self, **changes)

  # ------------------------------------------------------------------ HF config.json
  @classmethod
  def from_hf(cls, source: str | os.PathLike | dict, **runtime) -> K3Config:
    """Builds a config from an HF ``config.json`` (path, directory or parsed dict).

    Args:
      source: the flat Kimi-Linear form (``model_type: kimi_linear``) or the K3 form
        (``model_type: kimi_k3`` with a ``text_config``).
      **runtime: fields that are not in ``config.json`` (``dtype``, ``param_dtype``, ``state_dtype``,
        ``partial_dtype``, ``cache_dtype``, ``conv_dtype``, ``impl``).

    Raises:
      ValueError: unknown keys, missing keys, or contradictory values (a ``TRANSFORMERS_KEYS`` key that
        contradicts the primary keys it derives from: the message names both and their values).
      NotImplementedError: valid HF settings this model does not implement (RoPE, grouped top-k, MTP, an MLA
        latent other than 512 + 64, ``attention_bias`` true, ``pretraining_tp`` other than 1).
    """
    if isinstance(source, dict):
      raw = source
    else:
      path = os.fspath(source)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      raw = read_json(path)
    bad_runtime = sorted(set(runtime) - set(RUNTIME_FIELDS))
    if bad_runtime:
      raise ValueError(f"from_hf runtime keyword arguments must be in {sorted(RUNTIME_FIELDS)}, got {bad_runtime}")
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
      _reject_unknown("config.json (kimi_k3)", raw, _K3_TOP_KEYS)
      if "text_config" not in raw:
        raise ValueError("config.json with model_type 'kimi_k3' must have a 'text_config'")
      text = dict(raw["text_config"])
      if text.get("model_type") != "kimi_linear":
        raise ValueError(f"text_config.model_type must be 'kimi_linear', got {text.get('model_type')!r}")
      for key in ("tie_word_embeddings",):
        if key in raw and key in text and raw[key] != text[key]:
          raise ValueError(f"{key} is {raw[key]!r} at the top level but {text[key]!r} in text_config")
        if key in raw:
          text.setdefault(key, raw[key])
      where = "text_config"
    elif model_type == "kimi_linear":
      text, where = raw, "config.json"
    else:
      raise ValueError(f"config.json model_type must be 'kimi_linear' or 'kimi_k3', got {model_type!r}")
    cfg = cls(**_parse_text_config(text, where), **runtime)
    _check_transformers_keys(text, where, cfg)
    return cfg

  def to_hf(self, fmt: str = "kimi_linear") -> dict:
    """The HF ``config.json`` dict of this architecture (``fmt``: "kimi_linear" flat or "kimi_k3" nested)."""
    if fmt not in ("kimi_linear", "kimi_k3"):
      raise ValueError(f"fmt must be 'kimi_linear' or 'kimi_k3', got {fmt!r}")
    lac = {"kda_layers": list(self.kda_layers), "full_attn_layers": list(self.full_attn_layers),
           "num_heads": self.kda_num_heads, "head_dim": self.kda_head_dim,
           "short_conv_kernel_size": self.short_conv_kernel_size}
    if self.gate_lower_bound is not None:
      lac["gate_lower_bound"] = self.gate_lower_bound
    if self.use_full_rank_gate:
      lac["use_full_rank_gate"] = True
    text = {
        "model_type": "kimi_linear", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_attention_heads,
        "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps, "q_lora_rank": self.q_lora_rank,
        "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
        "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim, "mla_use_nope": True,
        "rope_scaling": None, "linear_attn_config": lac, "num_experts": self.num_experts,
        "num_experts_per_token": self.num_experts_per_token, "num_shared_experts": self.num_shared_experts,
        "moe_intermediate_size": self.moe_intermediate_size,
        "first_k_dense_replace": self.first_k_dense_replace, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": self.moe_renormalize,
        "routed_scaling_factor": self.routed_scaling_factor, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": self.tie_word_embeddings,
    }
    if self.hidden_act == "situ":
      text["activation_situ_beta"] = self.situ_beta
      text["activation_situ_linear_beta"] = self.situ_linear_beta
    if self.mla_use_output_gate:
      text["mla_use_output_gate"] = True
    if self.routed_expert_hidden_size is not None:
      text["routed_expert_hidden_size"] = self.routed_expert_hidden_size
      text["latent_moe_use_norm"] = self.latent_moe_use_norm
      text["topk_method"] = "noaux_tc"
    if self.attn_res_block_size is not None:
      text["attn_res_block_size"] = self.attn_res_block_size
    if fmt == "kimi_linear":
      return {"architectures": ["KimiLinearForCausalLM"], **text}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings}

  def transformers_keys(self) -> dict:
    """The ``TRANSFORMERS_KEYS`` that ``transformers`` writes into a ``config.json`` of this architecture it saves.

    ``to_hf`` leaves them out (the published checkpoints lack them); ``from_hf`` checks them against these values.
    """
    return {
        "layer_types": [TRANSFORMERS_LAYER_TYPES[t] for t in self.layer_types],
        "mlp_layer_types": [TRANSFORMERS_MOE if self.is_moe(i) else TRANSFORMERS_DENSE
                            for i in range(self.num_hidden_layers)],
        "linear_num_heads": self.kda_num_heads, "linear_head_dim": self.kda_head_dim,
        "linear_conv_kernel_dim": self.short_conv_kernel_size,
        "qk_head_dim": self.qk_nope_head_dim + self.qk_rope_head_dim,
        "attention_bias": False, "pretraining_tp": 1, "output_router_logits": False,
    }


# Fields that choose storage dtypes and the kernel backend, not the architecture (from_hf keywords).
RUNTIME_FIELDS = ("dtype", "param_dtype", "state_dtype", "partial_dtype", "cache_dtype", "conv_dtype", "impl")

# Keys that describe the checkpoint or serving (not the math of the text model): accepted and ignored.
_INFO_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
    "dtype", "transformers_version", "use_cache", "initializer_range", "model_max_length",
    "max_position_embeddings", "rope_theta", "head_dim", "quantization_config", "attention_dropout",
    "use_grouped_topk",
})

# Keys that transformers' KimiLinearConfig (5.x) writes into every config.json it saves: all but the last three
# derive from primary keys and are checked against them; ``attention_bias`` and ``pretraining_tp`` are checked for
# the values k3jax runs, and ``output_router_logits`` only makes transformers return the router logits (the
# auxiliary loss of training), so either value gives the same model.
TRANSFORMERS_KEYS = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim", "qk_head_dim", "attention_bias", "pretraining_tp",
                     "output_router_logits")
_TEXT_KEYS = _INFO_KEYS | frozenset(TRANSFORMERS_KEYS) | frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope",
    "mla_use_output_gate", "rope_scaling", "rope_parameters", "linear_attn_config", "num_experts", "num_experts_per_token",
    "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm",
    "first_k_dense_replace", "moe_layer_freq", "moe_router_activation_func", "moe_renormalize",
    "routed_scaling_factor", "num_expert_group", "topk_group", "topk_method", "num_nextn_predict_layers",
    "tie_word_embeddings", "attn_res_block_size",
})
_LAC_KEYS = frozenset({"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                       "gate_lower_bound", "use_full_rank_gate"})
_K3_TOP_KEYS = frozenset({"architectures", "auto_map", "model_type", "text_config", "vision_config",
                          "media_placeholder_token_id", "torch_dtype", "dtype", "transformers_version",
                          "quantization_config", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                          "pad_token_id", "use_cache", "ignore_index"})


def _reject_unknown(where: str, d: dict, allowed: frozenset) -> None:
  unknown = sorted(set(d) - allowed)
  if unknown:
    raise ValueError(f"{where}: unknown keys {unknown} (every K3 feature is switched by a known key; "
                     f"an unknown one could change the math)")


def _require(where: str, d: dict, key: str):
  if key not in d:
    raise ValueError(f"{where}: missing required key {key!r}")
  return d[key]


def _layer_types(where: str, lac: dict, num_layers: int) -> tuple[str, ...]:
  kda = list(_require(f"{where}.linear_attn_config", lac, "kda_layers"))
  full = list(_require(f"{where}.linear_attn_config", lac, "full_attn_layers"))
  for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
    if len(set(lst)) != len(lst):
      raise ValueError(f"{where}.linear_attn_config.{name} has duplicates: {lst}")
    out = [i for i in lst if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= num_layers]
    if out:
      raise ValueError(f"{where}.linear_attn_config.{name} entries must be 1-indexed ints in "
                       f"[1, {num_layers}], got {out}")
  both = sorted(set(kda) & set(full))
  if both:
    raise ValueError(f"{where}.linear_attn_config: layers {both} are in both kda_layers and full_attn_layers")
  missing = sorted(set(range(1, num_layers + 1)) - set(kda) - set(full))
  if missing:
    raise ValueError(f"{where}.linear_attn_config: layers {missing} are in neither kda_layers nor "
                     f"full_attn_layers (1-indexed)")
  kda_set = set(kda)
  return tuple(KDA if i + 1 in kda_set else MLA for i in range(num_layers))


def _parse_text_config(t: dict, where: str) -> dict:
  _reject_unknown(where, t, _TEXT_KEYS)
  lac = dict(_require(where, t, "linear_attn_config"))
  _reject_unknown(f"{where}.linear_attn_config", lac, _LAC_KEYS)
  heads = _require(where, t, "num_attention_heads")
  if t.get("num_key_value_heads", heads) != heads:
    raise ValueError(f"{where}: num_key_value_heads={t['num_key_value_heads']} must equal "
                     f"num_attention_heads={heads} (MLA)")
  if t.get("mla_use_nope", False) is not True:
    raise NotImplementedError(f"{where}: mla_use_nope must be true (RoPE MLA is not implemented)")
  # transformers 5.x saves the RoPE settings as ``rope_parameters`` (null for this NoPE model).
  for key in ("rope_scaling", "rope_parameters"):
    if t.get(key) is not None:
      raise ValueError(f"{where}: {key}={t[key]!r} contradicts mla_use_nope=true")
  if t.get("num_nextn_predict_layers", 0) != 0:
    raise NotImplementedError(f"{where}: num_nextn_predict_layers must be 0 (no MTP layers)")
  if t.get("moe_router_activation_func", "sigmoid") != "sigmoid":
    raise NotImplementedError(f"{where}: moe_router_activation_func must be 'sigmoid', "
                              f"got {t['moe_router_activation_func']!r}")
  if t.get("topk_method", "noaux_tc") != "noaux_tc":
    raise NotImplementedError(f"{where}: topk_method must be 'noaux_tc', got {t['topk_method']!r}")
  for key in ("num_expert_group", "topk_group"):
    if t.get(key, 1) != 1:
      raise NotImplementedError(f"{where}: {key} must be 1 (grouped top-k is not implemented), got {t[key]}")
  if t.get("moe_layer_freq", 1) != 1:
    raise NotImplementedError(f"{where}: moe_layer_freq must be 1, got {t['moe_layer_freq']}")
  for key in ("attention_bias", "output_router_logits"):
    if not isinstance(t.get(key, False), bool):
      raise ValueError(f"{where}: {key} must be true or false, got {t[key]!r}")
  if t.get("attention_bias", False):
    raise NotImplementedError(f"{where}: attention_bias must be false (the MLA projections have no biases), "
                              f"got true")
  tp = t.get("pretraining_tp")  # transformers' type is int | None; its KimiLinear model never reads it
  if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int)):
    raise ValueError(f"{where}: pretraining_tp must be an int or null, got {tp!r}")
  if tp not in (None, 1):
    raise NotImplementedError(f"{where}: pretraining_tp must be 1 or null (k3jax does not split the "
                              f"projections into pretraining_tp slices), got {tp}")
  if t.get("latent_moe_use_norm") and t.get("routed_expert_hidden_size") is None:
    raise ValueError(f"{where}: latent_moe_use_norm=true needs routed_expert_hidden_size")
  num_layers = _require(where, t, "num_hidden_layers")
  out = dict(
      vocab_size=_require(where, t, "vocab_size"), hidden_size=_require(where, t, "hidden_size"),
      intermediate_size=_require(where, t, "intermediate_size"), num_hidden_layers=num_layers,
      rms_norm_eps=t.get("rms_norm_eps", 1e-5), hidden_act=t.get("hidden_act", "silu"),
      situ_beta=t.get("activation_situ_beta", 4.0), situ_linear_beta=t.get("activation_situ_linear_beta", 25.0),
      num_attention_heads=heads, q_lora_rank=t.get("q_lora_rank"),
      kv_lora_rank=_require(where, t, "kv_lora_rank"), qk_nope_head_dim=_require(where, t, "qk_nope_head_dim"),
      qk_rope_head_dim=_require(where, t, "qk_rope_head_dim"), v_head_dim=_require(where, t, "v_head_dim"),
      mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
      kda_num_heads=_require(f"{where}.linear_attn_config", lac, "num_heads"),
      kda_head_dim=_require(f"{where}.linear_attn_config", lac, "head_dim"),
      short_conv_kernel_size=lac.get("short_conv_kernel_size", 4),
      gate_lower_bound=lac.get("gate_lower_bound"), use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
      layer_types=_layer_types(where, lac, num_layers),
      num_experts=_require(where, t, "num_experts"),
      num_experts_per_token=_require(where, t, "num_experts_per_token"),
      num_shared_experts=t.get("num_shared_experts", 0),
      moe_intermediate_size=_require(where, t, "moe_intermediate_size"),
      routed_expert_hidden_size=t.get("routed_expert_hidden_size"),
      latent_moe_use_norm=bool(t.get("latent_moe_use_norm", False)),
      moe_renormalize=bool(t.get("moe_renormalize", True)),
      routed_scaling_factor=t.get("routed_scaling_factor", 1.0),
      first_k_dense_replace=t.get("first_k_dense_replace", 0),
      attn_res_block_size=t.get("attn_res_block_size"),
      tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
  )
  return out


def _check_transformers_keys(t: dict, where: str, cfg: K3Config) -> None:
  """Each derived ``TRANSFORMERS_KEYS`` key of ``t`` must equal what the primary keys (read into ``cfg``) give.

  Raises:
    ValueError: a contradiction, naming the derived key, the primary keys and both values (for a per-layer
      list, the first layer where they differ).
  """
  want = cfg.transformers_keys()
  sources = {
      "layer_types": f"linear_attn_config.kda_layers={list(cfg.kda_layers)} / "
                     f"full_attn_layers={list(cfg.full_attn_layers)} (1-indexed)",
      "mlp_layer_types": f"first_k_dense_replace={cfg.first_k_dense_replace}",
      "linear_num_heads": f"linear_attn_config.num_heads={cfg.kda_num_heads}",
      "linear_head_dim": f"linear_attn_config.head_dim={cfg.kda_head_dim}",
      "linear_conv_kernel_dim": f"linear_attn_config.short_conv_kernel_size={cfg.short_conv_kernel_size}",
      "qk_head_dim": f"qk_nope_head_dim={cfg.qk_nope_head_dim} + qk_rope_head_dim={cfg.qk_rope_head_dim}",
  }
  for key, source in sources.items():
    got = t.get(key, want[key])
    if got == want[key] and type(got) is type(want[key]):
      continue
    if isinstance(want[key], list) and isinstance(got, list):
      if len(got) != len(want[key]):
        raise ValueError(f"{where}: {key} has {len(got)} entries, contradicting num_hidden_layers="
                         f"{cfg.num_hidden_layers} (one entry per layer)")
      i = next(i for i, (a, b) in enumerate(zip(got, want[key])) if a != b)
      raise ValueError(f"{where}: {key}[{i}]={got[i]!r} contradicts {source} (from which {key}[{i}]="
                       f"{want[key][i]!r}; layers 0-indexed)")
    raise ValueError(f"{where}: {key}={got!r} contradicts {source} (from which {key}={want[key]!r})")


# ---------------------------------------------------------------------------- presets
def _pattern(num_layers: int, mla_1indexed: tuple[int, ...]) -> tuple[str, ...]:
  return tuple(MLA if i + 1 in mla_1indexed else KDA for i in range(num_layers))


def _build(base: dict, overrides: dict) -> K3Config:
  """A preset's fields with the caller's overrides replacing them (never a duplicate keyword)."""
  return K3Config(**{**base, **overrides})


def _kimi_linear_48b(**kw) -> K3Config:
  return _build(dict(
      vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27, rms_norm_eps=1e-5,
      hidden_act="silu", num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
      qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=32, kda_head_dim=128, short_conv_kernel_size=4,
      layer_types=_pattern(27, (4, 8, 12, 16, 20, 24, 27)), num_experts=256, num_experts_per_token=8,
      num_shared_experts=1, moe_intermediate_size=1024, routed_scaling_factor=2.446, first_k_dense_replace=1), kw)


def _kimi_k3(**kw) -> K3Config:
  return _build(dict(
      vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=93, rms_norm_eps=1e-5,
      hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0, num_attention_heads=96, q_lora_rank=1536,
      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True,
      kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
      use_full_rank_gate=True, layer_types=_pattern(93, tuple(range(4, 92, 4)) + (92, 93)), num_experts=896,
      num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
      routed_expert_hidden_size=3584, latent_moe_use_norm=True, routed_scaling_factor=1.0,
      first_k_dense_replace=1, attn_res_block_size=12), kw)


def _tiny(**kw) -> K3Config:
  # 6 layers: KDA, KDA, MLA, KDA, MLA, MLA (the double-MLA tail of K3); layer 0 dense; 3 AttnRes blocks.
  # The latent stays 512 + 64 wide: ``mla_decode`` is specialised to the Kimi latent (Dc = 512, Dr = 64).
  base = dict(
      vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, rms_norm_eps=1e-5,
      hidden_act="situ", num_attention_heads=4, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16,
      qk_rope_head_dim=64, v_head_dim=16, mla_use_output_gate=True, kda_num_heads=4, kda_head_dim=16,
      short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
      layer_types=_pattern(6, (3, 5, 6)), num_experts=8, num_experts_per_token=2, num_shared_experts=1,
      moe_intermediate_size=32, routed_expert_hidden_size=48, latent_moe_use_norm=True,
      routed_scaling_factor=1.5, first_k_dense_replace=1, attn_res_block_size=2)
  return _build(base, kw)


def _tiny_linear(**kw) -> K3Config:
  """The tiny model in the Kimi-Linear format (every K3 switch off)."""
  base = dict(hidden_act="silu", q_lora_rank=None, mla_use_output_gate=False, gate_lower_bound=None,
              use_full_rank_gate=False, routed_expert_hidden_size=None, latent_moe_use_norm=False,
              routed_scaling_factor=2.446, attn_res_block_size=None)
  base.update(kw)
  return _tiny(**base)


def _tiny9(**kw) -> K3Config:
  # Every dimension a 9-way mesh shards divides by 9: heads 9, experts 18, vocab 576, hidden 144, FFN 288/36.
  base = dict(vocab_size=576, hidden_size=144, intermediate_size=288, num_attention_heads=9, q_lora_rank=36,
              kda_num_heads=9, kda_head_dim=16, num_experts=18, num_experts_per_token=2,
              moe_intermediate_size=36, routed_expert_hidden_size=72)
  base.update(kw)
  return _tiny(**base)


PRESETS = {"kimi_linear_48b": _kimi_linear_48b, "kimi_k3": _kimi_k3, "tiny": _tiny, "tiny_linear": _tiny_linear,
           "tiny9": _tiny9}


def preset(name: str, **overrides) -> K3Config:
  """A named config (``kimi_linear_48b``, ``kimi_k3``, ``tiny``, ``tiny_linear``, ``tiny9``) with overrides."""
  if name not in PRESETS:
    raise ValueError(f"preset name must be one of {sorted(PRESETS)}, got {name!r}")
  return PRESETS[name](**overrides)

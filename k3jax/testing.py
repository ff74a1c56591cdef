"""Test support for ``k3jax``: random Hugging Face checkpoints with the real names, layouts and files.

``write_tiny_hf`` writes a random Kimi-Linear or Kimi-K3 checkpoint of any ``K3Config`` (bf16 or MXFP4 routed
experts), so that ``k3jax.checkpoint.load_hf`` and the CLI are tested on the files a user has without
downloading a model. The draws follow the model's own initialisation (gate parameters, norms near 1), and the
MXFP4 draws are exact on the e2m1 grid, so the bf16 and MXFP4 checkpoints of one seed hold the same weights.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from k3jax import checkpoint as ck
from k3jax.config import KDA, K3Config


TRANSFORMERS_VERSION = "5.24.0"  # the release whose KimiLinearConfig the transformers naming follows


def _mxfp4_draw(rng: np.random.Generator, shape: tuple[int, int], std: float) -> tuple[np.ndarray, np.ndarray]:
  """Random ``N(0, std)`` weights rounded to MXFP4: ``(codes [out, in] uint8, scales [out, in/32] uint8)``."""
  out, inp = shape
  x = rng.normal(0.0, std, (out, inp // ck.MXFP4_GROUP, ck.MXFP4_GROUP))
  amax = np.maximum(np.abs(x).max(-1), 1e-30)
  exp = np.clip(np.ceil(np.log2(amax / ck.E2M1[-1])), -127, 127).astype(np.int32)  # |x| / 2^exp <= 6
  y = x / np.ldexp(1.0, exp)[..., None]
  idx = np.abs(np.abs(y)[..., None] - ck.E2M1).argmin(-1).astype(np.uint8)
  codes = np.where((y < 0) & (idx > 0), idx | 8, idx).astype(np.uint8)
  return codes.reshape(out, inp), (exp + 127).astype(np.uint8)


def _mxfp4_pack(codes: np.ndarray) -> np.ndarray:
  return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)



def mxfp4_quantization_config() -> dict:
  weights = {"num_bits": 4, "type": "float", "group_size": ck.MXFP4_GROUP, "strategy": "group", "symmetric": True,
             "dynamic": False}
  return {"quant_method": "compressed-tensors", "format": ck.MXFP4_FORMAT,
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": ck.MXFP4_FORMAT}},
          "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                     "re:.*routed_expert_(down|up)_proj.*", "re:.*block_sparse_moe\\.gate.*", "lm_head",
                     "re:vision_tower.*", "re:mm_projector.*"]}



def _vision_tensors(rng: np.random.Generator, d: int) -> dict[str, np.ndarray]:
  """A few MoonViT / projector tensors, so that readers must skip them explicitly."""
  shapes = {"vision_tower.patch_embed.proj.weight": (16, 3, 2, 2),
            "vision_tower.encoder.blocks.0.attn.wqkv.weight": (48, 16),
            "vision_tower.encoder.final_layernorm.weight": (16,),
            "mm_projector.pre_norm.weight": (16,),
            "mm_projector.proj.0.weight": (d, 64)}
  return {n: rng.normal(0.0, 0.1, s).astype(ml_dtypes.bfloat16) for n, s in shapes.items()}


def _draw(rng: np.random.Generator, rule: ck.HfRule) -> np.ndarray:
  """A random HF tensor for ``rule`` (not experts), in its checkpoint dtype."""
  shape, kind = rule.hf_shape, rule.kind
  bf16 = ml_dtypes.bfloat16
  if kind == "linear":
    return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(bf16)
  if kind == "embed":
    return rng.normal(0.0, 1.0, shape).astype(bf16)
  if kind == "norm":
    # 1 + N(0, 0.05): a missing multiplication by the weight cannot cancel out.
    return (1.0 + 0.05 * rng.normal(size=shape)).astype(bf16)
  if kind == "conv":
    return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)
  if kind == "bias":
    return rng.normal(0.0, 0.1, shape).astype(np.float32)
  if kind == "dt_bias":
    dt = np.maximum(np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape)), 1e-4)
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus^-1(dt)
  if kind == "a_log":
    return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
  if kind == "a_log_padded":
    out = np.zeros(shape, np.float32)
    out[rule.part] = np.log(rng.uniform(1.0, 16.0, out[rule.part].shape))
    return out
  raise ValueError(f"no random draw for tensor kind {kind!r}")


def _shard_groups(names: list[str], sizes: dict[str, int], num_shards: int) -> list[list[str]]:
  """``num_shards <= len(names)`` consecutive groups of about equal bytes, none empty."""
  total, groups, acc, last = max(sum(sizes.values()), 1), [[] for _ in range(num_shards)], 0, 0
  for i, name in enumerate(names):
    # Never skip a group, and leave at least one tensor for every later group.
    last = max(last, num_shards - (len(names) - i), min(acc * num_shards // total, last + 1, num_shards - 1))
    groups[last].append(name)
    acc += sizes[name]
  return groups


def write_tiny_hf(path: str | os.PathLike, config: K3Config, seed: int, fmt: str = "kimi_linear",
                  mxfp4: bool = False, *, num_shards: int = 3, naming: str = "original") -> str:
  """Writes a random checkpoint of ``config`` with the real HF names, layouts and files.

  Files: ``config.json`` (``config.to_hf(fmt)``, plus ``quantization_config`` with ``mxfp4``),
  ``generation_config.json``, ``model.safetensors.index.json`` and ``num_shards`` shards
  ``model-0000i-of-0000n.safetensors``. Linear weights are ``N(0, 1/in)`` bf16 ``[out, in]``, norm weights
  ``1 + N(0, 0.05)`` bf16, ``A_log``/``dt_bias``/convs/correction bias f32. Routed expert weights are
  drawn on the MXFP4 grid (when their input width is a multiple of 32) (e2m1 times a power of two per 32
  inputs), so the bf16 (``mxfp4=False``) and the MXFP4 checkpoint of one seed dequantize to identical weights.
  ``kimi_k3`` also writes vision tensors.
  ``naming="transformers"`` writes what ``transformers`` saves of a ``KimiLinear`` model: the dense MLPs as
  ``block_sparse_moe.*`` and ``config.json`` with ``config.transformers_keys()`` and ``transformers_version``;
  its weights are those of the original naming with the same seed.

  Args:
    path: output directory (created).
    config: the architecture (``K3Config``).
    seed: RNG seed; equal seeds give equal weights in both formats and both expert encodings.
    fmt: "kimi_linear" or "kimi_k3".
    mxfp4: routed experts as ``weight_packed`` + ``weight_scale``.
    num_shards: number of safetensors files (>= 2 unless the model has fewer tensors).
    naming: "original" (the published checkpoints) or "transformers" (kimi_linear only).

  Returns:
    ``path`` as a string.

  Raises:
    ValueError: a bad ``fmt``, ``num_shards`` or ``naming`` (or "transformers" with ``kimi_k3``); MXFP4 with
      an expert input width not a multiple of 32; ``kimi_k3`` with more KDA heads than the head dim (its
      ``A_log`` is padded to the head dim).
  """
  if fmt not in ck.FORMATS:
    raise ValueError(f"fmt must be one of {ck.FORMATS}, got {fmt!r}")
  rules = ck.hf_rules(config, fmt, naming)  # refuses a bad naming before anything is written
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
  if mxfp4:
    widths = {"moe hidden size (w1/w3 input)": config.moe_hidden_size,
              "moe_intermediate_size (w2 input)": config.moe_intermediate_size}
    bad = {k: v for k, v in widths.items() if v % ck.MXFP4_GROUP}
    if bad:
      raise ValueError(f"mxfp4 needs expert input widths that are multiples of {ck.MXFP4_GROUP}, got {bad}")
  if fmt == "kimi_k3" and config.kda_num_heads > config.kda_head_dim and KDA in config.layer_types:
    raise ValueError(f"the kimi_k3 A_log holds kda_num_heads={config.kda_num_heads} values zero-padded to "
                     f"kda_head_dim={config.kda_head_dim}; it needs kda_num_heads <= kda_head_dim")
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  rng = np.random.default_rng(seed)
  prefix = ck.K3_PREFIX if fmt == "kimi_k3" else ""
  tensors: dict[str, np.ndarray] = {}
  for rule in rules:
    name = prefix + rule.hf
    if rule.num_experts:
      rows, cols = rule.hf_shape
      for e in range(rule.num_experts):
        names = [prefix + n for n in ck.expert_names(rule, e, mxfp4)]
        if cols % ck.MXFP4_GROUP:
          # No MXFP4 twin exists at this width (mxfp4 was refused above): plain bf16 weights.
          tensors[names[0]] = rng.normal(0.0, cols ** -0.5, rule.hf_shape).astype(ml_dtypes.bfloat16)
          continue
        codes, scale = _mxfp4_draw(rng, rule.hf_shape, cols ** -0.5)
        if mxfp4:
          tensors[names[0]], tensors[names[1]] = _mxfp4_pack(codes), scale
        else:
          tensors[names[0]] = ck.mxfp4_dequantize(_mxfp4_pack(codes), scale).astype(ml_dtypes.bfloat16)
    elif name not in tensors:  # kv_b_proj feeds two parameters
      tensors[name] = _draw(rng, rule)
  if fmt == "kimi_k3":
    tensors.update(_vision_tensors(rng, config.hidden_size))

  hf_config = config.to_hf(fmt)
  hf_config["torch_dtype"] = "bfloat16"
  if naming == "transformers":
    hf_config.update(config.transformers_keys(), transformers_version=TRANSFORMERS_VERSION)
  if mxfp4:
    hf_config["quantization_config"] = mxfp4_quantization_config()
  if fmt == "kimi_k3":
    hf_config["vision_config"] = {"model_type": "moonvit", "hidden_size": 16, "patch_size": 2}
    hf_config["media_placeholder_token_id"] = config.vocab_size - 1
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"max_new_tokens": 32, "do_sample": False}, f, indent=2)

  names = list(tensors)
  groups = _shard_groups(names, {n: tensors[n].nbytes for n in names}, min(num_shards, len(names)))
  weight_map = {}
  for i, group in enumerate(groups):
    fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file({n: np.ascontiguousarray(tensors[n]) for n in group}, os.path.join(path, fname),
              metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(group, fname))
  index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
  with open(os.path.join(path, ck.INDEX_FILE), "w") as f:
    json.dump(index, f, indent=2)
  return path


__all__ = ["mxfp4_quantization_config", "write_tiny_hf"]

"""Makes the golden fixture of ``tests/test_golden_transformers.py``: a tiny random Kimi-Linear model built and
saved by transformers' own ``KimiLinearConfig`` / ``KimiLinearForCausalLM``, and its float32 logits.

How the committed files were made (run once, from the repository root, on a machine with torch and
transformers >= 5 (``transformers/models/kimi_linear``); written against torch 2.11 and transformers 5.17.0)::

  CUDA_VISIBLE_DEVICES="" python tests/data/kimi_linear_tiny/make_fixture.py tests/data/kimi_linear_tiny

The exact command, versions, platform, the seed used and the sha256 of every file are written to
``provenance.json`` next to the other outputs.

Outputs in ``out_dir`` (the script itself, if it lives there, is left alone):

* ``config.json``, ``generation_config.json``, ``model.safetensors``: ``model.save_pretrained(out_dir)`` of a
  float32 ``KimiLinearForCausalLM``. transformers saves in the original checkpoint layout (it reverts its load-time
  conversions: per-expert ``w1``/``w2``/``w3``, ``q/k/v_conv1d``, ``A_log``/``dt_bias``/``f_a_proj``/``f_b_proj``
  under ``self_attn``), except that every ``.mlp.`` becomes ``.block_sparse_moe.``: the dense MLP of layer 0 is
  saved as ``model.layers.0.block_sparse_moe.{gate,up,down}_proj`` (the "transformers naming" of
  ``k3jax.checkpoint``). ``config.json`` holds transformers' derived keys (``layer_types``, ``mlp_layer_types``,
  ``linear_*``, ``qk_head_dim``, ...) and ``transformers_version``.
* ``expected.npz``: ``num_sequences``; per sequence ``n``: ``tokens_{n}`` int32 ``[L_n]`` and ``logits_{n}``
  float32 ``[L_n, vocab]`` (``model(input_ids[None]).logits[0]``, batch 1, no padding, no cache).
* ``provenance.json``: how the files were made.

The model (every feature k3jax implements in the Kimi-Linear format; ``K3Config.from_hf`` accepts the config):
hidden 64, vocab 256, 4 layers KDA / MLA / KDA / MLA (``linear_attn_config`` 1-indexed: kda [1, 3], full [2, 4]);
layer 0 a dense SwiGLU MLP (intermediate 96), layers 1-3 MoE (8 experts, top 2, 1 shared expert of width 32,
sigmoid router with a correction bias, renormalised, ``routed_scaling_factor`` 2.446, one expert group); MLA with
4 heads, no q LoRA, ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 16, ``qk_rope_head_dim`` 64 (NoPE: transformers'
``KimiLinearAttention`` applies no rotary embedding, so no ``rope_scaling`` / ``rope_theta`` key), ``v_head_dim``
16; KDA with 4 heads of 16, conv width 4, silu. Three prompts of 7, 12 and 70 tokens (70 > 64 crosses a chunk of
transformers' chunked KDA).

Kernels: transformers' KDA (``chunk_kimi_delta_attention``) and short conv (``causal_conv1d_fn``) have pure-torch
reference implementations that run on CPU; they are replaced by ``fla`` / ``causal_conv1d`` kernels (Triton,
GPU only) when those packages are importable at the time transformers imports its Kimi-Linear module. This script
makes them unimportable first (and turns hub kernels off), so the torch reference path runs; it checks that it
did. Attention is ``eager``, experts ``eager``, everything float32 on CPU.

Weights: transformers' init leaves every RMSNorm weight at 1 and the router correction bias at 0, and its
``initializer_range`` 0.02 makes every sublayer negligible against the residual stream, so a loader bug could
hide. Every parameter and the correction bias are therefore re-drawn from a seeded ``torch.Generator``: linear
weights ``N(0, 1/in)``, embeddings ``N(0, 1)``, norm weights ``1 + N(0, 0.1)``, convs ``N(0, 1/W)``, ``A_log``
``log U(1, 16)``, ``dt_bias`` ``softplus^-1(dt)`` with ``log dt ~ U(log 1e-3, log 1e-1)``, correction bias
``N(0, 0.1)``. The draw is repeated with the next seed if any token's top-k choice is within ``MIN_MARGIN`` of
a tie (so that float32 rounding differences between implementations cannot flip an expert choice); the seed
used is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import importlib.util
import json
import math
import os
import platform
import sys

# Before torch / transformers: the CPU run, and the torch reference paths of the KDA and conv ops.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["USE_HUB_KERNELS"] = "0"
BLOCKED = ("fla", "causal_conv1d")
_FOUND = {name: importlib.util.find_spec(name) is not None for name in BLOCKED}
for _name in BLOCKED:
  sys.modules[_name] = None  # `import fla` now raises ImportError: transformers falls back to its torch code

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402

SEED = 20260
MAX_ATTEMPTS = 20
MIN_MARGIN = 1e-3  # smallest allowed gap between the k-th and (k+1)-th router choice score of any token
MAX_BYTES = 3 * 1024 * 1024

HF_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-5,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
    mla_use_nope=True,
    linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4, "head_dim": 16,
                        "short_conv_kernel_size": 4},
    num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
    first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid", moe_renormalize=True,
    routed_scaling_factor=2.446, use_grouped_topk=True, num_expert_group=1, topk_group=1,
    num_nextn_predict_layers=0, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

PROMPTS = (
    [1, 17, 200, 3, 99, 255, 42],
    [1, 64, 65, 66, 128, 0, 7, 7, 7, 250, 31, 180],
    [(37 * i * i + 11 * i + 5) % 256 for i in range(70)],
)

# Names save_pretrained must write (the transformers naming of k3jax.checkpoint) and names it must not.
EXPECTED_NAMES = (
    "model.layers.0.block_sparse_moe.gate_proj.weight", "model.layers.0.block_sparse_moe.up_proj.weight",
    "model.layers.0.block_sparse_moe.down_proj.weight", "model.layers.0.self_attn.q_conv1d.weight",
    "model.layers.0.self_attn.k_conv1d.weight", "model.layers.0.self_attn.v_conv1d.weight",
    "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.f_a_proj.weight",
    "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.block_sparse_moe.gate.weight",
    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
    "model.layers.1.block_sparse_moe.experts.0.w1.weight", "model.layers.1.block_sparse_moe.experts.7.w2.weight",
    "model.layers.1.block_sparse_moe.experts.7.w3.weight",
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight", "lm_head.weight",
)
FORBIDDEN_FRAGMENTS = (".mlp.", "forget_gate", ".conv1d.", "gate_up_proj", ".experts.down_proj")
# config.json keys k3jax's K3Config.from_hf rejects (transformers writes rope_parameters when given rope_scaling).
FORBIDDEN_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def _normal(gen: torch.Generator, shape, std: float) -> torch.Tensor:
  return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _uniform(gen: torch.Generator, shape, lo: float, hi: float) -> torch.Tensor:
  return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
  """A fresh value of the parameter or buffer ``name`` (transformers' module names)."""
  if name.endswith("embed_tokens.weight"):
    return _normal(gen, shape, 1.0)
  if name.endswith("norm.weight"):  # input/post_attention_layernorm, kv_a_layernorm, o_norm, model.norm
    return 1.0 + _normal(gen, shape, 0.1)
  if name.endswith("A_log"):
    return torch.log(_uniform(gen, shape, 1.0, 16.0))
  if name.endswith("dt_bias"):
    dt = torch.exp(_uniform(gen, shape, math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
  if name.endswith("e_score_correction_bias"):
    return _normal(gen, shape, 0.1)
  if name.endswith("conv1d.weight"):  # [3 P, 1, W]
    return _normal(gen, shape, shape[-1] ** -0.5)
  if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):  # [E, out, in]
    return _normal(gen, shape, shape[-1] ** -0.5)
  if name.endswith(".weight") and len(shape) == 2:  # every nn.Linear [out, in] (router included)
    return _normal(gen, shape, shape[-1] ** -0.5)
  raise ValueError(f"no draw rule for {name} {tuple(shape)}: add one (no tensor may keep transformers' init)")


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> list[str]:
  """Re-draws every parameter and the router correction biases; returns the names drawn."""
  gen = torch.Generator().manual_seed(seed)
  tensors = dict(model.named_parameters())
  tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
  for name in sorted(tensors):
    t = tensors[name]
    t.copy_(_draw(name, tuple(t.shape), gen).to(t.dtype))
  return sorted(tensors)


def build(seed: int) -> torch.nn.Module:
  torch.manual_seed(seed)
  config = KimiLinearConfig(**HF_CONFIG, dtype="float32")
  model = KimiLinearForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="eager",
                                            experts_implementation="eager")
  redraw(model, seed)
  return model.eval()


def forward(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
  """``logits [L, vocab]`` float32 of one prompt (batch 1, no mask, no cache)."""
  with torch.inference_mode():
    out = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False)
  logits = out.logits[0].float().cpu().numpy()
  assert logits.shape == (len(tokens), HF_CONFIG["vocab_size"]), logits.shape
  return logits


def router_margins(model: torch.nn.Module) -> tuple[list[np.ndarray], float]:
  """Every prompt's logits and the smallest top-k margin of any router over all prompts' tokens."""
  margins = []

  def hook(module, inputs, output):
    router_logits = output[0].float()
    choice = router_logits.sigmoid() + module.e_score_correction_bias.float()
    top = torch.sort(choice, dim=-1, descending=True).values
    k = module.top_k
    margins.append(float((top[:, k - 1] - top[:, k]).min()))

  routers = [m for m in model.modules() if isinstance(m, modeling_kimi_linear.KimiLinearTopkRouter)]
  handles = [r.register_forward_hook(hook) for r in routers]
  try:
    logits = [forward(model, p) for p in PROMPTS]
  finally:
    for h in handles:
      h.remove()
  assert len(margins) == len(routers) * len(PROMPTS) and routers, (len(margins), len(routers))
  return logits, min(margins)


def _is_torch_reference(fn) -> bool | None:
  """Whether a ``use_kernel_func_from_hub_with_fallback`` function runs its torch code (None: cannot tell)."""
  seen, stack = set(), [fn]
  while stack:
    f = stack.pop()
    if id(f) in seen:
      continue
    seen.add(id(f))
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
    if code is not None:
      for name, cell in zip(code.co_freevars, cells):
        if name == "is_new_implementation":
          return not cell.cell_contents
    if getattr(f, "__wrapped__", None) is not None:
      stack.append(f.__wrapped__)
  return None


def check_reference_paths() -> dict:
  funcs = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn")
  out = {name: _is_torch_reference(getattr(modeling_kimi_linear, name)) for name in funcs}
  bad = [name for name, ref in out.items() if ref is False]
  if bad:
    raise RuntimeError(f"{bad} dispatch to an external kernel although {BLOCKED} were blocked")
  return {name: "torch reference" if ref else "unknown (fla/causal_conv1d were blocked)" for name, ref in out.items()}


def saved_tensors(out_dir: str) -> dict[str, torch.Tensor]:
  from safetensors.torch import load_file

  names = {}
  for fname in sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))):
    names.update(load_file(fname))
  return names


def check_saved(out_dir: str) -> None:
  names = saved_tensors(out_dir)
  missing = [n for n in EXPECTED_NAMES if n not in names]
  stray = [n for n in names if any(frag in n for frag in FORBIDDEN_FRAGMENTS)]
  if missing or stray:
    raise RuntimeError(f"save_pretrained wrote unexpected names: missing {missing}, stray {stray}; all: "
                       f"{sorted(names)}")
  not_f32 = {n: str(t.dtype) for n, t in names.items() if t.dtype != torch.float32}
  if not_f32:
    raise RuntimeError(f"tensors not saved as F32: {not_f32}")
  with open(os.path.join(out_dir, "config.json")) as f:
    cfg = json.load(f)
  bad = [k for k in FORBIDDEN_CONFIG_KEYS if k in cfg]
  if bad or cfg.get("mla_use_nope") is not True or "transformers_version" not in cfg:
    raise RuntimeError(f"config.json: forbidden keys {bad}, mla_use_nope={cfg.get('mla_use_nope')!r}, "
                       f"transformers_version={cfg.get('transformers_version')!r}")
  for key in ("linear_attn_config", "layer_types", "mlp_layer_types", "first_k_dense_replace", "num_experts",
              "num_experts_per_token", "num_shared_experts", "kv_lora_rank"):
    if key not in cfg:
      raise RuntimeError(f"config.json lacks {key!r}: {sorted(cfg)}")


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    h.update(f.read())
  return h.hexdigest()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out_dir", help="output directory (created; the files it writes are replaced)")
  args = parser.parse_args()
  out_dir = args.out_dir
  os.makedirs(out_dir, exist_ok=True)
  for pattern in ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
                  "expected.npz", "provenance.json"):
    for stale in glob.glob(os.path.join(out_dir, pattern)):
      os.remove(stale)

  kernels = check_reference_paths()
  for attempt in range(MAX_ATTEMPTS):
    seed = SEED + attempt
    model = build(seed)
    logits, margin = router_margins(model)
    print(f"seed {seed}: smallest router top-k margin {margin:.3g}")
    if margin >= MIN_MARGIN:
      break
  else:
    raise RuntimeError(f"no seed in [{SEED}, {SEED + MAX_ATTEMPTS}) gives router margins >= {MIN_MARGIN}")
  for n, lg in enumerate(logits):
    if not np.isfinite(lg).all():
      raise RuntimeError(f"prompt {n}: non-finite logits")
    print(f"prompt {n}: {len(PROMPTS[n])} tokens, logits std {lg.std():.3f}, max |.| {np.abs(lg).max():.3f}")

  model.save_pretrained(out_dir)
  check_saved(out_dir)
  # The saved files are the model: reloading them gives the same logits.
  reloaded = KimiLinearForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                                   experts_implementation="eager").eval()
  for n, p in enumerate(PROMPTS):
    diff = float(np.abs(forward(reloaded, p) - logits[n]).max())
    if diff > 1e-6 * float(np.abs(logits[n]).max()):  # the same ops on the same weights: ~0 (a wrong tensor: O(1))
      raise RuntimeError(f"prompt {n}: reloaded model differs from the saved one by {diff}")

  arrays = {"num_sequences": np.int32(len(PROMPTS))}
  for n, (p, lg) in enumerate(zip(PROMPTS, logits)):
    arrays[f"tokens_{n}"] = np.asarray(p, np.int32)
    arrays[f"logits_{n}"] = lg.astype(np.float32)
  np.savez(os.path.join(out_dir, "expected.npz"), **arrays)

  written = sorted(f for f in os.listdir(out_dir)
                   if os.path.isfile(os.path.join(out_dir, f)) and not f.endswith(".py") and f != "provenance.json")
  total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in written)
  if total > MAX_BYTES:
    raise RuntimeError(f"fixture is {total} bytes (> {MAX_BYTES}): {written}")
  provenance = {
      "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
      "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
      "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
      "device": "cpu", "dtype": "float32", "torch_num_threads": torch.get_num_threads(),
      "attn_implementation": "eager", "experts_implementation": "eager",
      "blocked_imports": {name: {"installed": found, "blocked": True} for name, found in _FOUND.items()},
      "kernels": kernels, "seed": seed, "min_router_margin": margin, "hf_config": HF_CONFIG,
      "prompts": [list(p) for p in PROMPTS],
      "files": {f: {"bytes": os.path.getsize(os.path.join(out_dir, f)), "sha256": _sha256(os.path.join(out_dir, f))}
                for f in written},
  }
  with open(os.path.join(out_dir, "provenance.json"), "w") as f:
    json.dump(provenance, f, indent=2)
    f.write("\n")
  print(f"wrote {written + ['provenance.json']} to {out_dir} ({total} bytes)")


if __name__ == "__main__":
  main()

"""Command line: ``python -m k3jax convert`` (HF checkpoint -> k3jax params) and ``generate`` (greedy decoding).

Tokens in, tokens out: no tokenizer is needed (``--tokens 1,2,3``).
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import numpy as safetensors_np

from k3jax import checkpoint
from k3jax.cache import init_cache
from k3jax.config import K3Config
from k3jax.model import KimiK3Model
from k3jax.steps import decode, prefill

PARAMS_FILE = "k3jax_params.safetensors"


def save_converted(cfg: K3Config, model: KimiK3Model, out: str | os.PathLike) -> None:
  """Writes ``config.json`` (Kimi-Linear form) and every parameter under its dotted k3jax path."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg.to_hf("kimi_linear"), f, indent=1)
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  tensors = {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}
  safetensors_np.save_file(tensors, os.path.join(out, PARAMS_FILE))


def load_converted(path: str | os.PathLike, **runtime) -> tuple[K3Config, KimiK3Model]:
  """Reads what ``save_converted`` wrote; every parameter must be present with its shape and dtype."""
  cfg = K3Config.from_hf(os.fspath(path), **runtime)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: KimiK3Model(cfg, rngs=nnx.Rngs(0))))
  tensors = safetensors_np.load_file(os.path.join(path, PARAMS_FILE))
  for p, var in nnx.to_flat_state(nnx.state(state, nnx.Param)):
    name = ".".join(map(str, p))
    if name not in tensors:
      raise ValueError(f"{PARAMS_FILE} has no tensor {name!r}")
    value = tensors.pop(name)
    if value.shape != tuple(var.shape) or value.dtype != np.dtype(var.dtype):
      raise ValueError(f"{name} must be {np.dtype(var.dtype).name}{tuple(var.shape)}, got "
                       f"{value.dtype.name}{value.shape}")
    var.set_value(jnp.asarray(value))
  if tensors:
    raise ValueError(f"{PARAMS_FILE} has unexpected tensors {sorted(tensors)[:5]}")
  return cfg, nnx.merge(graphdef, state)


def _load(args) -> tuple[K3Config, KimiK3Model]:
  if args.converted:
    return load_converted(args.converted)
  return checkpoint.load_hf(args.hf)


def generate_tokens(cfg: K3Config, model: KimiK3Model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
  """Greedy decoding of one prompt: one prefill, then ``max_new_tokens - 1`` decode steps."""
  if not prompt:
    raise ValueError("prompt must hold at least one token")
  bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
  if bad:
    raise ValueError(f"prompt tokens must be in [0, {cfg.vocab_size}), got {bad[:5]}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  cache = init_cache(cfg, 1, len(prompt) + max_new_tokens)
  tokens = jnp.asarray(prompt, jnp.int32)
  logits, cache = prefill(model, tokens, jnp.asarray([0, len(prompt)], jnp.int32), cache)
  out = [int(jnp.argmax(logits[-1]))]
  for _ in range(max_new_tokens - 1):
    logits, cache = decode(model, jnp.asarray(out[-1:], jnp.int32), cache)
    out.append(int(jnp.argmax(logits[0])))
  return out


def _parse_tokens(text: str) -> list[int]:
  try:
    return [int(t) for t in text.replace(",", " ").split()]
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--tokens must be integers separated by commas or spaces: {e}") from e


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m k3jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  conv = sub.add_parser("convert", help="read an HF Kimi-Linear / Kimi-K3 checkpoint and write k3jax params")
  conv.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, index, shards)")
  conv.add_argument("--out", required=True, help="output directory (config.json + " + PARAMS_FILE + ")")
  gen = sub.add_parser("generate", help="greedy decoding from token ids")
  src = gen.add_mutually_exclusive_group(required=True)
  src.add_argument("--hf", help="HF checkpoint directory")
  src.add_argument("--converted", help="directory written by 'convert'")
  gen.add_argument("--tokens", required=True, type=_parse_tokens, help="prompt token ids, e.g. 1,2,3")
  gen.add_argument("--max-new-tokens", type=int, default=16)
  args = parser.parse_args(argv)

  if args.command == "convert":
    cfg, model = checkpoint.load_hf(args.hf)
    save_converted(cfg, model, args.out)
    print(f"wrote {args.out}: {cfg.num_hidden_layers} layers, {sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))):,} parameters")
    return 0
  cfg, model = _load(args)
  t0 = time.perf_counter()
  out = generate_tokens(cfg, model, args.tokens, args.max_new_tokens)
  print(" ".join(map(str, out)))
  print(f"{len(out)} tokens in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
  return 0

"""Command line: ``python -m k3jax convert`` (HF checkpoint -> k3jax params) and ``generate`` (greedy decoding).

``convert`` writes an Orbax checkpoint (``k3jax.converted``) that ``generate --converted`` restores.
Tokens in, tokens out: no tokenizer is needed (``--tokens 1,2,3``).
"""

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import checkpoint
from k3jax.cache import init_cache
from k3jax.config import K3Config
from k3jax.converted import config_from_json, load_converted, read_metadata, save_converted
from k3jax.model import KimiK3Model
from k3jax.steps import decode, prefill


def _load(args, cfg: K3Config) -> tuple[K3Config, KimiK3Model]:
  """The ``generate`` model; ``--impl`` (None: the machine's default) picks the kernel backend."""
  impl = args.impl or cfg.impl
  if args.converted:
    return load_converted(args.converted, impl=impl)
  return checkpoint.load_hf(args.hf, config=cfg.replace(impl=impl))


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
  logits, cache = prefill(model, tokens, jnp.asarray([0, len(prompt)], jnp.int32), cache, last_only=True)
  out = [int(jnp.argmax(logits[0]))]
  for _ in range(max_new_tokens - 1):
    logits, cache = decode(model, jnp.asarray(out[-1:], jnp.int32), cache)
    out.append(int(jnp.argmax(logits[0])))
  return out


class _Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose errors are one line on stderr, ``k3jax: error: ...`` (exit status 2)."""

  def error(self, message: str) -> NoReturn:
    """Exits with status 2 after one line: the mistake and where the help is."""
    _fail(f"{message} (see '{self.prog} --help')")


def _fail(message: str) -> NoReturn:
  """Exits with status 2 after one line ``k3jax: error: message`` on stderr (no traceback)."""
  print("k3jax: error: " + " ".join(message.split()), file=sys.stderr)
  raise SystemExit(2)


@contextlib.contextmanager
def _reported(flag: str, path: str):
  """Turns a library's ValueError, NotImplementedError or OSError about ``path`` into one ``_fail`` line."""
  try:
    yield
  except (OSError, ValueError, NotImplementedError) as e:
    msg, paths = str(e), (path, os.path.abspath(path))
    if msg.startswith(paths):
      msg = f"{flag} {msg}"
    elif any(p in msg for p in paths):
      msg = f"{flag}: {msg}"
    else:
      msg = f"{flag} {path}: {msg}"
    _fail(msg)


def _parse_tokens(text: str) -> list[int]:
  """``--tokens``: at least one integer, separated by commas or spaces."""
  parts = text.replace(",", " ").split()
  if not parts:
    raise argparse.ArgumentTypeError("no token ids given (e.g. --tokens 1,2,3)")
  tokens = []
  for t in parts:
    try:
      tokens.append(int(t))
    except ValueError:
      msg = f"token ids must be integers separated by commas or spaces, got {t!r}"
      raise argparse.ArgumentTypeError(msg) from None
  return tokens


def _positive_int(text: str) -> int:
  """``--max-new-tokens``: an integer >= 1."""
  try:
    n = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {n}")
  return n


def _read_config(flag: str, path: str) -> K3Config:
  """The config of the ``--hf`` or ``--converted`` checkpoint at ``path``, from its JSON alone (no weights)."""
  with _reported(flag, path):
    if flag == "--converted":
      return config_from_json(read_metadata(path).get("config"), path)
    if not os.path.isdir(path):
      raise ValueError(f"{path}: {'not a directory' if os.path.exists(path) else 'no such directory'}")
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise ValueError(f"{path} has no config.json (an HF checkpoint directory holds config.json, the "
                       "safetensors index and shards)")
    return K3Config.from_hf(path)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs ``convert`` or ``generate``; returns 0, or exits with status 2 after one line naming a user mistake.

  Every argument, the checkpoint's path and the prompt's token ids (against the vocab in the checkpoint's
  config) are checked before any weight is read.
  """
  parser = _Parser(prog="python -m k3jax", description=__doc__.replace("``", ""))
  sub = parser.add_subparsers(dest="command", required=True)
  conv = sub.add_parser("convert", help="read an HF Kimi-Linear / Kimi-K3 checkpoint and write k3jax params",
                        description="Reads an HF Kimi-Linear / Kimi-K3 checkpoint and writes it as k3jax params.")
  conv.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, index, shards)")
  conv.add_argument("--out", required=True,
                    help="output directory (an Orbax checkpoint: parameters, config, format version)")
  gen = sub.add_parser("generate", help="greedy decoding from token ids",
                       description="Greedy decoding of one prompt of token ids; prints the generated ids.")
  src = gen.add_mutually_exclusive_group(required=True)
  src.add_argument("--hf", help="HF checkpoint directory")
  src.add_argument("--converted", help="directory written by 'convert'")
  gen.add_argument("--tokens", required=True, type=_parse_tokens, help="prompt token ids, e.g. 1,2,3")
  gen.add_argument("--max-new-tokens", type=_positive_int, default=16, metavar="N",
                   help="tokens to generate (default: %(default)s)")
  gen.add_argument("--impl", choices=("pallas", "xla"), default=None,
                   help="kernel backend (default: pallas on a Hopper GPU, xla elsewhere); the Pallas kernels "
                        "need K3-like widths, so small test checkpoints on a GPU need xla")
  args = parser.parse_args(argv)
  flag, path = ("--converted", args.converted) if getattr(args, "converted", None) else ("--hf", args.hf)
  cfg = _read_config(flag, path)

  if args.command == "convert":
    if os.path.exists(args.out) and not os.path.isdir(args.out):
      _fail(f"--out {args.out}: exists and is not a directory")
    with _reported(flag, path):
      cfg, model = checkpoint.load_hf(args.hf)
    with _reported("--out", args.out):
      save_converted(cfg, model, args.out)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"wrote {args.out}: {cfg.num_hidden_layers} layers, {n_params:,} parameters")
    return 0
  bad = [t for t in args.tokens if not 0 <= t < cfg.vocab_size]
  if bad:
    _fail(f"--tokens: token ids must be in [0, {cfg.vocab_size}) (vocab_size of {path}), got {bad[:5]}")
  with _reported(flag, path):
    cfg, model = _load(args, cfg)
  t0 = time.perf_counter()
  try:
    out = generate_tokens(cfg, model, args.tokens, args.max_new_tokens)
  except NotImplementedError as e:  # a kernel's size limit: name it and the backend without one
    _fail(f"--impl {cfg.impl}: {e} (--impl xla runs any size)")
  print(" ".join(map(str, out)))
  print(f"{len(out)} tokens in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
  return 0

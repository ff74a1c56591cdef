"""Prefix caching on the Kimi-K3 block (one KDA and one MLA layer, both MoE, K3 widths): time to first token
with and without a cached prefix, what saving checkpoints costs a prefill, and the memory of a cached token.

The block, its parameters, the mesh (one device) and the expert fit are ``benchmarks/sharded_block.py``'s
(``block_config``, ``init_model``, ``fit_experts``). The prompt is ``--prefix-len`` P random token ids (the shared
prefix) followed by ``--new-len`` M more; every prefill asks for the last token's logits only (``last_only``).

(a) Time to first token through ``k3jax.serving.admit`` (host lookup and bookkeeping, the checkpoint copy and the
    prefill, until the logits and the cache are ready), one request in a one-row cache:

    * uncached: a fresh ``PrefixCache`` (``--interval``), so the whole P + M prompt is prefilled, saving a
      checkpoint at every interval boundary (the KDA states in pool slots, the MLA pages kept);
    * cached: the same prompt again after ``finish``: the lookup hits the longest boundary below P + M (P when P
      is a multiple of the interval and M >= 1), its KDA states are copied into the row's slot and only the
      remaining tokens are prefilled. A prompt with another suffix after the same prefix would hit the same
      entry: a boundary's key covers the tokens before it only.

    Both paths reuse the one cache and fresh host pools per repetition, so every repetition has the same shapes;
    the first one is the warm-up (it compiles) and is not timed. Reported: the medians over ``--reps``, the
    tokens skipped, the speed-up, and max |cached - uncached| over the final token's logits (absolute and over
    the largest |uncached logit|). In bf16 the two paths round differently (and a random router's near-tie may
    flip an expert, see sharded_block.py); ``--dtype float32`` makes the check tight.
(b) The cost of saving checkpoints: ``ModelStep.prefill`` of the P-token prefix with a checkpoint every
    ``--interval`` tokens against the same prefill without, each run once untimed and then ``--reps`` times,
    alternating; the overhead is the difference of the medians over the median without.
(c) ``k3jax.prefix_cache.memory_report`` at that interval: bytes per checkpoint and per cached token for this
    block and for the whole ``kimi_k3`` preset (its state dtype, and a bf16 state pool).

Times are wall clock (``time.perf_counter`` around the call and ``jax.block_until_ready``), compile excluded.
Without ``--experts`` on a GPU, ``fit_experts`` sizes the experts for the uncached P + M prefill (the largest
program here). One JSON object per run (``--json``, appended as a line) with the keys ``ROW_KEYS``. On GPU the
environment is set up as ``sharded_block.main`` does before JAX starts.

Usage::

  PYTHONPATH=. python3 benchmarks/prefix_cache.py --json prefix_cache.jsonl     # 32K + 1K, interval 2048
  PYTHONPATH=. python3 benchmarks/prefix_cache.py --interval 1024 --reps 3 --experts 64
  PYTHONPATH=. python3 benchmarks/prefix_cache.py --tiny --dtype float32   # tiny preset, 1 CPU device, seconds
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import k3jax
from benchmarks import long_prompt, sharded_block
from benchmarks.sharded_block import log
from k3jax import dcp, demo, serving, steps
from k3jax.cache import Checkpoints, SlotAllocator
from k3jax.prefix_cache import MemoryReport, PagePool, PrefixCache, memory_report

GIB = 2 ** 30
MEMORY_KEYS = ("interval", "recurrent_bytes", "conv_bytes", "checkpoint_bytes", "page_bytes_per_token",
               "checkpoint_bytes_per_token", "bytes_per_cached_token")
ROW_KEYS = ("command", "device", "platform", "jax_version", "impl", "dtype", "experts", "layer_types",
            "hidden_size", "params_gib", "prefix_len", "new_len", "prompt_len", "interval", "reps",
            # (a) time to first token
            "cached_tokens", "uncached_prefill_tokens", "cached_prefill_tokens", "checkpoints_saved",
            "uncached_ms", "cached_ms", "uncached_ms_reps", "cached_ms_reps", "speedup",
            "logits_max_abs_diff", "logits_max_rel_diff",
            # (b) checkpoint cost
            "ckpt_prompt_len", "ckpt_count", "prefill_ms", "prefill_ckpt_ms", "prefill_ms_reps",
            "prefill_ckpt_ms_reps", "ckpt_overhead_pct",
            # (c) memory: dicts with MEMORY_KEYS
            "memory_block", "memory_kimi_k3", "memory_kimi_k3_bf16_state",
            "peak_gib")


def timed_ms(fn, *args):
  """``(fn(*args), milliseconds)``, waiting for every array of the result."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, (time.perf_counter() - t0) * 1e3


def max_diffs(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
  """``(max |got - want|, that over max |want|)`` in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  diff = float(np.max(np.abs(got - want)))
  return diff, diff / float(np.max(np.abs(want)))


def memory_dict(report: MemoryReport) -> dict:
  """A ``MemoryReport``'s fields and derived numbers (``MEMORY_KEYS``) as a JSON-able dict."""
  return {key: getattr(report, key) for key in MEMORY_KEYS}


def time_to_first_token(step: steps.ModelStep, cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, prompt: np.ndarray,
                        args: argparse.Namespace) -> dict:
  """Part (a) (module docstring): uncached and cached ``serving.admit`` of ``prompt``; the JSON row's numbers.

  One row, ``max_new_tokens`` 0 (the first token's logits come from the prefill: no decode room needed). The
  pools have room for the row and every boundary's entry at once and then some, so no admit evicts an entry
  (eviction is host work a busy server would add to either path alike).
  """
  n, L = step.num_devices, len(prompt)
  num_pages = 2 * dcp.pages_per_device(L, n)
  num_slots = L // args.interval + 2
  cache = steps.init_mesh_cache(cfg, 1, L, mesh, num_slots=num_slots, num_pages=num_pages, idle=True)
  request = [serving.Request(row=0, tokens=prompt, max_new_tokens=0)]
  uncached, cached = [], []
  try:
    for rep in range(args.reps + 1):  # rep 0: the warm-up
      pc = PrefixCache(args.interval, slots=SlotAllocator(num_slots), pages=PagePool(num_pages), devices=n)
      (logits_u, cache, (a,)), ms_u = timed_ms(serving.admit, step, cache, pc, request)
      cache = jax.block_until_ready(serving.finish(cache, pc, a))
      (logits_c, cache, (b,)), ms_c = timed_ms(serving.admit, step, cache, pc, request)
      cache = jax.block_until_ready(serving.finish(cache, pc, b))
      if rep:
        uncached.append(ms_u)
        cached.append(ms_c)
      log(f"admit {'warm-up (compiles)' if not rep else f'rep {rep}/{args.reps}'}: uncached {ms_u:,.1f} ms "
           f"({L} tokens prefilled, {len(a.new_boundaries)} checkpoints saved), cached {ms_c:,.1f} ms "
           f"({b.cached_tokens} tokens from the cache, {L - b.cached_tokens} prefilled)")
  finally:
    long_prompt.free(cache)
  abs_diff, rel_diff = max_diffs(np.asarray(logits_c)[0], np.asarray(logits_u)[0])
  ms_u, ms_c = float(np.median(uncached)), float(np.median(cached))
  return dict(cached_tokens=b.cached_tokens, uncached_prefill_tokens=L, cached_prefill_tokens=L - b.cached_tokens,
              checkpoints_saved=len(a.new_boundaries), uncached_ms=ms_u, cached_ms=ms_c, uncached_ms_reps=uncached,
              cached_ms_reps=cached, speedup=ms_u / ms_c, logits_max_abs_diff=abs_diff, logits_max_rel_diff=rel_diff)


def checkpoint_cost(step: steps.ModelStep, cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, prompt: np.ndarray,
                    args: argparse.Namespace) -> dict:
  """Part (b): ``step.prefill`` of ``prompt`` with a checkpoint every ``args.interval`` tokens vs without."""
  L = len(prompt)
  offsets = list(range(args.interval, L + 1, args.interval))
  # Row 0 owns slot 0; the checkpoints go to slots 1, 2, ... (never a sequence's slot).
  cache = steps.init_mesh_cache(cfg, 1, L, mesh, num_slots=1 + len(offsets))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
  tokens, cu = put(prompt), put(np.asarray([0, L], np.int32))
  variants = {"prefill_ms": None,
              "prefill_ckpt_ms": Checkpoints.from_lists([[(o, 1 + i) for i, o in enumerate(offsets)]])}
  times = {name: [] for name in variants}
  try:
    for rep in range(args.reps + 1):  # rep 0: the warm-up
      ms = {}
      for name, ckpt in variants.items():
        # seq_lens 0 restarts the sequence (its state and latent rows are overwritten); a new array each time,
        # as the cache is donated.
        cache = cache.replace(seq_lens=put(np.zeros(1, np.int32)))
        (_, cache), ms[name] = timed_ms(lambda c: step.prefill(tokens, cu, c, last_only=True, checkpoints=ckpt),
                                        cache)
        if rep:
          times[name].append(ms[name])
      log(f"prefill {'warm-up (compiles)' if not rep else f'rep {rep}/{args.reps}'} of {L} tokens: "
           f"{ms['prefill_ms']:,.1f} ms without, {ms['prefill_ckpt_ms']:,.1f} ms with {len(offsets)} checkpoints")
  finally:
    long_prompt.free(cache)
  med = {name: float(np.median(t)) for name, t in times.items()}
  return dict(ckpt_prompt_len=L, ckpt_count=len(offsets), **med, prefill_ms_reps=times["prefill_ms"],
              prefill_ckpt_ms_reps=times["prefill_ckpt_ms"],
              ckpt_overhead_pct=(med["prefill_ckpt_ms"] / med["prefill_ms"] - 1) * 100)


def memory(cfg: k3jax.K3Config, interval: int) -> dict:
  """Part (c): ``memory_report`` of the block and of the whole ``kimi_k3`` preset (f32 and bf16 state)."""
  k3 = k3jax.preset("kimi_k3")
  return dict(memory_block=memory_dict(memory_report(cfg, interval)),
              memory_kimi_k3=memory_dict(memory_report(k3, interval)),
              memory_kimi_k3_bf16_state=memory_dict(memory_report(k3, interval, state_dtype=jnp.bfloat16)))


def print_summary(row: dict) -> None:
  print(f"\n(a) time to first token, {row['prefix_len']} shared + {row['new_len']} new tokens, interval "
        f"{row['interval']} (median of {row['reps']}):", flush=True)
  print(f"  uncached: {row['uncached_ms']:10,.1f} ms  ({row['uncached_prefill_tokens']} tokens prefilled, "
        f"{row['checkpoints_saved']} checkpoints saved)")
  print(f"  cached:   {row['cached_ms']:10,.1f} ms  ({row['cached_tokens']} tokens skipped, "
        f"{row['cached_prefill_tokens']} prefilled after the checkpoint copy)")
  print(f"  speed-up {row['speedup']:.2f}x; final-token logits cached vs uncached: max |diff| "
        f"{row['logits_max_abs_diff']:.3e} ({row['logits_max_rel_diff']:.2e} of the largest logit)")
  print(f"(b) prefill of {row['ckpt_prompt_len']} tokens: {row['prefill_ms']:,.1f} ms without, "
        f"{row['prefill_ckpt_ms']:,.1f} ms with {row['ckpt_count']} checkpoints: overhead "
        f"{row['ckpt_overhead_pct']:+.2f}%")
  print(f"(c) memory per cached token at interval {row['interval']} (KDA checkpoints + MLA pages):")
  for key, label in (("memory_block", "this block"), ("memory_kimi_k3", "kimi_k3"),
                     ("memory_kimi_k3_bf16_state", "kimi_k3, bf16 state")):
    m = row[key]
    print(f"  {label:20s} {m['checkpoint_bytes'] / 2 ** 20:10,.1f} MiB per checkpoint; per cached token "
          f"{m['checkpoint_bytes_per_token'] / 1024:8,.1f} KiB + {m['page_bytes_per_token'] / 1024:6,.1f} KiB = "
          f"{m['bytes_per_cached_token'] / 1024:8,.1f} KiB")
  if row["peak_gib"] is not None:
    print(f"peak {row['peak_gib']:.2f} GiB per device (params {row['params_gib']:.2f} GiB)", flush=True)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="benchmarks/prefix_cache.py", description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--tiny", action="store_true", help="the tiny preset on 1 CPU device: prefix 256 + 64 new, interval 64")
  add("--prefix-len", type=int, default=None, help="shared prefix tokens P (default 32768; tiny 256)")
  add("--new-len", type=int, default=None, help="tokens after the prefix M (default 1024; tiny 64)")
  add("--interval", type=int, default=None, help="tokens between checkpoints (default 2048; tiny 64)")
  add("--reps", type=int, default=None, help="timed repetitions of each path (median; default 5, tiny 2)")
  long_prompt.add_block_options(parser, experts="the most that fit the uncached prefill")
  add("--json", help="append one JSON line with every number to this file")
  return parser


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
  defaults = (dict(prefix_len=256, new_len=64, interval=64, reps=2) if args.tiny else
              dict(prefix_len=32768, new_len=1024, interval=2048, reps=5))
  for field, value in defaults.items():
    if getattr(args, field) is None:
      setattr(args, field, value)
  args.devices = 1  # sharded_block.mesh_and_options: a one-device mesh
  if args.interval < 64 or args.interval % 64:
    raise ValueError(f"--interval must be a positive multiple of 64 (the page and KDA chunk), got {args.interval}")
  if args.prefix_len < args.interval:
    raise ValueError(f"--prefix-len must be >= --interval {args.interval} (else nothing is cached), got "
                     f"{args.prefix_len}")
  if args.new_len < 1 or args.reps < 1:
    raise ValueError(f"--new-len and --reps must be >= 1, got {args.new_len} and {args.reps}")
  if args.dtype == "float32" and args.impl not in (None, "xla"):
    raise NotImplementedError(f"--dtype float32 runs --impl xla only, got --impl {args.impl}")
  return args


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _resolve(_parser().parse_args(argv))
  args.command = shlex.join(["python3", "benchmarks/prefix_cache.py", *argv])
  return sharded_block.run_main(args, _main)


def _main(args: argparse.Namespace) -> int:
  mesh, options = sharded_block.mesh_and_options(args)
  device = mesh.devices.flat[0]
  cfg = sharded_block.block_config(args)
  L = args.prefix_len + args.new_len
  if args.experts is None and not args.tiny and device.memory_stats():
    sizes = argparse.Namespace(seqs=1, prefill_batch=1, prompt_len=L, context=L, decode_steps=1, last_only=True)
    args.experts = sharded_block.fit_experts(cfg, mesh, sizes, device.memory_stats()["bytes_limit"], options)
    cfg = cfg.replace(num_experts=args.experts)
  args.experts = cfg.num_experts
  print(f"command: {args.command}", flush=True)
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
  log(f"prefix cache: {'tiny' if args.tiny else 'Kimi-K3'} layers {'+'.join(cfg.layer_types)} (both MoE), hidden "
       f"{cfg.hidden_size}, KDA {cfg.kda_num_heads}x{cfg.kda_head_dim}, MLA {cfg.num_attention_heads} heads, "
       f"experts {cfg.num_experts} (top-{cfg.num_experts_per_token}), vocab {cfg.vocab_size}, {cfg.dtype.name}, "
       f"impl={cfg.impl}; prompt {args.prefix_len} + {args.new_len} tokens, interval {args.interval}, "
       f"{args.reps} reps")
  model, _, step = sharded_block.init_step(cfg, mesh, args.seed, options)
  prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, L, dtype=np.int32)
  row = dict.fromkeys(ROW_KEYS)
  row.update(command=args.command, device=device.device_kind, platform=device.platform,
             jax_version=jax.__version__, impl=cfg.impl, dtype=args.dtype, experts=cfg.num_experts,
             layer_types=list(cfg.layer_types), hidden_size=cfg.hidden_size,
             params_gib=demo.bytes_per_device(step.state) / GIB, prefix_len=args.prefix_len, new_len=args.new_len,
             prompt_len=L, interval=args.interval, reps=args.reps)
  row.update(time_to_first_token(step, model.cfg, mesh, prompt, args))
  row.update(checkpoint_cost(step, model.cfg, mesh, prompt[:args.prefix_len], args))
  row.update(memory(model.cfg, args.interval))
  row["peak_gib"] = long_prompt.peak_gib(mesh)
  print_summary(row)
  if args.json:
    with open(args.json, "a") as f:
      f.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

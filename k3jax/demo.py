"""`make demo`: the tiny Kimi-K3 model on one device, then sharded over every device, compared.

Both runs do a packed prefill of a few prompts and 16 greedy decode steps through
``k3jax.sharding.jit_model_step``: on one device the plain ops, on N devices the sharded layout (heads split,
the MLA latent cache split along tokens, expert-parallel MoE). The sharded run decodes the tokens the
unsharded run chose, so their logits compare one for one. On a machine without GPUs JAX gets 9 CPU devices:
none of the tiny model's split dims divides by 9 (as K3's 96 heads do not), so the padding is part of the run.

Checks (exit status 1 if one fails): the decode logits equal a prefill of the same tokens, and the sharded
logits equal the unsharded ones. A table reports devices, mesh, padding, tokens/s, the largest logit
difference and the bytes of parameters and cache per device.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import k3jax
from k3jax import sharding

CPU_DEVICES = 9
PROMPT_LENS = (5, 9, 3)
DECODE_STEPS = 16
# Relative to the largest logit. bf16 activations: prefill (chunked KDA, non-absorbed MLA) and decode
# (recurrent KDA, absorbed MLA) round differently (~1e-2 relative here); a wrong cache, mask or position
# gives errors of the order of the logits themselves.
TOLERANCE = 0.05
# Relative to the largest logit. The sharded run computes the same ops in other reduction orders (row-
# parallel all-reduces, the DCP merge of per-device partials, expert-parallel partial sums); rounded to bf16
# activations (2^-8 relative) over 6 layers that gives ~1% (0.7% measured on 9 CPU devices). A token on the
# wrong device, a missing partial or a selected dummy expert changes logits by their own size. A token whose
# router scores tie to within bf16 rounding may pick another expert and fail the check: it is not hidden.
SHARD_TOLERANCE = 0.02


def request_cpu_devices(n: int) -> None:
  """Asks JAX for ``n`` CPU devices, unless the user chose a count (``JAX_NUM_CPU_DEVICES``, ``XLA_FLAGS``).

  This shapes the CPU client only: on a GPU machine ``jax.devices()`` still lists every GPU. It must run
  before JAX starts its backends; when they have started already, the devices stay as they are.
  """
  chosen = jax.config.jax_num_cpu_devices >= 0 or "xla_force_host_platform_device_count" in os.environ.get(
      "XLA_FLAGS", "")
  if not chosen:
    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already running (the demo called from a live program): keep them
      pass


@dataclasses.dataclass
class Run:
  """One prefill + decode run.

  Attributes:
    mesh: the mesh it ran on. plan: its ``sharding.PaddingPlan``. cfg: the (padded) config it ran.
    step: the jitted ``sharding.ModelStep``.
    logits: f32 prefill logits ``[T, vocab]`` then one ``[N, vocab]`` per decode step.
    fed: ``[N, DECODE_STEPS]`` int32 token fed to each decode step.
    greedy: ``[N, DECODE_STEPS]`` int32 argmax of the logits before each decode step (what it would feed).
    prefill_s, decode_s: seconds of the timed prefill and the median decode step.
    compile_s: seconds of the first prefill and the first decode step (compile and run).
    bytes_per_device: bytes of parameters and cache on the first device.
  """

  mesh: jax.sharding.Mesh
  plan: sharding.PaddingPlan
  cfg: k3jax.K3Config
  step: sharding.ModelStep
  logits: list[np.ndarray]
  fed: np.ndarray
  greedy: np.ndarray
  prefill_s: float
  decode_s: float
  compile_s: float
  bytes_per_device: int


def timed(fn: Callable, *args) -> tuple:
  """``(fn(*args), seconds)``, waiting for the result."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def packed_cu_seqlens(lens: list[int]) -> jax.Array:
  """``cu_seqlens [N + 1]`` int32 of sequences of these lengths packed back to back."""
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def _progress(label: str, done: int, total: int, note: str) -> None:
  """A progress bar on stderr, redrawn in place on a terminal; elsewhere (a log) only its final state."""
  tty = sys.stderr.isatty()
  if not tty and done < total:
    return
  filled = 24 * done // total
  start, end = ("\r" if tty else ""), ("\n" if done == total else "")
  sys.stdout.flush()
  sys.stderr.write(f"{start}{label:>10} [{'#' * filled}{'.' * (24 - filled)}] {done}/{total} {note:<20}{end}")
  sys.stderr.flush()


def bytes_per_device(*trees) -> int:
  """Bytes that the arrays in ``trees`` occupy on their first device (their shard there, or the whole array)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(trees))


def generate(model: k3jax.KimiK3Model, mesh: jax.sharding.Mesh, prompts: list[np.ndarray],
             feed: np.ndarray | None = None) -> Run:
  """Places ``model`` on ``mesh``, prefills ``prompts`` and runs ``DECODE_STEPS`` decode steps.

  Args:
    model: the unpadded model. mesh: a ``sharding.make_mesh`` mesh (one device: the plain ops).
    prompts: N int32 token arrays.
    feed: ``[N, DECODE_STEPS]`` tokens to decode; None decodes greedily.
  """
  cfg, n = model.cfg, len(prompts)
  label = f"{sharding.mesh_size(mesh)} device" + ("s" if sharding.mesh_size(mesh) > 1 else "")
  placed, plan = sharding.shard_model(model, mesh)
  step = sharding.jit_model_step(placed, mesh, vocab_size=cfg.vocab_size)
  fresh = lambda: sharding.init_cache(placed.cfg, n, max(PROMPT_LENS) + DECODE_STEPS, mesh)
  tokens, cu = jnp.asarray(np.concatenate(prompts)), packed_cu_seqlens([len(p) for p in prompts])
  total = DECODE_STEPS + 2
  t_start = time.perf_counter()
  # The first call compiles; the second, on a fresh cache, is timed. The first decode step compiles too.
  _progress(label, 0, total, "compiling prefill")
  _, compile_s = timed(step.prefill, tokens, cu, fresh())
  _progress(label, 1, total, "prefill")
  (logits, cache), prefill_s = timed(step.prefill, tokens, cu, fresh())
  _progress(label, 2, total, "compiling decode")
  logits = np.asarray(logits)
  out, fed, greedy, times = [logits], [], [], []
  choice = logits[np.asarray(cu[1:]) - 1].argmax(-1).astype(np.int32)
  for s in range(DECODE_STEPS):
    greedy.append(choice)
    fed.append(choice if feed is None else feed[:, s])
    (logits, cache), dt = timed(step.decode, jnp.asarray(fed[-1]), cache)
    out.append(np.asarray(logits))
    times.append(dt)
    compile_s += dt if s == 0 else 0.0
    choice = out[-1].argmax(-1).astype(np.int32)
    last = 3 + s == total
    _progress(label, 3 + s, total, f"done in {time.perf_counter() - t_start:.0f} s" if last else "decode")
  return Run(mesh=mesh, plan=plan, cfg=placed.cfg, step=step, logits=out, fed=np.stack(fed, 1),
             greedy=np.stack(greedy, 1), prefill_s=prefill_s, decode_s=float(np.median(times[1:])),
             compile_s=compile_s, bytes_per_device=bytes_per_device(step.state, cache))


def consistency(run: Run, prompts: list[np.ndarray]) -> tuple[float, float]:
  """Max |decode - prefill| logit and max |logit| of a prefill of each prompt and its decoded tokens.

  Row ``p`` of that prefill must equal the logits of the decode step that consumed token ``p``.
  """
  n = len(prompts)
  full = [np.concatenate([prompts[i], run.fed[i]]) for i in range(n)]
  lens = [len(f) for f in full]
  cache = sharding.init_cache(run.cfg, n, max(lens), run.mesh)
  logits, _ = run.step.prefill(jnp.asarray(np.concatenate(full)), packed_cu_seqlens(lens), cache)
  logits = np.asarray(logits)
  starts = np.concatenate([[0], np.cumsum(lens)])
  diff = max(np.abs(logits[starts[i] + len(prompts[i]) + s] - run.logits[1 + s][i]).max()
             for i in range(n) for s in range(DECODE_STEPS))
  return float(diff), float(np.abs(logits).max())


def fmt_padding(plan: sharding.PaddingPlan) -> str:
  """The padding a plan applies, e.g. ``"num_attention_heads 4->9, ..."`` (``"none"``)."""
  return ", ".join(f"{field} {r}->{p}" for field, (r, p) in plan.applied.items()) or "none"


def _print_table(single: Run, sharded: Run, diff: str, agree: str) -> None:
  """The comparison table: one column per run."""
  runs = (single, sharded)
  platform = sharded.mesh.devices.flat[0].platform
  rows = [
      ("devices", *(f"{sharding.mesh_size(r.mesh)} {platform}" for r in runs)),
      ("mesh", *(", ".join(f"{k}={v}" for k, v in r.mesh.shape.items()) for r in runs)),
      ("padding applied", *(fmt_padding(r.plan) for r in runs)),
      ("prefill tokens/s", *(f"{sum(PROMPT_LENS) / r.prefill_s:,.0f}" for r in runs)),
      ("decode tokens/s", *(f"{len(PROMPT_LENS) / r.decode_s:,.0f}" for r in runs)),
      ("first prefill + decode", *(f"{r.compile_s:.1f} s (compile)" for r in runs)),
      ("max |logit - unsharded|", "(reference)", diff),
      ("greedy tokens as unsharded", "(reference)", agree),
      ("params + cache per device", *(f"{r.bytes_per_device / 2 ** 20:.2f} MiB" for r in runs)),
  ]
  print(f"\n{'':<28}{'unsharded':<20}sharded")
  for name, a, b in rows:
    print(f"{name:<28}{a:<20}{b}")
  if platform == "cpu":
    print("(the CPU devices share the host's cores: sharded tokens/s show the overheads, not a speed-up)")


def main(argv: list[str] | None = None) -> int:
  """Runs the demo; returns the exit status (1 when a check fails)."""
  parser = argparse.ArgumentParser(prog="python -m k3jax.demo", description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=None, help="devices to shard over (default: all)")
  args = parser.parse_args(argv)
  request_cpu_devices(CPU_DEVICES)
  # K = 64: the Mosaic GPU KDA kernels take K in {64, 128}, so the same demo runs them on a Hopper GPU.
  # f32 MLA partials: a sharded decode then rounds its merged attention output to bf16 once, as one device
  # does (bf16 partials are rounded on every device first).
  cfg = k3jax.preset("tiny", kda_head_dim=64, partial_dtype=jnp.float32)
  model = k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(0))
  n = len(PROMPT_LENS)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, length).astype(np.int32) for length in PROMPT_LENS]
  print(f"k3jax demo: tiny Kimi-K3, {cfg.num_hidden_layers} layers ({' '.join(cfg.layer_types)}), "
        f"impl={cfg.impl}, dtype={cfg.dtype.name}, state {cfg.state_dtype.name}, "
        f"partials {cfg.partial_dtype.name}, {len(jax.devices())} {jax.devices()[0].platform} devices")
  print(f"{n} prompts ({sum(PROMPT_LENS)} packed tokens) and {DECODE_STEPS} greedy decode steps each:")

  single = generate(model, sharding.make_mesh(1), prompts)
  for i in range(n):
    print(f"  sequence {i}: prompt {prompts[i].tolist()} -> {single.fed[i].tolist()}")
  diff, scale = consistency(single, prompts)
  consistent = bool(np.isfinite(diff) and diff <= TOLERANCE * scale)
  print(f"consistency: max |decode - prefill| logit = {diff:.4f} over {n * DECODE_STEPS} tokens, "
        f"{diff / scale:.2%} of max |logit| {scale:.2f} (tolerance {TOLERANCE:.0%}): "
        f"{'OK' if consistent else 'FAILED'}")

  sharded = generate(model, sharding.make_mesh(args.devices), prompts, feed=single.fed)
  shard_diff = max(float(np.abs(a - b).max()) for a, b in zip(sharded.logits, single.logits))
  shard_ok = bool(np.isfinite(shard_diff) and shard_diff <= SHARD_TOLERANCE * scale)
  agree = int((sharded.greedy == single.greedy).sum())
  _print_table(single, sharded, f"{shard_diff:.4f} ({shard_diff / scale:.2%} of max |logit|)",
               f"{agree}/{sharded.greedy.size}")
  print(f"sharded == unsharded: max |logit difference| {shard_diff:.4f} over {sum(PROMPT_LENS) + n * DECODE_STEPS} "
        f"tokens, {shard_diff / scale:.2%} of max |logit| (tolerance {SHARD_TOLERANCE:.0%}): "
        f"{'OK' if shard_ok else 'FAILED'}")
  return 0 if consistent and shard_ok else 1

if __name__ == "__main__":
  sys.exit(main())

"""`make demo`: the tiny Kimi-K3 model on one device, then sharded over every device, compared.

Both runs do a packed prefill of a few prompts and 16 greedy decode steps through
``k3jax.steps.jit_model_step``: on one device the plain ops, on N devices the sharded layout (heads split,
the MLA latent cache split along tokens, expert-parallel MoE). The sharded run decodes the tokens the
unsharded run chose, so their logits compare one for one. On a machine without GPUs JAX gets 9 CPU devices:
none of the tiny model's split dims divides by 9 (as K3's 96 heads do not), so the padding is part of the run.

Checks (exit status 1 if one fails): the decode logits equal a prefill of the same tokens, token by token
(in float32 with full-precision matmuls, and in the model's bf16 with its kernels, where a token at or
after a routing flip in its sequence is named and excused), and the sharded logits equal the unsharded
ones (skipped on one device). A table reports devices, mesh, padding, tokens/s, the largest logit
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
from k3jax import padding, progress, sharding, steps

CPU_DEVICES = 9
PROMPT_LENS = (5, 9, 3)
DECODE_STEPS = 16
# Relative to the largest logit, per decoded token. Prefill (chunked KDA, non-absorbed MLA) and decode
# (recurrent KDA, absorbed MLA) compute the same function in other orders. In float32 with full-precision
# matmuls (impl="xla") they agree to float32 rounding accumulated over the layers; a wrong cache, mask or
# position gives errors of the order of the logits themselves.
F32_TOLERANCE = 1e-3
# The same in bf16 activations with the model's kernels: both forms round to bf16 at different points
# (~1e-2 relative). A token whose router scores tie to within that rounding may choose other experts in
# decode than in prefill (top-2 of 8 in the tiny model): its logits then differ by more, and the check
# excuses it only when the recorded experts really differ, naming the token.
TOLERANCE = 0.05
# Relative to the largest logit. The sharded run computes the same ops in other reduction orders (row-
# parallel all-reduces, the DCP merge of per-device partials, expert-parallel partial sums); rounded to bf16
# activations (2^-8 relative) over 6 layers that gives about 1%. A token on the wrong device, a missing
# partial or a selected dummy expert changes logits by their own size. A token whose router scores tie to
# within bf16 rounding may pick another expert and fail the check: it is not hidden.
SHARD_TOLERANCE = 0.02
# The fields the float32 consistency run sets to float32.
FLOAT32_FIELDS = ("dtype", "param_dtype", "state_dtype", "partial_dtype", "cache_dtype", "conv_dtype")


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
    mesh: the mesh it ran on. plan: its ``padding.PaddingPlan``. cfg: the (padded) config it ran.
    step: the jitted ``steps.ModelStep``.
    logits: f32 prefill logits ``[T, vocab]`` then one ``[N, vocab]`` per decode step.
    fed: ``[N, DECODE_STEPS]`` int32 token fed to each decode step.
    greedy: ``[N, DECODE_STEPS]`` int32 argmax of the logits before each decode step (what it would feed).
    prefill_s, decode_s: seconds of the timed prefill and the median decode step.
    compile_s: seconds of the first prefill and the first decode step (compile and run).
    bytes_per_device: bytes of parameters and cache on the first device.
  """

  mesh: jax.sharding.Mesh
  plan: padding.PaddingPlan
  cfg: k3jax.K3Config
  step: steps.ModelStep
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
  step = steps.jit_model_step(placed, mesh, vocab_size=cfg.vocab_size)
  fresh = lambda: steps.init_mesh_cache(placed.cfg, n, max(PROMPT_LENS) + DECODE_STEPS, mesh)
  tokens, cu = jnp.asarray(np.concatenate(prompts)), packed_cu_seqlens([len(p) for p in prompts])
  # The first call compiles; the second, on a fresh cache, is timed. The first decode step compiles too.
  with progress.bar(label, DECODE_STEPS + 2, unit="step", postfix="compiling prefill") as bar:
    _, compile_s = timed(step.prefill, tokens, cu, fresh())
    bar.set_postfix_str("prefill", refresh=False)
    bar.update()
    (logits, cache), prefill_s = timed(step.prefill, tokens, cu, fresh())
    bar.set_postfix_str("compiling decode", refresh=False)
    bar.update()
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
      bar.set_postfix_str("done" if s == DECODE_STEPS - 1 else "decode", refresh=False)
      bar.update()
  return Run(mesh=mesh, plan=plan, cfg=placed.cfg, step=step, logits=out, fed=np.stack(fed, 1),
             greedy=np.stack(greedy, 1), prefill_s=prefill_s, decode_s=float(np.median(times[1:])),
             compile_s=compile_s, bytes_per_device=bytes_per_device(step.state, cache))


@dataclasses.dataclass
class Consistency:
  """Decode vs prefill of the same tokens, per decoded token (``consistency``).

  Attributes:
    diff: ``[N, DECODE_STEPS]`` max |decode logit - prefill logit| of each decoded token.
    scale: max |logit| of the prefill (the tolerances are relative to it).
    flipped: ``[N, DECODE_STEPS]`` bool, True where some MoE layer chose other experts for that token in
      decode than in prefill (a routing flip).
    prompt_flipped: ``[N]`` bool, True where a prompt token chose other experts in the prefill of the prompts
      alone (whose cache the decode continues) than in the prefill of prompt + decoded tokens.
  """

  diff: np.ndarray
  scale: float
  flipped: np.ndarray
  prompt_flipped: np.ndarray


def _routing_step(model: k3jax.KimiK3Model, method: str) -> Callable:
  """Jitted ``model.<method>`` (one device) that also returns each MoE layer's chosen experts.

  The experts come from ``nnx.capture`` of the routers' outputs: ``[L_moe, rows, k]`` int32, sorted per row
  (the order of the top-k does not matter). The cache is donated like ``k3jax.prefill``/``decode``'s.
  """
  graphdef, state = nnx.split(model)

  def run(state, *args):
    out, found = nnx.capture(getattr(nnx.merge(graphdef, state), method), nnx.Intermediate,
                             method_outputs=nnx.Intermediate)(*args)
    experts = [value.get_value()[0][0] for path, value in nnx.to_flat_state(found)
               if path[-3:] == ("block_sparse_moe", "gate", "__call__")]
    return out, jnp.sort(jnp.stack(experts), axis=-1)

  step = jax.jit(run, donate_argnums={"prefill": 3, "decode": 2}[method])  # the cache
  return lambda *args: step(state, *args)


def consistency(model: k3jax.KimiK3Model, prompts: list[np.ndarray], fed: np.ndarray) -> Consistency:
  """Decodes ``fed`` after a prefill of ``prompts``, then prefills prompt + fed at once, and compares.

  Row ``p`` of the second prefill must equal the logits of the decode step that consumed token ``p``. Runs
  on one device with ``model.cfg.impl``; records each MoE layer's experts for both forms.
  """
  n, steps = len(prompts), fed.shape[1]
  prefill, decode = _routing_step(model, "prefill"), _routing_step(model, "decode")
  capacity = max(len(p) for p in prompts) + steps
  (_, cache), prompt_experts = prefill(jnp.asarray(np.concatenate(prompts)),
                                      packed_cu_seqlens([len(p) for p in prompts]),
                                      k3jax.init_cache(model.cfg, n, capacity))
  prompt_experts = np.asarray(prompt_experts)
  decoded, decode_experts = [], []
  for s in range(steps):
    (logits, cache), experts = decode(jnp.asarray(fed[:, s]), cache)
    decoded.append(np.asarray(logits))
    decode_experts.append(np.asarray(experts))
  full = [np.concatenate([prompts[i], fed[i]]) for i in range(n)]
  lens = [len(f) for f in full]
  (logits, _), experts = prefill(jnp.asarray(np.concatenate(full)), packed_cu_seqlens(lens),
                                 k3jax.init_cache(model.cfg, n, capacity))
  logits, experts = np.asarray(logits), np.asarray(experts)
  starts = np.concatenate([[0], np.cumsum(lens)])
  rows = np.asarray([[starts[i] + len(prompts[i]) + s for s in range(steps)] for i in range(n)])
  diff = np.stack([np.abs(logits[rows[:, s]] - decoded[s]).max(-1) for s in range(steps)], 1)
  flipped = np.stack([(experts[:, rows[:, s]] != decode_experts[s]).any(axis=(0, 2)) for s in range(steps)], 1)
  prompt_starts = np.concatenate([[0], np.cumsum([len(p) for p in prompts])])
  prompt_flipped = np.asarray([
      (prompt_experts[:, prompt_starts[i]:prompt_starts[i + 1]]
       != experts[:, starts[i]:starts[i] + len(prompts[i])]).any() for i in range(n)])
  return Consistency(diff=diff, scale=float(np.abs(logits).max()), flipped=flipped, prompt_flipped=prompt_flipped)


def report_consistency(label: str, c: Consistency, tolerance: float, flips_allowed: bool) -> bool:
  """Prints the per-token agreement of ``c``; True when every token is within ``tolerance * c.scale``.

  With ``flips_allowed`` a token over the tolerance passes when its sequence's routing flipped at that token
  or before it (a prompt token or an earlier decoded one): from the first flip on, the two forms compute
  with different experts, and the flipped token's hidden state reaches every later token of its sequence
  through the KDA state and the latent cache. Such tokens are named; a NaN never passes.
  """
  over = ~(c.diff <= tolerance * c.scale)
  after_flip = c.prompt_flipped[:, None] | np.logical_or.accumulate(c.flipped, axis=1)
  excused = over & after_flip & np.isfinite(c.diff) if flips_allowed else np.zeros_like(over)
  failed = over & ~excused
  ok = not failed.any()
  worst = float(np.nanmax(c.diff)) if np.isfinite(c.diff).any() else float("nan")
  within = c.diff[~over]
  print(f"consistency ({label}): {int((~over).sum())}/{over.size} decoded tokens within {tolerance:.1%} of max "
        f"|logit| {c.scale:.2f} (largest of them {float(within.max(initial=0.0)) / c.scale:.1e}); "
        f"worst {worst:.4f}; routing flips at {int(c.flipped.sum())} decoded tokens and in "
        f"{int(c.prompt_flipped.sum())} prompts; {int((~after_flip).sum())} tokens before any flip: "
        f"{'OK' if ok else 'FAILED'}")
  for i, s in zip(*np.nonzero(over)):
    why = ("MISMATCH" if failed[i, s] else "routing flip at this token" if c.flipped[i, s] else
           "after a routing flip earlier in its sequence")
    print(f"  sequence {i}, decode step {s}: |decode - prefill| {c.diff[i, s]:.4f} ({c.diff[i, s] / c.scale:.2%}): "
          f"{why}")
  return ok


def fmt_padding(plan: padding.PaddingPlan) -> str:
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
  exact = dataclasses.replace(cfg, impl="xla", **{f: jnp.float32 for f in FLOAT32_FIELDS})
  with jax.default_matmul_precision("highest"):
    consistent = report_consistency(
        "float32, impl=xla", consistency(k3jax.KimiK3Model(exact, rngs=nnx.Rngs(0)), prompts, single.fed),
        F32_TOLERANCE, flips_allowed=False)
  bf16 = consistency(model, prompts, single.fed)
  consistent &= report_consistency(f"{cfg.dtype.name}, impl={cfg.impl}", bf16, TOLERANCE, flips_allowed=True)
  scale = bf16.scale

  mesh = sharding.make_mesh(args.devices)
  if sharding.mesh_size(mesh) == 1:
    print("one device: no sharded run to compare (a machine without GPUs gives JAX 9 CPU devices)")
    return 0 if consistent else 1
  sharded = generate(model, mesh, prompts, feed=single.fed)
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

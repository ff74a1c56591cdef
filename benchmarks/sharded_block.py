"""The jitted, sharded Kimi-K3 block (one KDA and one MLA layer, both MoE, real K3 widths) on a mesh.

One run = one mesh (all visible devices, or the first ``--devices n``):

(a) prefill of ``--seqs`` N sequences x ``--prompt-len`` L tokens, packed ``--prefill-batch`` sequences per
    call (the other sequences get length 0). The default on K3 sizes is one sequence per call: the MLA prefill
    runs ``jax.nn.dot_product_attention`` (XLA, the whole ``[Hq, T, T]`` score matrix of a call), so packing
    8 x 4096 = 32768 tokens would need 96 x 32768^2 x >= 6 bytes ~ 620 GB;
(b) decode steps at ``--context`` C tokens per sequence. The cache is built directly, not prefilled (a
    prefill of 8 x 32K tokens would cost more than the whole benchmark): random latent rows ``[c | k_pe]``
    ~ N(0, 1) (``c`` is RMS-normalised, ``k_pe`` a projection of a normalised input) written through
    ``k3jax.ops.mesh_write_rows`` (the DCP layout on a mesh), KDA states ~ N(0, 1 / K) (rows of unit norm),
    conv windows ~ N(0, 1), ``seq_lens = C``. The decode reads every cached row, so its cost is that of a
    real 32K context; the logits are not those of any text.

Parameters come from the model's own initialisers, jitted with the parameter shardings as outputs (threefry
is partitionable, so the values do not depend on the mesh), then padded like ``k3jax.padding.pad_model``:
every device count runs the same weights, prompts, cache and decode tokens, and ``--save`` / ``--compare``
check the logits across device counts. ``--compare`` takes the run's sizes (and ``--dtype``) from the reference.

Equality across device counts: ``--dtype bfloat16`` (default; the preset's dtypes, what a server runs) is the
timing mode. Its logits are not a sharp equality check: the sharded run reduces in other orders, bf16
activations turn that into ~1e-3 relative noise, and a random-init router choosing 16 of 32 experts has
near-ties that this noise flips; a token with one flipped expert moves its logits by their own size.
``--dtype float32`` (f32 parameters, activations, caches, states and partials; matmuls at full f32 precision,
``--impl xla``) shrinks the noise to ~1e-6, so flips are ~1000x rarer and the tolerance is tight
(``TOLERANCES``). Besides the pass/fail number (the largest |diff| over all saved logits / the largest
reference logit), ``--compare`` reports per-token numbers (``rel`` = a token row's largest |diff| / its
largest reference logit: median, 99th percentile, max, count above the tolerance): a failure in a few tokens
points to routing flips, one in every token to a bug.

Memory: the routed experts dominate (2 layers x E x 3 x 3584 x 3072 bf16 = 132 MB per expert, twice that in
f32). Without ``--experts`` a GPU run compiles the step for K3's 896 experts without allocating it, reads the
compiled memory analysis (arguments + outputs + temporaries per device) and takes the largest multiple of 16
experts that fits ``bytes_limit``; the table prints the count used.

On GPU the script sets, before JAX starts, ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` (unless set) and, with
``--cudnn-ragged-dot`` (default on), ``--xla_gpu_experimental_use_ragged_dot_fusion=true``: without it XLA
rewrites each expert ``ragged_dot`` into a dense dot over all experts (E times the FLOPs, and a
``[E, T k, De]`` operand).

Usage::

  # equality check: float32 (XLA kernels) on 1 GPU, then on 2 GPUs against it
  PYTHONPATH=. python3 benchmarks/sharded_block.py --dtype float32 --devices 1 --save ref1_f32.npz --json sb.jsonl
  PYTHONPATH=. python3 benchmarks/sharded_block.py --devices 2 --compare ref1_f32.npz --json sb.jsonl
  # timing (and a loose check): bfloat16
  PYTHONPATH=. python3 benchmarks/sharded_block.py --devices 1 --save ref1.npz --json sb.jsonl
  PYTHONPATH=. python3 benchmarks/sharded_block.py --devices 2 --compare ref1.npz --json sb.jsonl
  python benchmarks/sharded_block.py --tiny   # the tiny model on 9 CPU devices, < 1 minute
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import k3jax
from k3jax import demo, ops, padding, sharding, steps
from k3jax.cache import KdaState, ModelCache

# Per --dtype, relative to the reference's largest logit. The sharded run does the same ops in other reduction
# orders (row-parallel all-reduces, the DCP merge of partials, expert-parallel psums). A token on the wrong
# device, a lost partial or a selected dummy expert changes logits by their own size in either dtype.
# bfloat16: rounded to bf16 activations the reorderings move logits by ~1% (the demo measures 0.7% over 6 tiny
# layers). A token whose 16th and 17th router scores lie within that rounding may swap one of its 16 experts;
# 5% was meant to cover that, but K3-width runs with 32 experts on 1 vs 2 GPUs differed by 15% (suspected
# flips): in bf16 the bound is a smoke test, and the per-token numbers tell flips from bugs.
# float32: the reorderings move logits by ~1e-6 relative (2^-24 per rounding, grown over sums of thousands of
# terms and two layers), ~1000x less than bf16, so router near-ties flip ~1000x more rarely. The reference
# stores float16 logits, rounded by up to 2^-11 = 4.9e-4 of each logit: 1e-3 is twice that storage error, far
# above the f32 noise and far below any real error.
TOLERANCES = {"bfloat16": 0.05, "float32": 1e-3}
EXPERT_MULTIPLE = 16  # auto-fitted expert counts divide by 1, 2, 4, 8 and 16 devices: no dummy experts
PREFILL_ROWS = 4  # prefill logit rows saved per sequence (evenly spaced, the last one included)
HOST_INIT_BYTES = 2 * 2 ** 30  # larger models are initialised on the devices (init_model)
MEMORY_MARGIN = 0.03  # of bytes_limit, kept free when fitting the experts (fragmentation, cuDNN workspaces)
GIB = 2 ** 30
RUN_FIELDS = ("tiny", "dtype", "experts", "seqs", "prompt_len", "prefill_batch", "context", "decode_steps", "warmup",
              "seed")
# Config fields set to float32 by --dtype float32: every runtime field but the kernel backend.
F32_FIELDS = tuple(f for f in k3jax.config.RUNTIME_FIELDS if f != "impl")


def log(msg: str) -> None:
  """One progress line with the wall time (the long-running benchmarks of the K3 block share it)."""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def block_config(args: argparse.Namespace) -> k3jax.K3Config:
  """The 2-layer block: layer 0 KDA, layer 1 MLA, both MoE (``first_k_dense_replace=0``), in ``args.dtype``.

  ``bfloat16`` keeps the preset's dtypes (bf16 compute and storage, f32 KDA state); ``float32`` sets every
  dtype field (``F32_FIELDS``) to f32.
  """
  common = dict(num_hidden_layers=2, layer_types=("kda", "mla"), first_k_dense_replace=0, impl=args.impl)
  if args.dtype == "float32":
    common.update(dict.fromkeys(F32_FIELDS, jnp.float32))
  if args.tiny:
    # K = 64: the Mosaic GPU KDA kernels take K in {64, 128}, so --tiny also runs them on a Hopper GPU.
    common["kda_head_dim"] = 64
  if args.experts is not None:
    common["num_experts"] = args.experts
  return k3jax.preset("tiny" if args.tiny else "kimi_k3").replace(**common)


def init_model(cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, seed: int,
               compiler_options: dict | None = None) -> tuple[k3jax.KimiK3Model, padding.PaddingPlan]:
  """``sharding.shard_model(KimiK3Model(cfg, rngs=nnx.Rngs(seed)), mesh)``, without a host copy of large weights.

  Up to ``HOST_INIT_BYTES`` of parameters: exactly that (the initialisers draw on the host). Larger: the
  initialisers run under ``jax.jit`` (``jax.random``, partitionable threefry) with the parameter shardings
  as outputs, each parameter padded by ``padding.pad_param``, so K3's 125 GB never pass through
  the host or one device. Either way the real entries do not depend on the mesh.
  """
  abstract = nnx.eval_shape(lambda: k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(seed)))
  if sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract))) <= HOST_INIT_BYTES:
    return sharding.shard_model(k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(seed)), mesh)
  plan = padding.PaddingPlan.for_config(cfg, sharding.mesh_size(mesh))
  abstract = nnx.eval_shape(lambda: k3jax.KimiK3Model(plan.config(cfg), rngs=nnx.Rngs(seed)))
  graphdef, target = nnx.split(abstract)
  shapes = {path: var.shape for path, var in nnx.to_flat_state(target)}

  def pad(path, var):
    return padding.pad_param(str(path[-1]), var.get_value(), shapes[path])

  init = jax.jit(lambda: nnx.map_state(pad, nnx.state(k3jax.KimiK3Model(cfg, rngs=nnx.Rngs(seed)))),
                 out_shardings=sharding.tree_shardings(mesh, sharding.param_specs(abstract)),
                 compiler_options=compiler_options)
  model = nnx.merge(graphdef, target)
  nnx.update(model, init())
  return model, plan


def context_cache(cfg: k3jax.K3Config, real: k3jax.K3Config, mesh: jax.sharding.Mesh, num_seqs: int, context: int,
                  capacity: int, seed: int) -> ModelCache:
  """A sharded cache of ``num_seqs`` sequences holding ``context`` synthetic tokens each (module docstring).

  The content is drawn on the host (``np.random.default_rng(seed)``, the same on every mesh), the KDA
  arrays padded to the padded heads with zeros (a padded model keeps those states at zero), and the latent
  rows written with ``k3jax.ops.mesh_write_rows``.

  Args:
    cfg: the padded config the model runs. real: the unpadded one (the content has its shapes).
    mesh: the mesh. num_seqs: N. context: cached tokens per sequence. capacity: tokens per sequence.
    seed: the content's seed.
  """
  cache = steps.init_mesh_cache(cfg, num_seqs, capacity, mesh)
  rng = np.random.default_rng(seed)
  h, k, w = real.kda_num_heads, real.kda_head_dim, real.short_conv_kernel_size
  p = cache.kda[0].recurrent.shape[0] if cache.kda else 0
  grow = (0, cfg.kda_num_heads - h)
  normal = lambda shape, std=1.0: (rng.standard_normal(shape, np.float32) * std)
  content = dict(
      kda=[dict(recurrent=np.pad(normal((p, h, k, k), 1 / math.sqrt(k)), [(0, 0), grow, (0, 0), (0, 0)]),
                **{name: np.pad(normal((p, w - 1, h, k)), [(0, 0), (0, 0), grow, (0, 0)]).reshape(p, w - 1, -1)
                   for name in ("conv_q", "conv_k", "conv_v")}) for _ in cache.kda],
      mla=[normal((num_seqs * context, kv.shape[-1])) for kv in cache.mla])
  seq = np.repeat(np.arange(num_seqs, dtype=np.int32), context)
  pos = np.tile(np.arange(context, dtype=np.int32), num_seqs)

  def fill(cache: ModelCache, content: dict, seq: jax.Array, pos: jax.Array) -> ModelCache:
    kda = tuple(KdaState(**{name: x.astype(getattr(state, name).dtype) for name, x in new.items()})
                for state, new in zip(cache.kda, content["kda"]))
    mla = tuple(ops.mesh_write_rows(kv, rows, cache.block_table, seq, pos)
                for kv, rows in zip(cache.mla, content["mla"]))
    return cache.replace(kda=kda, mla=mla, seq_lens=jnp.full((num_seqs,), context, jnp.int32))

  shardings = sharding.tree_shardings(mesh, sharding.cache_specs(cfg))
  with jax.set_mesh(mesh):
    return jax.jit(fill, out_shardings=shardings, donate_argnums=0)(cache, content, seq, pos)


def _param_bytes(model: nnx.Module, mesh: jax.sharding.Mesh, select=lambda path: True) -> int:
  """Bytes of one device's shards of the (abstract) parameters of ``model`` whose path ``select`` accepts."""
  specs = dict(nnx.to_flat_state(sharding.param_specs(model)))
  return sum(math.prod(NamedSharding(mesh, specs[path]).shard_shape(var.shape)) * var.dtype.itemsize
             for path, var in nnx.to_flat_state(nnx.state(model)) if select(tuple(map(str, path))))


def fit_experts(cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, args: argparse.Namespace, limit: int,
                compiler_options: dict | None = None) -> int:
  """The largest multiple of ``EXPERT_MULTIPLE`` experts (<= ``cfg.num_experts``) whose run fits the devices.

  Compiles prefill and decode for ``cfg`` on abstract parameters (only the small caches are allocated) and takes each
  compiled program's peak per device (arguments + outputs - donated aliases + temporaries). Everything but
  the expert weights is taken as independent of the expert count (with the dense ``ragged_dot`` rewrite the
  temporaries grow with it: the fit is then conservative).

  Args:
    cfg: the block's config (its ``num_experts`` is the most it returns). mesh: the mesh.
    args: the resolved sizes (``seqs``, ``prompt_len``, ``prefill_batch``, ``context``, ``decode_steps``).
    limit: bytes one device can allocate (``memory_stats()["bytes_limit"]``).
    compiler_options: as for ``steps.jit_model_step``.

  Raises:
    ValueError: not even ``EXPERT_MULTIPLE`` experts fit (the message gives the numbers).
  """
  n = sharding.mesh_size(mesh)
  plan = padding.PaddingPlan.for_config(cfg, n)
  model = nnx.eval_shape(lambda: k3jax.KimiK3Model(plan.config(cfg), rngs=nnx.Rngs(0)))
  step = steps.jit_model_step(model, mesh, vocab_size=cfg.vocab_size, compiler_options=compiler_options)
  params = _param_bytes(model, mesh)
  # The routed experts and the router's expert columns.
  experts = _param_bytes(model, mesh, lambda path: "experts" in path or "gate" in path)
  whole = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  peaks = {}
  for kind, capacity, args_ in (
      ("prefill", args.prompt_len, (whole(args.prefill_batch * args.prompt_len), whole(args.seqs + 1))),
      ("decode", args.context + args.decode_steps, (whole(args.seqs),))):
    cache = steps.init_mesh_cache(plan.config(cfg), args.seqs, capacity, mesh)  # small next to the weights
    log(f"memory fit: compiling {kind} for {cfg.num_experts} experts on abstract parameters")
    # Prefill: the logits the run asks for, every token's or each sequence's last (long_prompt.py).
    last_only = (getattr(args, "last_only", False),) if kind == "prefill" else ()
    with jax.set_mesh(mesh):
      ma = step.lowered(kind, *args_, cache, *last_only).compile().memory_analysis()
    jax.tree.map(lambda x: x.delete(), cache)
    peaks[kind] = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                   + ma.temp_size_in_bytes)
    log(f"memory fit: {kind} needs {peaks[kind] / GIB:.1f} GiB per device (params {params / GIB:.1f}, "
         f"temporaries {ma.temp_size_in_bytes / GIB:.1f}) of {limit / GIB:.1f}")
  per_expert = experts / (plan.padded("num_experts") // n)
  room = limit * (1 - MEMORY_MARGIN) - (max(peaks.values()) - experts)
  fit = min(cfg.num_experts, int(room // per_expert) * n // EXPERT_MULTIPLE * EXPERT_MULTIPLE)
  if fit < max(EXPERT_MULTIPLE, cfg.num_experts_per_token):
    raise ValueError(f"experts: not even {EXPERT_MULTIPLE} experts fit: everything but the experts needs "
                     f"{(max(peaks.values()) - experts) / GIB:.1f} GiB per device of {limit / GIB:.1f} GiB; "
                     f"lower --prompt-len / --prefill-batch, or use more devices")
  return fit


@dataclasses.dataclass
class Output:
  """One run's numbers (``row``: the JSON line) and logits.

  Attributes:
    row: JSON-able dict (sizes, timings in ms, GiB per device, comparison).
    prefill_logits: ``[N, PREFILL_ROWS, vocab]`` f32 at the positions ``prefill_positions``.
    decode_logits: ``[warmup + decode_steps, N, vocab]`` f32.
  """

  row: dict
  prefill_logits: np.ndarray
  decode_logits: np.ndarray


def prefill_positions(prompt_len: int) -> np.ndarray:
  return np.unique(np.linspace(0, prompt_len - 1, PREFILL_ROWS).round().astype(np.int32))


def init_step(cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, seed: int,
              compiler_options: dict | None = None
              ) -> tuple[k3jax.KimiK3Model, padding.PaddingPlan, steps.ModelStep]:
  """``init_model`` (logged), and the placed model's jitted step on ``mesh``."""
  log(f"initialising {cfg.num_experts}-expert parameters on {sharding.mesh_size(mesh)} device(s)")
  model, plan = init_model(cfg, mesh, seed, compiler_options)
  return model, plan, steps.jit_model_step(model, mesh, vocab_size=cfg.vocab_size,
                                           compiler_options=compiler_options)


def run(cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, args: argparse.Namespace,
        compiler_options: dict | None) -> Output:
  """Places the block on ``mesh``, times the prefill and the decode (module docstring), keeps logits."""
  n, seqs, plen, batch = sharding.mesh_size(mesh), args.seqs, args.prompt_len, args.prefill_batch
  total_steps = args.warmup + args.decode_steps
  whole = NamedSharding(mesh, P())
  model, plan, step = init_step(cfg, mesh, args.seed, compiler_options)
  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(0, cfg.vocab_size, (seqs, plen), dtype=np.int32)
  feed = rng.integers(0, cfg.vocab_size, (total_steps, seqs), dtype=np.int32)

  # (a) prefill: ceil(N / batch) calls of `batch` whole prompts each; every rep restarts all sequences.
  calls = []
  for first in range(0, seqs, batch):
    lens = np.zeros(seqs, np.int64)
    lens[first:first + batch] = plen
    calls.append((jax.device_put(prompts[first:first + batch].reshape(-1), whole), demo.packed_cu_seqlens(lens)))
  positions = prefill_positions(plen)
  cache = steps.init_mesh_cache(model.cfg, seqs, plen, mesh)
  kept, times = [], []
  for rep in range(args.warmup + args.reps):
    what = "compile + warm-up" if rep < args.warmup else "timed"
    log(f"prefill rep {rep + 1}/{args.warmup + args.reps} ({what}): {len(calls)} call(s) of "
         f"{calls[0][0].shape[0]} tokens")
    t0 = time.perf_counter()
    for i, (tokens, cu) in enumerate(calls):
      logits, cache = step.prefill(tokens, cu, cache)
      if rep == 0:
        rows = (np.arange(min(batch, seqs - i * batch))[:, None] * plen + positions).reshape(-1)
        kept.append(np.asarray(logits[rows]).reshape(-1, len(positions), logits.shape[-1]))
      del logits  # K3: [T, 163840] f32 per call; the memory fit counts one
    jax.block_until_ready(cache)
    times.append(time.perf_counter() - t0)
    cache = cache.replace(seq_lens=jax.device_put(np.zeros(seqs, np.int32), whole))
  prefill_compile_s, prefill_s = times[0], float(np.median(times[args.warmup:]))
  jax.tree.map(lambda x: x.delete(), cache)

  # (b) decode at `context` cached tokens per sequence (a synthetic cache, module docstring).
  log(f"building the decode cache: {seqs} sequences x {args.context} tokens")
  cache = context_cache(model.cfg, cfg, mesh, seqs, args.context, args.context + total_steps, args.seed + 1)
  decoded, times = [], []
  for s in range(total_steps):
    (logits, cache), dt = demo.timed(step.decode, jax.device_put(feed[s], whole), cache)
    decoded.append(np.asarray(logits))
    times.append(dt)
    if s < args.warmup or s == total_steps - 1:
      log(f"decode step {s + 1}/{total_steps}: {dt * 1e3:.1f} ms" + (" (compile + warm-up)" if s < args.warmup
                                                                     else ""))
  decode_compile_s, decode_s = times[0], float(np.median(times[args.warmup:]))

  stats = [d.memory_stats() for d in mesh.devices.flat]
  peak = max(s["peak_bytes_in_use"] for s in stats) if all(stats) else None
  row = dict(
      devices=n, platform=mesh.devices.flat[0].platform, mesh=", ".join(f"{k}={v}" for k, v in mesh.shape.items()),
      padding=demo.fmt_padding(plan), impl=cfg.impl, **{f: getattr(args, f) for f in RUN_FIELDS},
      num_experts=cfg.num_experts, top_k=cfg.num_experts_per_token, hidden_size=cfg.hidden_size,
      layer_types=list(cfg.layer_types), prefill_tokens=seqs * plen,
      prefill_compile_s=prefill_compile_s, prefill_ms=prefill_s * 1e3, prefill_tok_s=seqs * plen / prefill_s,
      decode_compile_s=decode_compile_s, decode_ms=decode_s * 1e3, decode_tok_s=seqs / decode_s,
      peak_gib=None if peak is None else peak / GIB,
      params_cache_gib=demo.bytes_per_device(step.state, cache) / GIB)
  return Output(row=row, prefill_logits=np.concatenate(kept), decode_logits=np.stack(decoded))


def token_stats(logits: np.ndarray, ref: np.ndarray, tol: float) -> dict:
  """Per-token agreement: ``rel`` = a token row's largest |logit - reference| / its largest |reference logit|.

  Args:
    logits: ``[..., vocab]`` float, one token per row (every index but the last).
    ref: the reference, same shape.
    tol: the tolerance ``tokens_above_tol`` counts against.

  Returns:
    ``token_rel_median``, ``token_rel_p99``, ``token_rel_max`` (floats) and ``tokens_above_tol``,
    ``tokens_compared`` (ints); a row with an all-zero reference and any difference has ``rel = inf``, a NaN
    row counts as above.
  """
  vocab = ref.shape[-1]
  diff = np.abs(logits - ref).reshape(-1, vocab).max(-1).astype(np.float64)
  scale = np.abs(ref).reshape(-1, vocab).max(-1).astype(np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    rel = np.where(diff == 0, 0.0, diff / scale)
  # "higher": the p99 is one token's value (no interpolation, which turns inf into nan).
  return dict(token_rel_median=float(np.median(rel)), token_rel_p99=float(np.percentile(rel, 99, method="higher")),
              token_rel_max=float(rel.max()), tokens_above_tol=int(np.sum(~(rel <= tol))),
              tokens_compared=int(rel.size))


def compare(out: Output, ref_path: str) -> None:
  """Adds the comparison with the reference and the scaling to ``out.row``.

  ``max_rel_diff`` (max |logit - reference| / max |reference logit| over prefill and decode) against
  ``TOLERANCES[dtype]`` decides ``ok``; ``{prefill,decode}_rel_diff`` are the same per phase, and
  ``{prefill,decode}_{token_rel_median,token_rel_p99,token_rel_max,tokens_above_tol,tokens_compared}`` the per-token
  diagnostics of ``token_stats``.

  Raises:
    ValueError: the logits' shapes or the run's dtype differ from the reference's.
  """
  with np.load(ref_path) as ref:
    ref_run = json.loads(str(ref["run"]))
    if out.row["dtype"] != ref_run["dtype"]:
      raise ValueError(f"--compare: this run's dtype is {out.row['dtype']!r}, the reference {ref_path} ran "
                       f"{ref_run['dtype']!r} (the check needs the same dtype on both sides)")
    pairs = [(out.prefill_logits, ref["prefill_logits"]), (out.decode_logits, ref["decode_logits"])]
    for (a, b), name in zip(pairs, ("prefill", "decode")):
      if a.shape != b.shape:
        raise ValueError(f"--compare: {name} logits of shape {a.shape}, the reference has {b.shape}")
    pairs = [(a, b.astype(np.float32)) for a, b in pairs]
    scale = max(float(np.abs(b).max()) for _, b in pairs)
    diffs = [float(np.abs(a - b).max()) / scale for a, b in pairs]
  row, tol = out.row, TOLERANCES[out.row["dtype"]]
  row.update(reference=ref_path, reference_devices=ref_run["devices"], prefill_rel_diff=diffs[0],
             decode_rel_diff=diffs[1], max_rel_diff=max(diffs), tolerance=tol,
             ok=bool(np.isfinite(max(diffs)) and max(diffs) <= tol))
  for (a, b), phase in zip(pairs, ("prefill", "decode")):
    row.update({f"{phase}_{k}": v for k, v in token_stats(a, b, tol).items()})
  ratio = row["devices"] / ref_run["devices"]
  for phase in ("prefill", "decode"):
    speedup = ref_run[f"{phase}_ms"] / row[f"{phase}_ms"]
    row[f"{phase}_speedup"], row[f"{phase}_scaling_efficiency"] = speedup, speedup / ratio


def print_table(row: dict) -> None:
  def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)

  cols = [("devices", f"{row['devices']} {row['platform']}"), ("mesh", row["mesh"]), ("padding", row["padding"]),
          ("prefill ms", fmt(row["prefill_ms"], ",.1f")), ("prefill tok/s", fmt(row["prefill_tok_s"], ",.0f")),
          ("decode ms/step", fmt(row["decode_ms"], ",.2f")), ("decode tok/s", fmt(row["decode_tok_s"], ",.0f")),
          ("peak GiB/dev", fmt(row["peak_gib"], ".2f")), ("params+cache GiB/dev", fmt(row["params_cache_gib"], ".4g")),
          ("max rel diff vs ref", "(no reference)" if "max_rel_diff" not in row else
           f"{row['max_rel_diff']:.2e} ({'OK' if row['ok'] else 'FAILED'}, tol {row['tolerance']:.0e})")]
  widths = [max(len(a), len(b)) for a, b in cols]
  print("\n" + " | ".join(a.ljust(w) for (a, _), w in zip(cols, widths)))
  print("-+-".join("-" * w for w in widths))
  print(" | ".join(b.ljust(w) for (_, b), w in zip(cols, widths)), flush=True)
  if "prefill_speedup" in row:
    print(f"vs the {row['reference_devices']}-device reference: prefill x{row['prefill_speedup']:.2f} "
          f"(scaling efficiency {row['prefill_scaling_efficiency']:.0%}), decode x{row['decode_speedup']:.2f} "
          f"(scaling efficiency {row['decode_scaling_efficiency']:.0%}); prefill rel diff "
          f"{row['prefill_rel_diff']:.2e}, decode rel diff {row['decode_rel_diff']:.2e}", flush=True)
    print("per token (its largest |diff| / its largest reference logit): " + "; ".join(
        f"{p} median {row[p + '_token_rel_median']:.2e}, p99 {row[p + '_token_rel_p99']:.2e}, max "
        f"{row[p + '_token_rel_max']:.2e}, {row[p + '_tokens_above_tol']} of {row[p + '_tokens_compared']} above tol"
        for p in ("prefill", "decode")), flush=True)
  if row["platform"] == "cpu":
    print("(the CPU devices share the host's cores: times show overheads, not a speed-up)", flush=True)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="benchmarks/sharded_block.py", description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--tiny", action="store_const", const=True, default=None,
      help="the tiny preset on 9 CPU devices (JAX_NUM_CPU_DEVICES overrides), 3 x 16 prompts, context 64")
  add("--devices", type=int, default=None, help="devices of the mesh: the first n (default: all)")
  add("--impl", choices=("xla", "pallas", "interpret"), default=None,
      help="kernel backend (default: pallas on a Hopper GPU, xla elsewhere; float32: xla only)")
  add("--dtype", choices=tuple(TOLERANCES), default=None,
      help="bfloat16 (default: the preset's dtypes; timing) or float32 (every dtype f32, full-precision matmuls: "
           "the equality check across device counts); see the module docstring")
  add("--experts", type=int, default=None,
      help="routed experts (default: the preset's; K3 on GPU: the largest multiple of 16 <= 896 that fits)")
  add("--seqs", type=int, default=None, help="sequences N (default 8; tiny 3)")
  add("--prompt-len", type=int, default=None, help="prefill tokens per sequence (default 4096; tiny 16)")
  add("--prefill-batch", type=int, default=None,
      help="sequences packed per prefill call (default 1; tiny: all); see the module docstring")
  add("--context", type=int, default=None, help="cached tokens per sequence at decode (default 32768; tiny 64)")
  add("--decode-steps", type=int, default=None, help="timed decode steps (default 8; tiny 3)")
  add("--warmup", type=int, default=None, help="untimed prefill reps and decode steps first (default 1)")
  add("--reps", type=int, default=3, help="timed prefill reps (default 3)")
  add("--seed", type=int, default=None, help="seed of parameters, prompts and cache (default 0)")
  add("--save", help="write the logits and this run's numbers to this .npz (the reference)")
  add("--compare", help="compare the logits with this reference .npz (its sizes are used)")
  add("--json", help="append one JSON line with the run's numbers to this file")
  add("--cudnn-ragged-dot", action=argparse.BooleanOptionalAction, default=True,
      help="XLA GPU: cuDNN grouped matmuls for the experts' ragged_dot instead of a dense rewrite (default on)")
  add("--watchdog", type=float, default=900.0,
      help="dump every thread's stack every this many seconds while running (0: off)")
  return parser


_DEFAULTS = {False: dict(dtype="bfloat16", seqs=8, prompt_len=4096, prefill_batch=1, context=32768, decode_steps=8,
                         warmup=1, seed=0),
             True: dict(dtype="bfloat16", seqs=3, prompt_len=16, prefill_batch=None, context=64, decode_steps=3,
                        warmup=1, seed=0)}


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
  """Fills the sizes: from ``--compare``'s reference (a conflicting flag is an error), else the defaults."""
  if args.compare:
    with np.load(args.compare) as ref:
      ref_run = json.loads(str(ref["run"]))
    for field in RUN_FIELDS:
      mine = getattr(args, field)
      if mine is not None and mine != ref_run[field]:
        raise ValueError(f"--{field.replace('_', '-')}={mine!r} contradicts the reference {args.compare}, "
                         f"which ran {field}={ref_run[field]!r}")
      setattr(args, field, ref_run[field])
  args.tiny = bool(args.tiny)
  for field, value in _DEFAULTS[args.tiny].items():
    if getattr(args, field) is None:
      setattr(args, field, value)
  args.prefill_batch = args.prefill_batch or args.seqs
  for field in ("seqs", "prompt_len", "prefill_batch", "context", "decode_steps", "warmup", "reps"):
    if getattr(args, field) < (0 if field == "warmup" else 1):
      raise ValueError(f"--{field.replace('_', '-')} must be >= {0 if field == 'warmup' else 1}, "
                       f"got {getattr(args, field)}")
  if args.warmup < 1:
    raise ValueError(f"--warmup must be >= 1 (the first call compiles), got {args.warmup}")
  if args.dtype == "float32" and args.impl not in (None, "xla"):
    raise NotImplementedError(f"--dtype float32 runs --impl xla only (the Pallas MLA decode kernel takes bf16 "
                              f"queries and cache), got --impl {args.impl}")
  return args


def gpu_environment(cudnn_ragged_dot: bool) -> None:
  """Sets, before JAX starts its backends (no effect once they run, e.g. under pytest), the GPU memory fraction
  (unless set) and, with ``cudnn_ragged_dot``, XLA's ragged-dot fusion (see the module docstring)."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  if cudnn_ragged_dot:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_experimental_use_ragged_dot_fusion=true").strip()


def run_main(args: argparse.Namespace, body, *, tiny_cpu_devices: int = 1) -> int:
  """``body(args)`` inside the block benchmarks' process setup: before JAX starts its backends (no effect once
  they run, e.g. under pytest) the CPU devices of a tiny run or the GPU environment, a watchdog, and
  full-precision matmuls for ``--dtype float32``."""
  if args.tiny:
    if tiny_cpu_devices > 1:
      demo.request_cpu_devices(tiny_cpu_devices)
  else:
    gpu_environment(args.cudnn_ragged_dot)
  if args.watchdog > 0:
    faulthandler.dump_traceback_later(args.watchdog, repeat=True)
  # float32 dots default to TF32 on Ampere and later GPUs (10-bit mantissa): bf16-like noise again.
  precision = jax.default_matmul_precision("float32") if args.dtype == "float32" else contextlib.nullcontext()
  try:
    with precision:
      return body(args)
  finally:
    faulthandler.cancel_dump_traceback_later()


def mesh_and_options(args: argparse.Namespace) -> tuple[jax.sharding.Mesh, dict | None]:
  """Resolves ``args.impl`` and returns the mesh of ``args.devices`` and the compiler options of its platform."""
  from pallas_kernels import util
  args.impl = args.impl or ("xla" if args.dtype == "float32" else util.default_impl())
  mesh = sharding.make_mesh(args.devices)
  # CPU: -O0 compiles several times faster and runs the same ops (the tiny run is compile-bound).
  options = {"xla_backend_optimization_level": 0} if mesh.devices.flat[0].platform == "cpu" else None
  return mesh, options


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; returns the exit status (1 when ``--compare`` finds a difference above the tolerance)."""
  return run_main(_resolve(_parser().parse_args(argv)), _main, tiny_cpu_devices=9)


def _main(args: argparse.Namespace) -> int:
  mesh, options = mesh_and_options(args)
  platform = mesh.devices.flat[0].platform
  cfg = block_config(args)
  if args.experts is None and not args.tiny and mesh.devices.flat[0].memory_stats():
    limit = min(d.memory_stats()["bytes_limit"] for d in mesh.devices.flat)
    args.experts = fit_experts(cfg, mesh, args, limit, options)
    cfg = cfg.replace(num_experts=args.experts)
  args.experts = cfg.num_experts
  full = k3jax.preset("tiny" if args.tiny else "kimi_k3")
  log(f"sharded block: {'tiny' if args.tiny else 'Kimi-K3'} layers {'+'.join(cfg.layer_types)} (both MoE), "
       f"hidden {cfg.hidden_size}, KDA {cfg.kda_num_heads}x{cfg.kda_head_dim}, MLA {cfg.num_attention_heads} heads "
       f"latent {cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}, experts {cfg.num_experts} of the preset's "
       f"{full.num_experts} (top-{cfg.num_experts_per_token}, {cfg.moe_hidden_size}x{cfg.moe_intermediate_size}), "
       f"vocab {cfg.vocab_size}, {cfg.dtype.name}, impl={cfg.impl}; {sharding.mesh_size(mesh)} {platform} "
       f"device(s); prefill {args.seqs}x{args.prompt_len} ({args.prefill_batch} per call), decode "
       f"{args.warmup}+{args.decode_steps} steps at context {args.context}, seed {args.seed}")
  out = run(cfg, mesh, args, options)
  if args.compare:
    compare(out, args.compare)
  print_table(out.row)
  if args.save:
    # float16 (rounding <= 2^-11 relative, half the f32 tolerance) keeps a K3 reference at ~34 MB, small enough
    # to carry (float32: 68 MB).
    np.savez(args.save, prefill_logits=out.prefill_logits.astype(np.float16),
             decode_logits=out.decode_logits.astype(np.float16), run=json.dumps(out.row))
    log(f"saved the reference to {args.save}")
  if args.json:
    with open(args.json, "a") as f:
      f.write(json.dumps(out.row) + "\n")
  return 0 if out.row.get("ok", True) else 1


if __name__ == "__main__":
  sys.exit(main())

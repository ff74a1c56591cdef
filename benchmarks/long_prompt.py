"""One long prompt through the Kimi-K3 block (one KDA and one MLA layer, both MoE, K3 widths): one-shot and
chunked prefill, then decode steps at that context.

The block, its parameters and the expert fit are ``benchmarks/sharded_block.py``'s (``block_config``,
``init_model``, ``fit_experts``), on a mesh of ``--devices`` devices (default 1). For each ``--prompt-len`` L
(default 32K and 128K tokens) one sequence of random token ids runs, in this order:

(a) chunked prefill: L / ``--chunk`` successive ``ModelStep.prefill`` calls of the same sequence (the chunk
    must divide L). ``KimiK3Model.prefill`` continues a sequence whose ``seq_lens`` is > 0: KDA reads its state
    and conv window, and the MLA layer reads the sequence's cached latent rows back, up-projects them, and its
    new tokens attend to all of them causally as the last queries (``mla_prefill_attention`` with
    ``cu_seqlens_k``). Each call is waited for, so the per-chunk times show the attention growing with the
    position.
(b) decode: ``--warmup`` + ``--decode-steps`` steps on the cache the chunked prefill left (context L; after
    the one-shot prefill when ``--chunk 0``): ms per step (median of the timed steps) and tokens/s.
(c) one-shot prefill: one call of all L tokens.

Warm-up: the first call of each program compiles. A chunk's prefill is compiled once per bound on the cached
rows it reads back (``prefix_rows``: the cached tokens rounded up to a power of two), so a few of the chunks
compile; the whole chunked prefill runs once untimed, then ``seq_lens`` is reset to 0, which restarts the
sequence (state and rows are overwritten). The one-shot prefill runs once untimed, then ``--reps`` timed.
Times are wall clock around the calls, compile excluded; tokens/s = L / prefill time.

Memory per device: ``peak_gib`` after each phase is ``memory_stats()["peak_bytes_in_use"]``, the process's peak
so far (JAX has no reset): phases run in the order above, so each peak includes the earlier phases' (run one
mode with ``--chunk 0`` or ``--no-one-shot`` for its own). Null where the backend keeps no statistics (CPU).
Every prefill asks for the last token's logits only (``last_only``): the full f32 logits, ``[T, 163840]``,
would be the largest buffer of a long prompt's step.

Profile (``--profile``, GPU): one more one-shot prefill under CUPTI (``benchmarks._harness.cupti_kernels``).
``oneshot_profile`` holds its wall ms, the summed ms of every kernel it ran and that sum per family
(``KERNEL_FAMILIES``: the Pallas ops, the matmuls, the rest), the five costliest kernels of the rest, and
``wall_over_ops``: the wall time over the Pallas ops + matmuls, i.e. how far the whole prefill is from the sum
of its op times (what the glue and the gaps between kernels add).

Equality: ``logits_max_abs_diff`` is max |one-shot - chunked| over the final token's logits (the same token,
the same cached context), ``logits_max_rel_diff`` that over the largest |one-shot logit|. In bf16 the two paths
round differently (and a router near-tie may flip an expert, see sharded_block.py); ``--dtype float32`` (every
dtype f32, full-precision matmuls, impl xla) makes the check tight.

Experts: without ``--experts`` on a GPU, ``fit_experts`` runs per mode (one-shot: L tokens; chunked: a chunk
of tokens at decode context L) and the smallest count over the prompt lengths and modes is used; a mode in
which not even 16 experts fit is skipped and reported (``oneshot_status`` / ``chunked_status``).
One JSON line per prompt length (``--json``, appended) with the keys ``ROW_KEYS``.

On GPU the environment is set up as ``sharded_block.main`` does before JAX starts (the memory fraction and the
cuDNN grouped matmul for ``ragged_dot``).

Usage::

  PYTHONPATH=. python3 benchmarks/long_prompt.py --json long_prompt.jsonl                  # 32K and 128K
  PYTHONPATH=. python3 benchmarks/long_prompt.py --prompt-len 32768 --chunk 8192 --decode-steps 8
  PYTHONPATH=. python3 benchmarks/long_prompt.py --prompt-len 131072 --no-one-shot         # chunked only
  PYTHONPATH=. python3 benchmarks/long_prompt.py --prompt-len 32768 --chunk 0 --profile    # one-shot vs its ops
  PYTHONPATH=. python3 benchmarks/long_prompt.py --tiny --dtype float32   # tiny preset, 1 CPU device, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import k3jax
from benchmarks import _harness, sharded_block
from benchmarks.sharded_block import log
from k3jax import demo, steps

GIB = 2 ** 30
ROW_KEYS = ("prompt_len", "chunk", "devices", "platform", "impl", "dtype", "experts", "layer_types", "hidden_size",
            "chunked_status", "chunked_ms", "chunked_tok_s", "chunk_ms", "chunked_peak_gib",
            "decode_context", "decode_ms", "decode_tok_s", "decode_peak_gib",
            "oneshot_status", "oneshot_ms", "oneshot_tok_s", "oneshot_peak_gib",
            "logits_max_abs_diff", "logits_max_rel_diff", "params_gib", "oneshot_profile")
# Kernel families of a CUPTI profile, by name (first match): the Pallas ops, the matmuls (projections and the
# experts' grouped matmul), and the rest (XLA fusions: norms, routing, casts, layout copies, the cache writes).
KERNEL_FAMILIES = (("pallas", ("mosaic",)), ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cudnn", "cublas")))


def peak_gib(mesh: jax.sharding.Mesh) -> float | None:
  """The largest ``peak_bytes_in_use`` over the mesh's devices (GiB), None without memory statistics."""
  stats = [d.memory_stats() for d in mesh.devices.flat]
  return max(s["peak_bytes_in_use"] for s in stats) / GIB if all(stats) else None


def fit_modes(cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, args: argparse.Namespace, limit: int,
              options: dict | None) -> tuple[int, dict]:
  """``(experts, {(L, mode): None or why it is skipped})`` from ``sharded_block.fit_experts`` per mode.

  One-shot fits L prefill tokens; chunked a chunk of tokens (its cache sized to the chunk, not L: the cache
  and the read-back prefix's buffers are small next to the experts) and the decode at context L. ``limit``:
  bytes one device can allocate.

  Raises:
    ValueError: no mode fits at any prompt length.
  """
  fits, skipped = [], {}
  for L in args.prompt_len:
    for mode in modes(args):
      sizes = argparse.Namespace(seqs=1, prefill_batch=1, prompt_len=L if mode == "oneshot" else args.chunk,
                                 context=L, decode_steps=args.warmup + args.decode_steps, last_only=True)
      try:
        fits.append(sharded_block.fit_experts(cfg, mesh, sizes, limit, options))
        skipped[L, mode] = None
        log(f"memory fit: L={L} {mode}: {fits[-1]} experts")
      except (ValueError, jax.errors.JaxRuntimeError) as e:  # not even 16 experts fit, or the compile ran out
        skipped[L, mode] = f"does not fit: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"memory fit: L={L} {mode}: {skipped[L, mode]}")
  if not fits:
    raise ValueError("no mode fits at any prompt length: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
  return min(fits), skipped


def modes(args: argparse.Namespace) -> list[str]:
  return (["chunked"] if args.chunk else []) + (["oneshot"] if args.one_shot else [])


def free(tree) -> None:
  """Deletes the arrays of ``tree`` that still exist (a failed or donating call may have taken some)."""
  for x in jax.tree.leaves(tree):
    if not x.is_deleted():
      x.delete()


def run_length(step: steps.ModelStep, cfg: k3jax.K3Config, mesh: jax.sharding.Mesh, L: int,
               args: argparse.Namespace, skipped: dict) -> dict:
  """The three phases (module docstring) for one prompt of ``L`` tokens; returns the JSON row's numbers.

  Args:
    step: the jitted step. cfg: the config the model runs (padded on a mesh; the caches take it).
    mesh: the mesh. L: prompt tokens. args: the resolved flags. skipped: ``fit_modes``'s reasons.
  """
  whole = NamedSharding(mesh, P())
  rng = np.random.default_rng(args.seed + L)
  prompt = rng.integers(0, step.vocab_size, L, dtype=np.int32)
  feed = rng.integers(0, step.vocab_size, (args.warmup + args.decode_steps, 1), dtype=np.int32)
  capacity = L + args.warmup + args.decode_steps
  put = lambda x: jax.device_put(x, whole)
  row, last = {}, {}

  def restart(cache):
    return cache.replace(seq_lens=put(np.zeros(1, np.int32)))

  def prefill_chunks(cache, count: int, times: list | None):
    """The first ``count`` chunks into ``cache``; returns it and the last chunk's final-token logits."""
    cu = put(np.asarray([0, args.chunk], np.int32))
    final = None
    for i in range(count):
      t0 = time.perf_counter()
      logits, cache = step.prefill(put(prompt[i * args.chunk:(i + 1) * args.chunk]), cu, cache, last_only=True)
      final = logits[-1]
      jax.block_until_ready(cache)
      if times is not None:
        times.append((time.perf_counter() - t0) * 1e3)
    return cache, final

  decoded = False
  for mode in modes(args):
    if skipped.get((L, mode)):
      row[f"{mode}_status"] = skipped[L, mode]
      continue
    cache = steps.init_mesh_cache(cfg, 1, capacity, mesh)
    try:
      if mode == "chunked":
        n = L // args.chunk
        log(f"L={L} chunked: warm-up ({n} chunks of {args.chunk}, compiles)")
        cache, _ = prefill_chunks(cache, n, None)
        samples = []
        for rep in range(args.reps):
          cache = restart(cache)
          times = []
          cache, final = prefill_chunks(cache, n, times)
          samples.append(sum(times))
          log(f"L={L} chunked rep {rep + 1}/{args.reps}: {sum(times):,.1f} ms; per chunk "
               + " ".join(f"{t:,.0f}" for t in times))
        row.update(chunked_ms=float(np.median(samples)), chunk_ms=times)
      else:
        log(f"L={L} one-shot: warm-up (compiles)")
        cu = put(np.asarray([0, L], np.int32))
        tokens = put(prompt)
        _, cache = step.prefill(tokens, cu, cache, last_only=True)
        samples = []
        for rep in range(args.reps):
          cache = restart(cache)
          t0 = time.perf_counter()
          logits, cache = step.prefill(tokens, cu, cache, last_only=True)
          final = logits[-1]
          jax.block_until_ready(cache)
          samples.append((time.perf_counter() - t0) * 1e3)
          log(f"L={L} one-shot rep {rep + 1}/{args.reps}: {samples[-1]:,.1f} ms")
        row.update(oneshot_ms=float(np.median(samples)))
        if args.profile:  # the step donates the cache: keep the one it returns
          prof, (_, cache) = profile(lambda c=restart(cache): step.prefill(tokens, cu, c, last_only=True))
          row.update(oneshot_profile=prof)
          log(f"L={L} one-shot profile: {row['oneshot_profile']}")
    except Exception as e:  # e.g. out of memory with --experts given: keep the other mode's numbers
      row[f"{mode}_status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
      log(f"L={L} {mode}: {row[f'{mode}_status']}")
      free(cache)
      continue
    last[mode] = np.asarray(final, np.float32)
    row.update({f"{mode}_status": "ok", f"{mode}_tok_s": L / row[f"{mode}_ms"] * 1e3,
                f"{mode}_peak_gib": peak_gib(mesh)})
    if decoded:
      free(cache)
    else:  # the first mode's cache goes on to the decode steps (which free it)
      row.update(decode(step, cache, feed, put, args, L, mesh))
      decoded = True

  if len(last) == 2:
    diff = np.abs(last["oneshot"] - last["chunked"])
    row.update(logits_max_abs_diff=float(diff.max()),
               logits_max_rel_diff=float(diff.max() / np.abs(last["oneshot"]).max()))
  return row


def profile(run) -> tuple[dict, object]:
  """Wall ms and CUPTI kernel ms (total and per ``KERNEL_FAMILIES``) of one ``run()`` (waited for); the
  costliest kernels outside the op families, and the wall time over the op families' sum. Returns them and
  what ``run()`` returned."""
  with _harness.cupti_kernels() as records:
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    wall = (time.perf_counter() - t0) * 1e3
  family = {name: 0.0 for name, _ in KERNEL_FAMILIES} | {"other": 0.0}
  other: dict[str, float] = {}
  for kernel, ms in records:
    low = kernel.lower()
    name = next((n for n, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")
    family[name] += ms
    if name == "other":
      other[kernel] = other.get(kernel, 0.0) + ms
  ops = family["pallas"] + family["matmul"]
  return dict(wall_ms=wall, kernel_ms=sum(family.values()), family_ms=family,
              top_other=sorted(other.items(), key=lambda kv: -kv[1])[:5],
              wall_over_ops=wall / ops if ops else None), out


def decode(step: steps.ModelStep, cache, feed: np.ndarray, put, args: argparse.Namespace, L: int,
           mesh: jax.sharding.Mesh) -> dict:
  """``--warmup`` + ``--decode-steps`` decode steps at context L (the cache is used up)."""
  times = []
  for s in range(len(feed)):
    (logits, cache), dt = demo.timed(step.decode, put(feed[s]), cache)
    del logits
    times.append(dt * 1e3)
  ms = float(np.median(times[args.warmup:]))
  log(f"L={L} decode: {ms:.2f} ms/step (median of {args.decode_steps}; first step {times[0]:,.1f} ms with "
       f"compile)")
  free(cache)
  return dict(decode_context=L, decode_ms=ms, decode_tok_s=1e3 / ms, decode_peak_gib=peak_gib(mesh))


def print_table(rows: list[dict]) -> None:
  def num(v, spec):
    return "-" if v is None else format(v, spec)

  print(f"\n{'L':>7} {'mode':>8} {'ms':>11} {'tok/s':>9} {'peak GiB':>8}  status", flush=True)
  for r in rows:
    for mode, label in (("chunked", f"chunk {r['chunk']}"), ("oneshot", "one-shot")):
      if r.get(f"{mode}_status") is None:
        continue
      print(f"{r['prompt_len']:7d} {label:>8} {num(r.get(f'{mode}_ms'), ',.1f'):>11} "
            f"{num(r.get(f'{mode}_tok_s'), ',.0f'):>9} {num(r.get(f'{mode}_peak_gib'), '.2f'):>8}  "
            f"{r[f'{mode}_status']}", flush=True)
    if r.get("decode_ms") is not None:
      print(f"{r['prompt_len']:7d} {'decode':>8} {r['decode_ms']:11.2f} {r['decode_tok_s']:9,.1f} "
            f"{num(r['decode_peak_gib'], '.2f'):>8}  ms/step at context {r['decode_context']}", flush=True)
    prof = r.get("oneshot_profile")
    if prof:
      fam = ", ".join(f"{k} {v:,.1f}" for k, v in prof["family_ms"].items())
      print(f"{r['prompt_len']:7d} one-shot profile: wall {prof['wall_ms']:,.1f} ms, kernels {prof['kernel_ms']:,.1f} "
            f"ms ({fam}); wall / (pallas + matmul) = {num(prof['wall_over_ops'], '.2f')}", flush=True)
    if r.get("logits_max_abs_diff") is not None:
      print(f"{r['prompt_len']:7d} final-token logits one-shot vs chunked: max |diff| "
            f"{r['logits_max_abs_diff']:.3e} ({r['logits_max_rel_diff']:.2e} of the largest logit)", flush=True)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="benchmarks/long_prompt.py", description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--tiny", action="store_true", help="the tiny preset on 1 CPU device: L 64, chunk 16, 2 decode steps")
  add("--prompt-len", type=int, nargs="+", default=None, help="prompt tokens L (default 32768 131072; tiny 64)")
  add("--chunk", type=int, default=None, help="tokens per chunked prefill call, dividing L (default 8192; tiny "
      "16); 0: no chunked prefill")
  add("--one-shot", action=argparse.BooleanOptionalAction, default=True, help="also a one-shot prefill")
  add("--decode-steps", type=int, default=None, help="timed decode steps (default 8; tiny 2)")
  add("--warmup", type=int, default=1, help="untimed decode steps first (>= 1: the first compiles)")
  add("--reps", type=int, default=1, help="timed prefills per mode (median)")
  add("--devices", type=int, default=1, help="devices of the mesh: the first n")
  add("--profile", action="store_true", help="one more one-shot prefill under CUPTI: kernel time per family and "
      "the wall time over the ops' (GPU only)")
  add_block_options(parser, experts="the most that fit every mode, sharded_block")
  add("--json", help="append one JSON line per prompt length to this file")
  return parser


def add_block_options(parser: argparse.ArgumentParser, *, experts: str) -> None:
  """The options of a run of the K3 block that this script and prefix_cache.py share (``experts``: how the
  expert count is chosen on a GPU, for the help text)."""
  add = parser.add_argument
  add("--impl", choices=("xla", "pallas", "interpret"), default=None,
      help="kernel backend (default: pallas on a Hopper GPU, xla elsewhere; float32: xla)")
  add("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
      help="bfloat16 (the preset's dtypes) or float32 (every dtype f32, full-precision matmuls: tight equality)")
  add("--experts", type=int, default=None, help=f"routed experts (default: the preset's; K3 on GPU: {experts})")
  add("--seed", type=int, default=0)
  add("--cudnn-ragged-dot", action=argparse.BooleanOptionalAction, default=True,
      help="XLA GPU: cuDNN grouped matmuls for ragged_dot instead of a dense rewrite (as sharded_block.py)")
  add("--watchdog", type=float, default=900.0, help="dump every thread's stack every this many seconds (0: off)")


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
  defaults = dict(prompt_len=[64], chunk=16, decode_steps=2) if args.tiny else dict(
      prompt_len=[32768, 131072], chunk=8192, decode_steps=8)
  for field, value in defaults.items():
    if getattr(args, field) is None:
      setattr(args, field, value)
  if args.chunk < 0 or (args.chunk and any(L % args.chunk for L in args.prompt_len)):
    raise ValueError(f"--chunk must be 0 or divide every --prompt-len {args.prompt_len}, got {args.chunk} (a "
                     "shorter last chunk would compile during the timed run)")
  if not modes(args):
    raise ValueError("nothing to run: --chunk 0 and --no-one-shot")
  if min(args.prompt_len) < 1 or args.decode_steps < 1 or args.warmup < 1 or args.reps < 1:
    raise ValueError("--prompt-len, --decode-steps, --warmup and --reps must be >= 1")
  if args.dtype == "float32" and args.impl not in (None, "xla"):
    raise NotImplementedError(f"--dtype float32 runs --impl xla only, got --impl {args.impl}")
  return args


def main(argv: list[str] | None = None) -> int:
  return sharded_block.run_main(_resolve(_parser().parse_args(argv)), _main)


def _main(args: argparse.Namespace) -> int:
  mesh, options = sharded_block.mesh_and_options(args)
  platform = mesh.devices.flat[0].platform
  if args.profile and (platform != "gpu" or not args.one_shot):
    raise NotImplementedError(f"--profile profiles the one-shot prefill on a GPU (CUPTI), got {platform} with "
                              f"one-shot {args.one_shot}")
  cfg = sharded_block.block_config(args)
  skipped = {}
  if args.experts is None and not args.tiny and mesh.devices.flat[0].memory_stats():
    limit = min(d.memory_stats()["bytes_limit"] for d in mesh.devices.flat)
    args.experts, skipped = fit_modes(cfg, mesh, args, limit, options)
    cfg = cfg.replace(num_experts=args.experts)
  args.experts = cfg.num_experts
  log(f"long prompt: {'tiny' if args.tiny else 'Kimi-K3'} layers {'+'.join(cfg.layer_types)} (both MoE), hidden "
       f"{cfg.hidden_size}, MLA {cfg.num_attention_heads} heads, experts {cfg.num_experts} "
       f"(top-{cfg.num_experts_per_token}), vocab {cfg.vocab_size}, {cfg.dtype.name}, impl={cfg.impl}; "
       f"{args.devices} {platform} device(s); prompts {args.prompt_len}, chunk {args.chunk}, one-shot "
       f"{args.one_shot}, decode {args.warmup}+{args.decode_steps} steps")
  model, _, step = sharded_block.init_step(cfg, mesh, args.seed, options)
  rows = []
  for L in args.prompt_len:
    row = dict.fromkeys(ROW_KEYS)
    row.update(prompt_len=L, chunk=args.chunk, devices=args.devices, platform=platform, impl=cfg.impl,
               dtype=args.dtype, experts=cfg.num_experts, layer_types=list(cfg.layer_types),
               hidden_size=cfg.hidden_size, params_gib=demo.bytes_per_device(step.state) / GIB)
    row.update(run_length(step, model.cfg, mesh, L, args, skipped))
    rows.append(row)
    if args.json:
      with open(args.json, "a") as f:
        f.write(json.dumps(row) + "\n")
  print_table(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())

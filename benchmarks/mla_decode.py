"""Split-K MLA decode on one Hopper GPU: the Mosaic GPU kernel against the measured copy bandwidth and XLA.

Run on the GPU machine from the repository root: ``PYTHONPATH=. python3 benchmarks/mla_decode.py``.
bf16 cache ``[pages, 64, 576]`` with every sequence's pages scattered over the whole cache (ids beyond
65535), all sequences at full length. For each (B, context, Hq, partial dtype) it prints the time of one
``mla_decode`` call (kernel + merge; median over repetitions of back-to-back calls, so host dispatch is
hidden except for the smallest problems), the achieved bandwidth counting the KV bytes once
(``B * context * 576 * 2``), and its fraction of the device-to-device copy bandwidth measured in the same
run (bytes read + written by a 2 GiB ``jnp.copy``). The plain-XLA path (``impl="xla"``, the split-K
reference) is timed where its f32 intermediates fit comfortably (at most 1M tokens).

``merge us`` is the device time (CUPTI) of the XLA kernels of one ``mla_decode`` call, i.e. everything but the
Mosaic GPU kernel: the fused ``merge_partials`` (nothing when S = 1). ``of call`` is its share of the call's
device time: the most a merge kernel could save (issue [5/9] item 3 asks for one only if it measures faster).
Printed as ``-`` where CUPTI is not available (interpret mode on a CPU).

The full grid (54 kernel configurations, each compiled once) takes about five minutes on the H200; pass
``--batch/--context/--heads`` subsets to split it over several calls.
"""

import argparse
import faulthandler
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._harness import cupti_kernels
from pallas_kernels.mla import MlaDecodeConfig, api, default_tuning, mla_decode
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM
from pallas_kernels.testing import K3_MLA_SCALE

DIM = LATENT_DIM + ROPE_DIM
XLA_MAX_TOKENS = 1 << 20
WATCHDOG_S = 120  # a deadlocked kernel blocks forever; dump the stacks and exit instead


def time_call(f, *args, budget_s: float = 0.25, reps: int = 3) -> float:
  """Median seconds per call of ``f(*args)`` over ``reps`` runs of back-to-back calls (after a warm-up)."""
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  jax.block_until_ready(f(*args))
  iters = int(np.clip(budget_s / max(time.perf_counter() - t, 1e-6), 3, 200))
  samples = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t) / iters)
  return statistics.median(samples)


def copy_bandwidth(nbytes: int = 2 << 30) -> tuple[float, float]:
  """(copy TB/s counting read + write, reduction TB/s counting the read) of an ``nbytes`` bf16 array."""
  x = jax.random.normal(jax.random.key(1), (nbytes // 2,), jnp.bfloat16)
  copy = time_call(jax.jit(jnp.copy), x)
  read = time_call(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x)
  return 2 * nbytes / copy / 1e12, nbytes / read / 1e12


def merge_device_us(f, *args, calls: int = 20) -> tuple[float, float] | None:
  """(us per call of the non-Mosaic kernels, their share of the call's device time), or None without CUPTI."""
  if jax.devices()[0].platform != "gpu":
    return None
  jax.block_until_ready(f(*args))
  with cupti_kernels() as records:
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
  total = sum(ms for _, ms in records)
  merge = sum(ms for name, ms in records if "mosaic" not in name)
  return merge * 1e3 / calls, merge / total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
  parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
  parser.add_argument("--heads", type=int, nargs="+", default=[16, 96, 128])
  parser.add_argument("--impl", default="pallas", help="'interpret' smoke-tests the script on a CPU")
  parser.add_argument("--copy-gib", type=float, default=2.0, help="array size of the copy measurement")
  parser.add_argument("--json", help="also append one JSON line per measurement to this file")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  copy_tbs, read_tbs = copy_bandwidth(int(args.copy_gib * 2**30))
  print(f"copy bandwidth {copy_tbs:.2f} TB/s (read + write, {args.copy_gib:g} GiB jnp.copy); "
        f"read-only reduction {read_tbs:.2f} TB/s", flush=True)

  num_pages = max(args.batch) * max(args.context) // PAGE_SIZE
  kq, kc, kp = jax.random.split(jax.random.key(0), 3)
  cache = jax.random.normal(kc, (num_pages, PAGE_SIZE, DIM), jnp.bfloat16)
  order = jax.random.permutation(kp, num_pages).astype(jnp.int32)
  print(f"cache {num_pages} pages ({cache.nbytes / 2**30:.1f} GiB)\n", flush=True)
  header = (f"{'B':>4} {'ctx':>7} {'Hq':>4} {'partial':>8} {'splits':>6} {'time us':>9} {'TB/s':>6} "
            f"{'of copy':>7} {'merge us':>9} {'of call':>7} {'xla us':>9} {'speedup':>7}")
  print(header, flush=True)
  out = open(args.json, "a") if args.json else None
  for batch, context, heads in itertools.product(args.batch, args.context, args.heads):
    pps = context // PAGE_SIZE
    table = order[: batch * pps].reshape(batch, pps)
    lens = jnp.full((batch,), context, jnp.int32)
    q = jax.random.normal(kq, (batch, heads, DIM), jnp.bfloat16)
    kv_bytes = batch * context * DIM * 2
    xla_s = None
    if batch * context <= XLA_MAX_TOKENS:
      faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
      xla = jax.jit(lambda *a: mla_decode(*a, config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla")))
      xla_s = time_call(xla, q, cache, table, lens)
    for partial in (jnp.bfloat16, jnp.float32):
      faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
      config = MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial, impl=args.impl)
      f = jax.jit(lambda *a, config=config: mla_decode(*a, config=config))
      sec = time_call(f, q, cache, table, lens)
      tbs = kv_bytes / sec / 1e12
      splits = api.effective_num_splits(pps, default_tuning(batch, heads, pps).num_splits)
      merge = merge_device_us(f, q, cache, table, lens)
      merge_txt = f"{merge[0]:9.1f} {merge[1]:7.1%}" if merge else f"{'-':>9} {'-':>7}"
      row = dict(batch=batch, context=context, heads=heads, partial=jnp.dtype(partial).name, splits=splits,
                 time_us=sec * 1e6, tbs=tbs, frac_copy=tbs / copy_tbs, merge_us=merge and merge[0],
                 merge_frac=merge and merge[1], xla_us=None if xla_s is None else xla_s * 1e6)
      xla_txt = f"{xla_s * 1e6:9.1f} {xla_s / sec:6.1f}x" if xla_s is not None else f"{'-':>9} {'-':>7}"
      print(f"{batch:4d} {context:7d} {heads:4d} {row['partial']:>8} {splits:6d} {sec * 1e6:9.1f} {tbs:6.2f} "
            f"{tbs / copy_tbs:7.0%} {merge_txt} {xla_txt}", flush=True)
      if out:
        out.write(json.dumps(row) + "\n")
        out.flush()
  faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
  sys.exit(main())

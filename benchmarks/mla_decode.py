"""Split-K MLA decode on one Hopper GPU: the Mosaic GPU kernel against the measured copy bandwidth and XLA.

Run on the GPU machine from the repository root: ``PYTHONPATH=. python3 benchmarks/mla_decode.py``.
bf16 cache ``[pages, 64, 576]`` with every sequence's pages scattered over the whole cache (ids beyond
65535), all sequences at full length (``--ragged``: below). For each (B, context, Hq, partial dtype) it prints the
time of one ``mla_decode`` call (kernel + merge; median over repetitions of back-to-back calls, so host dispatch
is hidden except for the smallest problems), the achieved bandwidth counting the KV bytes once (``B * context *
576 * 2``), and its fraction of the device-to-device copy bandwidth measured in the same run (bytes read +
written by a 2 GiB ``jnp.copy``). The plain-XLA path (``impl="xla"``, the split-K
reference) is timed where its f32 intermediates fit comfortably (at most 1M tokens).

``merge us`` is the device time (CUPTI) of the XLA kernels of one ``mla_decode`` call, i.e. everything but the
Mosaic GPU kernel: the fused ``merge_partials`` (nothing when S = 1). ``of call`` is its share of the call's
device time: the most a merge kernel could save (issue [5/9] item 3 asks for one only if it measures faster).
Printed as ``-`` where CUPTI is not available (interpret mode on a CPU).

``TFLOP/s`` counts ``2 * B * Hq * context * (576 + 512)`` FLOPs per call (QK^T over 576, PV over 512).

``--ragged`` draws each sequence's length from ``[1, context]`` (the same batch in every run) instead of all at
``context``, as a serving batch mixes contexts: our splits are a static share of the block table's columns, so
the longest sequence sets the call's time, while FlashMLA's scheduling metadata balances the tokens over the SMs.
Bytes and FLOPs then count the tokens actually cached. ``--splits`` times the given split counts instead of the
heuristic's, and ``--layouts balanced equal`` both split layouts (``MlaDecodeTuning.balanced``); ``splits`` is the
budget S (the balanced grid has up to 2 S splits). The JSON rows carry ``model_page_times``, the layout's
``modelled_page_times``.

``--cache-dtypes bfloat16 float8_e4m3fn`` also times an fp8 cache (``cache_format``: 640 bytes per token, the
same random values quantised page block by page block) with the same pages, q and lengths: its bandwidth counts
its own bytes (``B * context * 640``), ``vs bf16`` is the bf16 cache's time over its time (same shape and partial
dtype, same run) and ``fp8 err`` its output's relative RMS difference from the bf16 cache's (the e4m3 rounding).
The XLA path and FlashMLA (whose fp8 decode is sparse-only) run on the bf16 cache only. ``--fp8-paths ring
registers`` times both ways the narrow kernel reads an fp8 page (``MlaDecodeTuning.fp8_in_registers``: each page
converted into an f16 ring, or kept fp8 with V converted in registers, the default); the cache column names the
path (``fp8 ring``, ``fp8 registers``).

Peer: FlashMLA (deepseek-ai/FlashMLA 9241ae3, its sm90a dense bf16 decode through its own
``flash_mla_with_kvcache``), in the same process on the same GPU, reading the same cache memory through the same
block table with the same q, lengths and scale (the JAX arrays reach torch through DLPack, no copy). ``fmla us`` is
its time per call as called (timed like ours) and ``graph us`` under CUDA-graph replay; ``vs ours`` is the better
of the two over our time (above 1: ours is faster); ``rel err`` is the relative RMS difference of its output from
ours. Its scheduling metadata is computed once per shape, outside the timed calls, as a serving stack computes it
once per batch for all layers. Build it first (a few minutes; needs torch with CUDA, nvcc, ninja)::

  bash tools/peers/build_flashmla.sh && PYTHONPATH=.:/tmp/peers/flashmla python3 benchmarks/mla_decode.py

Without it (or with ``--no-flashmla``) the script prints why and times ours alone.

``MHz`` is the median SM clock that nvidia-smi read while our calls were timed (``fmla MHz``: FlashMLA's better
form); at 96-128 heads both kernels keep the tensor cores busy and may run at the board's power cap, below the
1.98 GHz boost clock, so a time per call is only comparable with one taken at a similar clock. The JSON rows
also hold the power (W), the clock-event reasons and ``kernel_us``, the Mosaic kernel's own device time (CUPTI).

``--resident-pages N`` draws every page id from the first N pages of the cache (a working set that fits the
L2 cache, 50 MB on an H100: about 256 pages), so HBM no longer binds and the time is what the kernel's own work
per page takes. An H200's HBM is about 1.4x an H100's at the same SM count and clocks, so on an H100 this shows
the bound that the compute sets on an H200, which bandwidth alone does not. ``TB/s`` then counts the bytes that
the kernel reads from L2, not from HBM.

The full grid (54 kernel configurations, each compiled once) takes about five minutes on the H200; pass
``--batch/--context/--heads`` subsets to split it over several calls.
"""

import argparse
import faulthandler
import heapq
import itertools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FlashMLA's torch shares the GPU in this process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._harness import cupti_kernels, gpu_clocks, positive_int  # noqa: E402
from pallas_kernels import util  # noqa: E402
from pallas_kernels.mla import (MlaDecodeConfig, MlaDecodeTuning, api, cache_format, default_tuning,  # noqa: E402
                                mla_decode, reference)
from pallas_kernels.mla.config import HEAD_TILE, LATENT_DIM, PAGE_SIZE, ROPE_DIM  # noqa: E402
from pallas_kernels.testing import K3_MLA_SCALE  # noqa: E402

DIM = LATENT_DIM + ROPE_DIM
XLA_MAX_TOKENS = 1 << 20
WATCHDOG_S = 120  # a deadlocked kernel blocks forever; dump the stacks and exit instead
GRAPH_CALLS = 10  # FlashMLA calls per captured CUDA graph: one replay's launch cost is spread over them


def time_call(f, *args, budget_s: float = 0.25, reps: int = 3, sync=jax.block_until_ready) -> float:
  """Median seconds per call of ``f(*args)`` over ``reps`` runs of back-to-back calls (after a warm-up);
  ``sync(out)`` waits for the device (for torch: ``torch.cuda.synchronize``)."""
  sync(f(*args))
  t = time.perf_counter()
  sync(f(*args))
  iters = int(np.clip(budget_s / max(time.perf_counter() - t, 1e-6), 3, 200))
  samples = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    sync(out)
    samples.append((time.perf_counter() - t) / iters)
  return statistics.median(samples)


def decode_flops(heads: int, tokens: int) -> int:
  """FLOPs of one decode step over ``tokens`` cached tokens in all: QK^T over the 576 latent + rope columns, PV over
  the 512 latent ones."""
  return 2 * heads * tokens * (DIM + LATENT_DIM)


PROGRAM_OVERHEAD_PAGES = 2.0  # a program's own cost beyond its pages (q load, epilogue, partial store): a guess
EMPTY_PROGRAM_PAGES = 0.2


def modelled_page_times(lens: np.ndarray, max_pages: int, splits: int, tiles: int, *, balanced: bool = False,
                        sms: int = util.NUM_SMS) -> float:
  """The call's modelled makespan in page-times: the grid's programs (split, sequence, head tile; the tiles
  fastest) taken in launch order by the first free of ``sms`` SMs, one program per SM, each lasting its pages
  plus ``PROGRAM_OVERHEAD_PAGES`` (``EMPTY_PROGRAM_PAGES`` when it has none). A model of how evenly a batch's
  tokens spread over the SMs, for the ratio between a ragged batch and a full one, not a time.

  ``splits``: the budget S (``api.choose_num_splits``'s). ``balanced``: the kernels' balanced splits (``2 S``
  splits of ``reference.balanced_split_width`` pages); otherwise S equal splits of the block table's columns."""
  pages = -(-np.asarray(lens, np.int64) // PAGE_SIZE)
  if balanced:
    capacity = api.effective_num_splits(max_pages, 2 * splits)
    widths = np.asarray(reference.balanced_split_width(int(pages.sum()), pages, max_pages=max_pages, budget=splits,
                                                       batch=len(pages), num_splits=capacity))
  else:
    capacity = splits
    widths = np.full(len(pages), reference.pages_per_split(max_pages, splits))
  free = [0.0] * sms
  for j in range(capacity):
    for p, w in zip(pages, widths):
      n = min(max(int(p) - j * int(w), 0), int(w))
      for _ in range(tiles):
        heapq.heappush(free, heapq.heappop(free) + (n + PROGRAM_OVERHEAD_PAGES if n else EMPTY_PROGRAM_PAGES))
  return max(free)


def ragged_lengths(batch: int, context: int, seed: int = 0) -> np.ndarray:
  """``[batch]`` int32 lengths drawn uniformly from ``[1, context]`` (a fixed seed: the same batch in every run), as
  a serving batch mixes short and long contexts."""
  return np.random.default_rng(seed).integers(1, context, size=batch, endpoint=True).astype(np.int32)


def rel_rms(a: np.ndarray, ref: np.ndarray) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref ** 2)))


def flashmla_skip_reason() -> str | None:
  """Why FlashMLA cannot run in this process (None: run it)."""
  if jax.devices()[0].platform != "gpu":
    return f"the {jax.devices()[0].platform} backend (FlashMLA needs a Hopper GPU)"
  try:
    import flash_mla  # built by tools/peers/build_flashmla.sh, its directory on PYTHONPATH
    import torch
  except Exception as e:  # ImportError, or a build that does not load (an undefined symbol)
    return f"import flash_mla failed ({type(e).__name__}: {e}); build it with tools/peers/build_flashmla.sh"
  if not hasattr(flash_mla.cuda, "dense_decode_fwd"):
    return f"{flash_mla.cuda.__file__} has no dense decode"
  if not torch.cuda.is_available():
    return "torch sees no CUDA device"
  return None


def to_torch(x: jax.Array):
  """A JAX GPU array as a torch CUDA tensor on the same memory through DLPack (the cache is tens of GiB), else
  a copy through the host."""
  import torch

  jax.block_until_ready(x)  # torch's kernels run on its own stream, unordered with JAX's
  try:
    return torch.from_dlpack(x)
  except Exception as e:  # an exporter that refuses: slower, twice the memory, the same values
    print(f"  DLPack {x.shape} failed ({type(e).__name__}: {e}); copying through the host", flush=True)
    a = np.asarray(x)
    if a.dtype == jnp.bfloat16:  # NumPy's bf16 (ml_dtypes) is unknown to torch: move the bits
      return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def time_flashmla(q, cache, table, lens) -> tuple[float, float | None, np.ndarray, dict]:
  """FlashMLA's dense decode on our inputs: (seconds per call as called, per call under CUDA-graph replay or None
  where capture fails, its output ``[B, Hq, 512]`` as f32, the ``Clocks`` of each form: ``{"called": ...,
  "graph": ...}``)."""
  import flash_mla
  import torch

  q_t = to_torch(q).unsqueeze(1)  # [B, s_q = 1, Hq, 576]
  cache_t = to_torch(cache).unsqueeze(2)  # [pages, 64, h_kv = 1, 576]: the same pages, the same bytes
  table_t, lens_t = to_torch(table), to_torch(lens)  # int32, as FlashMLA requires
  # The first call with a fresh FlashMLASchedMeta runs FlashMLA's scheduling-metadata kernel (splits per SM part
  # from the lengths) and keeps its result; later calls reuse it. A serving stack computes it once per batch and
  # shares it by every layer, so it is computed here, before the timed calls, and is not in their time.
  meta, _ = flash_mla.get_mla_metadata()

  def call():
    return flash_mla.flash_mla_with_kvcache(q_t, cache_t, table_t, lens_t, LATENT_DIM, meta,
                                            softmax_scale=K3_MLA_SCALE, causal=False)[0]

  o = call()[:, 0].float().cpu().numpy()
  sync = lambda _: torch.cuda.synchronize()
  clocks = {}
  with gpu_clocks() as clocks["called"]:
    called = time_call(call, sync=sync)
  graph_s = None
  try:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream before capture, as torch.cuda.graph asks
      call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
      for _ in range(GRAPH_CALLS):
        call()
    with gpu_clocks() as clocks["graph"]:
      graph_s = time_call(graph.replay, sync=sync) / GRAPH_CALLS
  except Exception as e:  # a capture failure leaves the as-called time as FlashMLA's number
    print(f"  FlashMLA CUDA graph capture failed: {type(e).__name__}: {e}", flush=True)
  return called, graph_s, o, clocks


def copy_bandwidth(nbytes: int = 2 << 30) -> tuple[float, float]:
  """(copy TB/s counting read + write, reduction TB/s counting the read) of an ``nbytes`` bf16 array."""
  x = jax.random.normal(jax.random.key(1), (nbytes // 2,), jnp.bfloat16)
  copy = time_call(jax.jit(jnp.copy), x)
  read = time_call(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x)
  return 2 * nbytes / copy / 1e12, nbytes / read / 1e12


def merge_device_us(f, *args, calls: int = 20) -> tuple[float, float, float] | None:
  """(us per call of the non-Mosaic kernels, their share of the call's device time, us per call of the Mosaic
  kernels), or None without CUPTI."""
  if jax.devices()[0].platform != "gpu":
    return None
  jax.block_until_ready(f(*args))
  with cupti_kernels() as records:
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
  total = sum(ms for _, ms in records)
  merge = sum(ms for name, ms in records if "mosaic" not in name)
  return merge * 1e3 / calls, merge / total, (total - merge) * 1e3 / calls


def make_cache(dtype, key, num_pages: int, block: int = 4096) -> jax.Array:
  """``[num_pages, 64, row width]`` cache of N(0, 1) latent rows in ``dtype`` (bf16, or fp8 rows with their
  scales), drawn and quantised ``block`` pages at a time (the f32 draw of a whole 128K x 128 cache is 39 GB); the
  same ``key`` gives the same values in every dtype."""
  quantize = jax.jit(lambda k: cache_format.quantize_rows(
      jax.random.normal(k, (block, PAGE_SIZE, DIM), jnp.float32), dtype, LATENT_DIM))
  keys = jax.random.split(key, -(-num_pages // block))
  return jnp.concatenate([quantize(k) for k in keys])[:num_pages]


def page_order(key, num_pages: int, resident_pages: int | None = None) -> jax.Array:
  """The page ids that the block tables take in turn: ``[num_pages]`` int32, a permutation of the cache's pages
  (sequences scattered over all of it), or with ``resident_pages`` that permutation modulo it, so every id is one
  of the first ``resident_pages`` (``--resident-pages``)."""
  order = jax.random.permutation(key, num_pages).astype(jnp.int32)
  return order % resident_pages if resident_pages else order


def add_resident_pages_argument(parser: argparse.ArgumentParser, help_prefix: str = "") -> None:
  """``--resident-pages N`` (an int >= 1, default None): the page ids from the first N pages only (``page_order``),
  here and in ``benchmarks/kernel_profile.py``."""
  parser.add_argument("--resident-pages", type=positive_int, default=None,
                      help=f"{help_prefix}page ids drawn from the first N pages only, an L2-resident working set "
                           "(benchmarks/mla_decode.py's doc)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
  parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
  parser.add_argument("--heads", type=int, nargs="+", default=[16, 96, 128])
  parser.add_argument("--impl", default="pallas", help="'interpret' smoke-tests the script on a CPU")
  parser.add_argument("--cache-dtypes", nargs="+", choices=("bfloat16", "float8_e4m3fn"), default=["bfloat16"],
                      help="latent cache dtypes to time (bfloat16 first: the fp8 rows are compared with it)")
  parser.add_argument("--copy-gib", type=float, default=2.0, help="array size of the copy measurement")
  parser.add_argument("--json", help="also append one JSON line per measurement to this file")
  parser.add_argument("--no-flashmla", action="store_true", help="time ours alone, without the FlashMLA column")
  parser.add_argument("--ragged", action="store_true",
                      help="lengths drawn from [1, context] (`ragged_lengths`) instead of all at the context")
  parser.add_argument("--splits", type=int, nargs="+", default=[None],
                      help="num_splits values to time (default: the heuristic's, `api.choose_num_splits`)")
  parser.add_argument("--layouts", nargs="+", choices=("balanced", "equal"), default=["equal"],
                      help="split layouts to time: equal splits of the block table's columns (the default) or "
                           "spread by pages (`MlaDecodeTuning.balanced`)")
  parser.add_argument("--fp8-paths", nargs="+", choices=("ring", "registers"), default=["registers"],
                      help="how the narrow kernel reads an fp8 page: converted into an f16 ring or kept fp8 with V "
                           "converted in registers (`MlaDecodeTuning.fp8_in_registers`; the default)")
  add_resident_pages_argument(parser)
  parser.add_argument("--wide", action="store_true",
                      help="the 64-row head tiles everywhere (the default tuning takes the narrow, transposed "
                           "kernel where it applies: a bf16 cache and Hq <= 32)")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  flashmla_skip = "--no-flashmla" if args.no_flashmla else flashmla_skip_reason()
  if flashmla_skip:
    print(f"FlashMLA: skipped: {flashmla_skip}", flush=True)
  copy_tbs, read_tbs = copy_bandwidth(int(args.copy_gib * 2**30))
  print(f"copy bandwidth {copy_tbs:.2f} TB/s (read + write, {args.copy_gib:g} GiB jnp.copy); "
        f"read-only reduction {read_tbs:.2f} TB/s", flush=True)

  num_pages = max(args.batch) * max(args.context) // PAGE_SIZE
  kq, kc, kp = jax.random.split(jax.random.key(0), 3)
  caches = {name: make_cache(jnp.dtype(name), kc, num_pages) for name in args.cache_dtypes}
  # (column name, cache, fp8 path): each fp8 path after the bf16 cache, over the same fp8 cache.
  variants = [("bfloat16", caches["bfloat16"], None)] if "bfloat16" in caches else []
  if "float8_e4m3fn" in caches:
    variants += [(f"fp8 {path}", caches["float8_e4m3fn"], path) for path in args.fp8_paths]
  order = page_order(kp, num_pages, args.resident_pages)
  if args.resident_pages:
    print(f"page ids from the first {args.resident_pages} pages only (--resident-pages): L2-resident", flush=True)
  print("caches of " + ", ".join(f"{num_pages} pages of {name} ({c.nbytes / 2**30:.1f} GiB)" for name, c in
                                 caches.items()) + "\n", flush=True)
  if args.wide:
    print("the 64-row head tiles at every Hq (--wide)", flush=True)
  header = (f"{'B':>4} {'ctx':>7} {'Hq':>4} {'cache':>13} {'partial':>8} {'splits':>6} {'layout':>8} {'tiles':>6} "
            f"{'time us':>9} "
            f"{'TB/s':>6} {'of copy':>7} {'merge us':>9} {'of call':>7} {'xla us':>9} {'speedup':>7} {'TFLOP/s':>7} "
            f"{'MHz':>5} {'fmla us':>9} {'graph us':>9} {'vs ours':>7} {'rel err':>8} {'fmla MHz':>8} {'fp8 err':>8} "
            f"{'vs bf16':>7}")
  print(header, flush=True)
  out = open(args.json, "a") if args.json else None
  for batch, context, heads in itertools.product(args.batch, args.context, args.heads):
    pps = context // PAGE_SIZE
    table = order[: batch * pps].reshape(batch, pps)
    lens = jnp.asarray(ragged_lengths(batch, context) if args.ragged else np.full(batch, context, np.int32))
    tokens = int(np.sum(lens))
    if args.ragged:
      print(f"ragged lengths, {tokens} tokens (mean {tokens / batch:.0f}, max {int(np.max(lens))})", flush=True)
    q = jax.random.normal(kq, (batch, heads, DIM), jnp.bfloat16)
    cache = caches.get("bfloat16")
    xla_s = None
    if cache is not None and batch * context <= XLA_MAX_TOKENS:
      faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
      xla = jax.jit(lambda *a: mla_decode(*a, config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla")))
      xla_s = time_call(xla, q, cache, table, lens)
    fmla = None  # time_flashmla's (as called s, graph replay s or None, output, clocks) on this shape
    if cache is not None and not flashmla_skip:
      faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
      try:
        fmla = time_flashmla(q, cache, table, lens)
      except Exception as e:  # keep our numbers when FlashMLA fails; it is not tried again
        flashmla_skip = f"failed: {type(e).__name__}: {e}"
        print(f"FlashMLA {flashmla_skip}; timing ours alone from here", flush=True)
    flops = decode_flops(heads, tokens)
    for partial, num_splits, layout, (cache_name, cache, fp8_path) in itertools.product(
        (jnp.bfloat16, jnp.float32), args.splits, args.layouts, variants):
      faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
      tuning = default_tuning(batch, heads, pps, cache_dtype=cache.dtype)
      narrow = tuning.narrow and not args.wide
      if fp8_path == "registers" and not narrow:
        continue  # the 64-row tiles have one fp8 path
      config = MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial, impl=args.impl,
                               tuning=MlaDecodeTuning(num_splits=num_splits, narrow=False if args.wide else None,
                                                      balanced=layout == "balanced",
                                                      fp8_in_registers=fp8_path == "registers"))
      f = jax.jit(lambda *a, config=config: mla_decode(*a, config=config))
      with gpu_clocks() as clocks:
        sec = time_call(f, q, cache, table, lens)
      kv_bytes = tokens * cache.shape[-1] * cache.dtype.itemsize
      tbs = kv_bytes / sec / 1e12
      splits = api.effective_num_splits(pps, num_splits or tuning.num_splits)
      merge = merge_device_us(f, q, cache, table, lens)
      merge_txt = f"{merge[0]:9.1f} {merge[1]:7.1%}" if merge else f"{'-':>9} {'-':>7}"
      head_tiles = 1 if narrow else util.cdiv(heads, HEAD_TILE)
      row = dict(batch=batch, context=context, heads=heads, cache=jnp.dtype(cache.dtype).name, fp8_path=fp8_path,
                 partial=jnp.dtype(partial).name,
                 splits=splits, narrow=narrow, layout=layout, ragged=args.ragged, tokens=tokens,
                 resident_pages=args.resident_pages,
                 model_page_times=modelled_page_times(np.asarray(lens), pps, splits, head_tiles,
                                                      balanced=layout == "balanced"),
                 time_us=sec * 1e6, tbs=tbs, frac_copy=tbs / copy_tbs, merge_us=merge and merge[0],
                 merge_frac=merge and merge[1], kernel_us=merge and merge[2],
                 sm_mhz=clocks.sm_mhz, power_w=clocks.power_w, clock_reasons=clocks.reasons,
                 flashmla_sm_mhz=None, flashmla_power_w=None,
                 xla_us=None if xla_s is None else xla_s * 1e6,
                 tflops=flops / sec / 1e12, flashmla_us=None, flashmla_called_us=None, flashmla_graph_us=None,
                 flashmla_tflops=None, ratio_flashmla=None, flashmla_rel_err=None, vs_bf16=None, bf16_rel_err=None)
      bf16_run = cache_name == "bfloat16"
      xla_txt = (f"{xla_s * 1e6:9.1f} {xla_s / sec:6.1f}x" if xla_s is not None and bf16_run
                 else f"{'-':>9} {'-':>7}")
      fmla_txt = f"{'-':>9} {'-':>9} {'-':>7} {'-':>8} {'-':>8}"
      o_ours = np.asarray(f(q, cache, table, lens)[0].astype(jnp.float32))
      if bf16_run:  # the caches are the innermost loop: each fp8 row follows its bf16 row of the same tuning
        bf16_sec, o_bf16 = sec, o_ours
      elif "bfloat16" in caches:
        row.update(vs_bf16=bf16_sec / sec, bf16_rel_err=rel_rms(o_ours, o_bf16))
      if fmla and bf16_run:
        called, graph, o_fmla, fmla_clocks = fmla
        best = min(t for t in (called, graph) if t is not None)
        best_clocks = fmla_clocks["graph" if best == graph else "called"]
        row.update(flashmla_us=best * 1e6, flashmla_called_us=called * 1e6,
                   flashmla_graph_us=None if graph is None else graph * 1e6, flashmla_tflops=flops / best / 1e12,
                   ratio_flashmla=best / sec, flashmla_rel_err=rel_rms(o_fmla, o_ours),
                   flashmla_sm_mhz=best_clocks.sm_mhz, flashmla_power_w=best_clocks.power_w)
        graph_txt = f"{graph * 1e6:9.1f}" if graph is not None else f"{'-':>9}"
        fmla_txt = (f"{called * 1e6:9.1f} {graph_txt} {best / sec:6.2f}x {row['flashmla_rel_err']:8.1e} "
                    f"{best_clocks.sm_mhz:8.0f}")
      vs_txt = (f"{row['bf16_rel_err']:8.1e} {row['vs_bf16']:6.2f}x" if row["vs_bf16"] is not None
                else f"{'-':>8} {'-':>7}")
      tiles = "narrow" if narrow else "64-row"
      print(f"{batch:4d} {context:7d} {heads:4d} {cache_name:>13} {row['partial']:>8} {splits:6d} {layout:>8} "
            f"{tiles:>6} {sec * 1e6:9.1f} {tbs:6.2f} {tbs / copy_tbs:7.0%} {merge_txt} {xla_txt} {row['tflops']:7.1f} "
            f"{clocks.sm_mhz:5.0f} {fmla_txt} {vs_txt}", flush=True)
      if out:
        out.write(json.dumps(row) + "\n")
        out.flush()
  faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
  sys.exit(main())

"""Where a kernel's time goes: Mosaic GPU's on-device profiler over the named phases of the KDA prefill and MLA
decode kernels.

Run on the GPU machine from the repository root::

  PYTHONPATH=. python3 benchmarks/kernel_profile.py kda-prefill [--lens 8192] [--heads 96] [--ckpt 0] [--space 512]
  PYTHONPATH=. python3 benchmarks/kernel_profile.py mla-decode [--batch 32] [--context 32768] [--heads 128]
      [--wide] [--cache-dtype bfloat16] [--fp8-in-registers] [--resident-pages N] [--space 16]

It sets ``util.PROFILE_DIR_ENV`` (and ``util.PROFILE_SPACE_ENV``) before anything is traced, runs one call of the
op (impl pallas; kda-prefill: K = V = 128, bf16 inputs, lower-bound gate, f32 state; mla-decode: a bf16 or fp8 cache,
all sequences at full length, the default tuning, ``--wide`` or ``--fp8-in-registers``; ``--resident-pages``
takes the page ids from the first N pages, as ``benchmarks/mla_decode.py`` does, so that the pages come from L2
and the kernel's own work binds, as on an H200), and summarises the Chrome
trace that each kernel of the call writes (``DIR/*-trace.json``): per kernel, the programs traced, the
median span of a program's warpgroup (first entry to last exit) and, per phase (``util.Phases`` in the kernel),
its occurrences per program, the median time of one occurrence and the median total per program, with its share
of the span. The times are of one warpgroup, waits included (a phase that waits for a TMA shows the load), in
thousands of SM clock cycles: the profiler stamps each event with ``%clock`` (and the trace's ``ts`` with cycles
/ 1000 past a nanosecond start time), so 1 kcycle is about 0.5 us at the H200's 1.98 GHz boost clock.

Caveats: the profile buffer takes ``16 * space`` bytes of SMEM per warpgroup, which can lower the programs per SM
(the KDA prep runs two per SM at about 98 KB; 512 keeps it there) or not fit at all (the MLA decode with 64-row
tiles has less than 1.5 KB left for its three warpgroups: 16 fits, 32 did not); a warpgroup records at most
``space`` phases, later ones are dropped (the state pass has 5 per chunk and the decode's leader 4 per page, so
their totals cover the first chunks or pages only, their per-occurrence medians are not affected); each phase
boundary adds a few cycles. ``summarise`` also reads traces of any other kernel.
"""

import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def summarise_trace(path: str) -> dict:
  """Per-phase statistics of one trace file (see the module docstring); times in thousands of clock cycles."""
  with open(path) as f:
    events = json.load(f)["traceEvents"]
  per_trace: dict[int, list[dict]] = defaultdict(list)
  for e in events:
    per_trace[e["tid"]].append(e)
  spans, totals, counts, single = [], defaultdict(list), defaultdict(list), defaultdict(list)
  for trace in per_trace.values():
    trace.sort(key=lambda e: e["ts"])
    spans.append(trace[-1]["ts"] - trace[0]["ts"])
    open_at: dict[str, list[float]] = defaultdict(list)
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in trace:
      if e["ph"] == "B":
        open_at[e["name"]].append(e["ts"])
      elif open_at[e["name"]]:
        d = e["ts"] - open_at[e["name"]].pop()
        total[e["name"]] += d
        count[e["name"]] += 1
        single[e["name"]].append(d)
    for name in total:
      totals[name].append(total[name])
      counts[name].append(count[name])
  span = statistics.median(spans)
  phases = {name: dict(per_program=statistics.median(counts[name]), median_kcycles=statistics.median(single[name]),
                       total_kcycles=statistics.median(totals[name]), share=statistics.median(totals[name]) / span)
            for name in totals}
  return dict(file=os.path.basename(path), programs=len(per_trace), span_kcycles=span, phases=phases)


def summarise(directory: str) -> list[dict]:
  """``summarise_trace`` of every ``*-trace.json`` in ``directory``, oldest first."""
  return [summarise_trace(p) for p in sorted(glob.glob(os.path.join(directory, "*-trace.json")))]


def print_summary(summary: dict) -> None:
  print(f"{summary['file']}: {summary['programs']} traced warpgroups, median span {summary['span_kcycles']:.2f} "
        "kcycles")
  print(f"  {'phase':<14} {'per program':>11} {'median kcyc':>11} {'total kcyc':>10} {'share':>6}")
  for name, p in sorted(summary["phases"].items(), key=lambda kv: -kv[1]["total_kcycles"]):
    print(f"  {name:<14} {p['per_program']:11g} {p['median_kcycles']:11.3f} {p['total_kcycles']:10.2f} "
          f"{p['share']:6.1%}")


def run_kda_prefill(args: argparse.Namespace) -> str:
  from benchmarks.kda_prefill import make_inputs, ours_runner

  # makes (and waits for) one call
  ours_runner(make_inputs(args.lens, args.heads), args.lens, args.heads, per_seq_ckpt=args.ckpt)
  return f"kda_prefill lens={args.lens} H={args.heads} checkpoints per sequence={args.ckpt}"


def mla_decode_inputs(args: argparse.Namespace) -> tuple:
  """The profiled call's ``(q, cache, table, lens)``: ``args.batch`` sequences of ``args.context`` tokens over a
  cache of as many pages in ``args.cache_dtype``, their page ids from ``mla_decode.page_order`` (with
  ``args.resident_pages``: the first N pages only)."""
  import jax
  import jax.numpy as jnp

  from benchmarks.mla_decode import make_cache, page_order
  from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM

  num_pages = args.batch * (args.context // PAGE_SIZE)
  kq, kc, kp = jax.random.split(jax.random.key(0), 3)
  cache = make_cache(jnp.dtype(args.cache_dtype), kc, num_pages, block=min(num_pages, 4096))
  table = page_order(kp, num_pages, args.resident_pages).reshape(args.batch, -1)
  q = jax.random.normal(kq, (args.batch, args.heads, LATENT_DIM + ROPE_DIM), jnp.bfloat16)
  return q, cache, table, jnp.full((args.batch,), args.context, jnp.int32)


def run_mla_decode(args: argparse.Namespace) -> str:
  import jax

  from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning, mla_decode
  from pallas_kernels.testing import K3_MLA_SCALE

  q, cache, table, lens = mla_decode_inputs(args)
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, impl="pallas",
                           tuning=MlaDecodeTuning(narrow=False if args.wide else None,
                                                  fp8_in_registers=args.fp8_in_registers))
  jax.block_until_ready(jax.jit(lambda *a: mla_decode(*a, config=config))(q, cache, table, lens))
  return (f"mla_decode B={args.batch} context={args.context} Hq={args.heads} {args.cache_dtype} cache"
          f"{' wide' if args.wide else ''}{' fp8 in registers' if args.fp8_in_registers else ''}"
          f"{f' pages from the first {args.resident_pages}' if args.resident_pages else ''}")


OPS = {"kda-prefill": (run_kda_prefill, 512), "mla-decode": (run_mla_decode, 16)}


def main(argv: list[str] | None = None) -> int:
  from benchmarks import mla_decode

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("op", choices=tuple(OPS))
  parser.add_argument("--lens", type=int, nargs="+", default=[8192], help="kda-prefill: packed sequence lengths")
  parser.add_argument("--heads", type=int, default=None, help="heads (default 96 for kda-prefill, 128 mla-decode)")
  parser.add_argument("--ckpt", type=int, default=0, help="kda-prefill: checkpoints per sequence")
  parser.add_argument("--batch", type=int, default=32, help="mla-decode: sequences")
  parser.add_argument("--context", type=int, default=32768, help="mla-decode: tokens per sequence")
  parser.add_argument("--wide", action="store_true", help="mla-decode: the 64-row head tiles at any Hq")
  parser.add_argument("--cache-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16",
                      help="mla-decode: the latent cache's dtype")
  parser.add_argument("--fp8-in-registers", action="store_true",
                      help="mla-decode: the narrow kernel's fp8 pages in registers "
                           "(`MlaDecodeTuning.fp8_in_registers`)")
  mla_decode.add_resident_pages_argument(parser, "mla-decode: ")
  parser.add_argument("--space", type=int, default=None, help="phases recorded per warpgroup (default: per op)")
  parser.add_argument("--out", default="/tmp/k3jax-profile", help="trace directory (emptied of old traces)")
  parser.add_argument("--json", help="also write the summaries here")
  args = parser.parse_args(argv)
  run, default_space = OPS[args.op]
  args.space = args.space or default_space
  args.heads = args.heads or (96 if args.op == "kda-prefill" else 128)

  from pallas_kernels import util
  os.makedirs(args.out, exist_ok=True)
  for old in glob.glob(os.path.join(args.out, "*-trace.json")):
    os.remove(old)
  os.environ[util.PROFILE_DIR_ENV] = args.out
  os.environ[util.PROFILE_SPACE_ENV] = str(args.space)

  import jax

  what = run(args)
  jax.effects_barrier()  # the traces are written by host callbacks after the kernels
  print(f"{what} on {jax.devices()[0].device_kind}, space {args.space}")
  summaries = summarise(args.out)
  if not summaries:
    print(f"no trace in {args.out}: was the call compiled for a GPU?")
    return 1
  for s in summaries:
    print_summary(s)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summaries, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

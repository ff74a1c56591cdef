"""Where a kernel's time goes: Mosaic GPU's on-device profiler over the named phases of the KDA prefill kernels.

Run on the GPU machine from the repository root::

  PYTHONPATH=. python3 benchmarks/kernel_profile.py [--lens 8192] [--heads 96] [--space 512] [--out DIR]

It sets ``util.PROFILE_DIR_ENV`` (and ``util.PROFILE_SPACE_ENV``) before anything is traced, runs one
``kda_prefill`` call (impl pallas, K = V = 128, bf16 inputs, lower-bound gate, f32 state), and summarises the
Chrome trace that each kernel of the call writes (``DIR/*-trace.json``): per kernel, the programs traced, the
median span of a program's warpgroup (first entry to last exit) and, per phase (``util.Phases`` in the kernel),
its occurrences per program, the median time of one occurrence and the median total per program, with its share
of the span. The times are of one warpgroup, waits included (a phase that waits for a TMA shows the load), in
thousands of SM clock cycles: the profiler stamps each event with ``%clock`` (and the trace's ``ts`` with cycles
/ 1000 past a nanosecond start time), so 1 kcycle is about 0.5 us at the H200's 1.98 GHz boost clock.

Caveats: the profile buffer takes ``16 * space`` bytes of SMEM per warpgroup, which can lower the programs per SM
(the prep runs two per SM at about 98 KB; 512 keeps it there); a program records at most ``space`` phases, later
ones are dropped (the state pass has 5 per chunk, so its totals are of the first ``space / 5`` chunks, its
per-occurrence medians are not affected); each phase boundary adds a few cycles. ``summarise`` also reads traces
of any other kernel.
"""

import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict

import numpy as np


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


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lens", type=int, nargs="+", default=[8192], help="sequence lengths of the packed call")
  parser.add_argument("--heads", type=int, default=96)
  parser.add_argument("--space", type=int, default=512, help="phases recorded per warpgroup")
  parser.add_argument("--out", default="/tmp/k3jax-profile", help="trace directory (emptied of old traces)")
  parser.add_argument("--json", help="also write the summaries here")
  args = parser.parse_args()

  from pallas_kernels import util
  os.makedirs(args.out, exist_ok=True)
  for old in glob.glob(os.path.join(args.out, "*-trace.json")):
    os.remove(old)
  os.environ[util.PROFILE_DIR_ENV] = args.out
  os.environ[util.PROFILE_SPACE_ENV] = str(args.space)

  import jax
  import jax.numpy as jnp

  from benchmarks.kda_prefill import LB, make_inputs
  from pallas_kernels import kda

  x = make_inputs(args.lens, args.heads)
  n = len(args.lens)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  config = kda.KdaConfig(lower_bound=LB, impl="pallas")
  call = jax.jit(lambda *a: kda.kda_prefill(
      *a[:5], A_log=a[5], dt_bias=a[6], cu_seqlens=a[7], state_pool=a[8], state_indices=a[9],
      has_initial_state=a[10], config=config))
  out = call(bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g_raw"]), bf(x["beta_raw"]), jnp.asarray(x["A_log"]),
             jnp.asarray(x["dt_bias"]), jnp.asarray(x["cu"]), jnp.asarray(np.asarray(x["h0"], np.float32)),
             jnp.arange(n, dtype=jnp.int32), jnp.ones(n, bool))
  jax.block_until_ready(out)
  jax.effects_barrier()  # the traces are written by host callbacks after the kernels
  print(f"kda_prefill lens={args.lens} H={args.heads} on {jax.devices()[0].device_kind}, space {args.space}")
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

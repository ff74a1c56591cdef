"""KDA decode on one Hopper GPU: ``kda_decode`` (Mosaic GPU kernel) vs FLA's ``fused_recurrent_kda`` in one run.

Times every ``KdaTuning.decode_state_io`` path through the public ``kda_decode`` on the V-first pool, in place
through slot indices; shapes, columns and method: pallas_kernels/kda/README.md, "Benchmarks".

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/kda_decode.py [--quick] [--json PATH]``
(needs torch and the ``fla-core`` wheel for the peer; without them only our kernel is timed).
"""

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._harness import COPY_BYTES_PER_S, cupti_kernels, rotation_plan  # noqa: E402
from pallas_kernels.kda import KdaConfig, KdaTuning, default_tuning, kda_decode  # noqa: E402
from pallas_kernels.kda.config import DECODE_STATE_IO  # noqa: E402
from pallas_kernels.testing import kda_gate_params, kda_inputs  # noqa: E402

LB = -5.0
K = V = 128
GRAPH_CALLS = 20


def make_inputs(n: int, h: int, rot: int, state_dtype, seed: int = 0):
  """Raw inputs of ``n`` one-token sequences (``kda_inputs``, the model's gate parameters), a pool of ``n * rot``
  states of the size a unit-norm delta rule produces, and ``rot`` sets of ``n`` slots."""
  rng = np.random.default_rng(seed)
  data = kda_inputs(rng, (n,), h, K, V)
  data["A_log"], data["dt_bias"] = kda_gate_params(rng, h, K)
  data["pool"] = rng.standard_normal((n * rot, h, V, K)).astype(np.float32) / np.sqrt(K)
  # Each rotation r uses its own shuffled block of N slots.
  slots = np.stack([r * n + rng.permutation(n) for r in range(rot)]).astype(np.int32)
  return data, slots


def time_ours(data, slots, state_dtype, iters: int, state_io: str):
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  q, k, v, g, beta = (bf(data[x]) for x in ("q", "k", "v", "g_raw", "beta_raw"))
  a_log, dt_bias = jnp.asarray(data["A_log"]), jnp.asarray(data["dt_bias"])
  pool = jnp.asarray(data["pool"], state_dtype)
  slot_arrays = [jnp.asarray(s) for s in slots]
  config = KdaConfig(lower_bound=LB, state_dtype=state_dtype, impl="pallas",
                     tuning=KdaTuning(decode_state_io=state_io))

  def call(pool, state_indices):
    return kda_decode(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, state_pool=pool, state_indices=state_indices,
                      config=config)

  # Donating the pool makes the kernel update it in place, as inside the model's donated step.
  step = jax.jit(call, donate_argnums=(0,))
  o, pool = step(pool, slot_arrays[0])  # compile + warm up
  jax.block_until_ready((o, pool))
  o0 = np.asarray(o.astype(jnp.float32))
  with cupti_kernels() as records:
    for i in range(iters):
      o, pool = step(pool, slot_arrays[i % len(slot_arrays)])
    jax.block_until_ready((o, pool))
  names = sorted({name for name, _ in records})
  kernel_ms = sum(ms for _, ms in records) / iters
  walls = []
  for _ in range(3):
    t0 = time.perf_counter()
    for i in range(iters):
      o, pool = step(pool, slot_arrays[i % len(slot_arrays)])
    jax.block_until_ready((o, pool))
    walls.append((time.perf_counter() - t0) / iters * 1e3)
  return kernel_ms, statistics.median(walls), names, o0


def time_fla(data, slots, state_dtype, iters: int):
  import torch
  from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
  dev = torch.device("cuda")
  bf = lambda x: torch.from_numpy(x).to(dev, torch.bfloat16)[None]
  n = data["q"].shape[0]
  q, k, v, g, beta = (bf(data[x]) for x in ("q", "k", "v", "g_raw", "beta_raw"))
  a_log = torch.from_numpy(data["A_log"]).to(dev)
  dt_bias = torch.from_numpy(data["dt_bias"]).to(dev)
  tdt = torch.float32 if state_dtype == jnp.float32 else torch.bfloat16
  pool = torch.from_numpy(data["pool"]).to(dev, tdt)
  slot_t = [torch.from_numpy(s).to(dev) for s in slots]
  cu = torch.arange(n + 1, device=dev, dtype=torch.long)
  out = torch.empty_like(v)

  def call(i):
    fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, initial_state=pool,
                            inplace_final_state=True, state_v_first=True, cu_seqlens=cu,
                            ssm_state_indices=slot_t[i % len(slot_t)], use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LB,
                            out=out)

  call(0)
  torch.cuda.synchronize()
  o0 = out[0].float().cpu().numpy()

  def events(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
      start.record()
      fn(reps)
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)

  called = events(lambda r: [call(i) for i in range(r)], iters)
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    for i in range(GRAPH_CALLS):  # warm up on the side stream before capture
      call(i)
  torch.cuda.current_stream().wait_stream(stream)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for i in range(GRAPH_CALLS):
      call(i)
  reps = max(1, iters // GRAPH_CALLS)
  graph_ms = events(lambda r: [graph.replay() for _ in range(r)], reps) / GRAPH_CALLS
  with cupti_kernels() as records:
    for i in range(iters):
      call(i)
    torch.cuda.synchronize()
  kernel_ms = sum(ms for name, ms in records if "fused_recurrent" in name) / iters
  return called, graph_ms, kernel_ms, o0


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="N in {1, 256}, H = 96 only")
  parser.add_argument("--json", help="write the rows here")
  args = parser.parse_args()
  faulthandler.dump_traceback_later(540, exit=True)  # a deadlocked kernel would block forever
  try:
    import fla  # noqa: F401
    have_fla = True
  except ImportError as e:
    print(f"FLA peer unavailable ({e}); timing our kernel only", file=sys.stderr)
    have_fla = False
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  shapes = [(1, 96), (256, 96)] if args.quick else [(n, h) for h in (11, 96) for n in (1, 8, 64, 256)]
  rows = []
  path_cols = " ".join(f"{io + ' us':>11}" for io in DECODE_STATE_IO)
  header = (f"{'N':>4} {'H':>3} {'state':>5} | {path_cols} {'auto':>8} {'called':>7} "
            f"{'GB/s':>6} {'copy%':>5} | {'FLA called':>10} {'graph':>7} {'kernel':>7} | {'vs FLA':>6} {'max|do|':>8}")
  print(header)
  for n, h in shapes:
    for state_dtype in (jnp.float32, jnp.bfloat16):
      itemsize = jnp.dtype(state_dtype).itemsize
      state_bytes = n * h * V * K * itemsize
      rot, iters = rotation_plan(state_bytes)
      data, slots = make_inputs(n, h, rot, state_dtype)
      paths = {io: time_ours(data, slots, state_dtype, iters, io) for io in DECODE_STATE_IO}
      ours, ours_called, _, _ = min(paths.values(), key=lambda r: r[0])
      row = dict(N=n, H=h, state=jnp.dtype(state_dtype).name, **{f"{io}_us": r[0] * 1e3 for io, r in paths.items()},
                 auto=default_tuning(num_seqs=n, num_heads=h, key_dim=K, value_dim=V,
                                         state_dtype=state_dtype).decode_state_io, ours_us=ours * 1e3,
                 ours_called_us=ours_called * 1e3, gbps=2 * state_bytes / (ours * 1e-3) / 1e9,
                 kernels=sorted({name for r in paths.values() for name in r[2]}), iters=iters, rotations=rot)
      row["copy_frac"] = row["gbps"] * 1e9 / COPY_BYTES_PER_S
      if have_fla:
        called, graph_ms, kernel_ms, o_fla = time_fla(data, slots, state_dtype, iters)
        best = min(graph_ms, kernel_ms) if kernel_ms > 0 else graph_ms
        row.update(fla_called_us=called * 1e3, fla_graph_us=graph_ms * 1e3, fla_kernel_us=kernel_ms * 1e3,
                   vs_fla=best / ours,
                   max_abs_diff_o=max(float(np.abs(r[3] - o_fla).max()) for r in paths.values()))
      rows.append(row)
      fla_cols = (f"{row['fla_called_us']:10.1f} {row['fla_graph_us']:7.1f} {row['fla_kernel_us']:7.1f} | "
                  f"{row['vs_fla']:6.2f} {row['max_abs_diff_o']:8.1e}") if have_fla else "-"
      path_us = " ".join(f"{row[io + '_us']:11.1f}" for io in DECODE_STATE_IO)
      print(f"{n:4d} {h:3d} {row['state'][:5]:>5} | {path_us} {row['auto']:>8} {row['ours_called_us']:7.1f} "
            f"{row['gbps']:6.0f} {100 * row['copy_frac']:5.1f} | {fla_cols}", flush=True)
  print("kernels in our call:", sorted({name for r in rows for name in r["kernels"]}))
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()

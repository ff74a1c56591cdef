"""The KDA short convolution (Mosaic GPU kernel and pure JAX) next to the KDA op it feeds, on one GPU, in the same run.

A pure-JAX short convolution would do if it were not a bottleneck of the KDA layer. This script measures
that: ``short_conv_prefill`` against ``kda_prefill`` (impl pallas) on the same tokens,
and ``short_conv_update`` against ``kda_decode`` (impl pallas, f32 state) on the same batch. Every row times the
conv twice, the Mosaic GPU kernel (``impl="pallas"``, the default on Hopper, used for ``conv share``) and the
pure-JAX ``impl="xla"``, and prints both and ``xla/pallas``, the kernel's speedup. The conv runs over
the packed q|k|v projection (``D = 3 H K`` channels, width W = 4, SiLU, bf16 rows and bf16 conv pool, the K3
defaults), reading and writing its conv-state slots in place (donated pool); the KDA op reads and writes its
state slots in place.

Every time but the prefill KDA op is device time per call from CUPTI (all kernels a jitted call launches,
mean over the timed calls): the decode ops take microseconds, where Python dispatch would hide them. The
prefill KDA op (milliseconds) is timed by ``kda_prefill.py``'s own method. Decode rotates pool slots
(as ``kda_decode.py``) so the states are not L2 resident. ``conv share`` = conv / (conv + KDA op): the part
of a KDA layer's recurrent core that the convolution takes. Bytes: the conv moves ``x`` in and out
(``2 T D`` bf16) plus its pool rows; ``GB/s`` and ``copy%`` (of 4.27 TB/s) say how close it runs to a copy.

The kernel runs the heuristic grid (``pallas_kernels.short_conv.default_tuning``) unless ``--block``, ``--rows``
or ``--token-block`` set a ``ShortConvTuning`` (a None field keeps the heuristic).

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/short_conv.py [--json PATH] [--block BD] [--rows R]
[--token-block BT]``.
"""

import argparse
import faulthandler
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _harness, kda_decode, kda_prefill  # noqa: E402
from pallas_kernels.short_conv import (ShortConvConfig, ShortConvTuning, short_conv_prefill,  # noqa: E402
                                      short_conv_update)

W = 4
K = kda_decode.K
BF16 = jnp.bfloat16


def device_ms(step, pool, feeds, iters: int) -> float:
  """Mean device ms per call of ``y, pool = step(pool, feeds[i % len(feeds)])`` (the pool donated), after one
  untimed call."""
  pool = jax.block_until_ready(step(pool, feeds[0]))[1]
  with _harness.cupti_kernels() as records:
    for i in range(iters):
      out = step(pool, feeds[i % len(feeds)])
      pool = out[1]
    jax.block_until_ready(out)
  return sum(ms for _, ms in records) / iters


def conv_bytes(tokens: int, seqs: int, d: int) -> int:
  """Bytes the conv moves: ``x`` in and ``y`` out, and ``W - 1`` pool rows read and written per sequence (bf16)."""
  return (2 * tokens * d + 2 * seqs * (W - 1) * d) * 2


def conv_prefill_ms(lens, h: int, iters: int, config: ShortConvConfig) -> float:
  """``short_conv_prefill(config=config)`` over ``sum(lens)`` tokens of ``3 h K`` channels, every sequence with
  a history."""
  rng = np.random.default_rng(0)
  n, t, d = len(lens), int(sum(lens)), 3 * h * K
  x = jnp.asarray(rng.standard_normal((t, d)), BF16)
  weight = jnp.asarray(rng.standard_normal((d, W)) / np.sqrt(W), BF16)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  slots, history = jnp.arange(n, dtype=jnp.int32), jnp.ones(n, bool)
  step = jax.jit(lambda pool, _: short_conv_prefill(
      x, weight, cu_seqlens=cu, conv_pool=pool, state_indices=slots, has_initial_state=history, config=config),
      donate_argnums=(0,))
  pool = jnp.asarray(rng.standard_normal((n, W - 1, d)), BF16)
  return device_ms(step, pool, [None], iters)


def kda_prefill_ms(lens, h: int, iters: int) -> float:
  """``kda_prefill`` (impl pallas, f32 state) timed as ``kda_prefill.py`` times it (inputs passed as arguments,
  wall time of back-to-back calls): closing over the inputs as jit constants and summing CUPTI records varied
  from run to run far more than that, and ran slower."""
  return kda_prefill.ours(kda_prefill.make_inputs(lens, h), lens, h, iters=iters)[0]


def conv_decode_ms(n: int, h: int, rot: int, iters: int, config: ShortConvConfig) -> float:
  """``short_conv_update(config=config)`` of ``n`` rows of ``3 h K`` channels, slots rotated over ``rot`` blocks
  of ``n``."""
  rng = np.random.default_rng(1)
  d = 3 * h * K
  x = jnp.asarray(rng.standard_normal((n, d)), BF16)
  weight = jnp.asarray(rng.standard_normal((d, W)) / np.sqrt(W), BF16)
  feeds = [jnp.asarray(r * n + rng.permutation(n), jnp.int32) for r in range(rot)]
  step = jax.jit(lambda pool, slots: short_conv_update(x, weight, conv_pool=pool, state_indices=slots,
                                                       config=config), donate_argnums=(0,))
  pool = jnp.asarray(rng.standard_normal((n * rot, W - 1, d)), BF16)
  return device_ms(step, pool, feeds, iters)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write the rows here")
  parser.add_argument("--phases", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"],
                      help="which rows to time, in this order")
  parser.add_argument("--quick", action="store_true",
                      help="one row per phase (decode N=256 H=96, prefill N=1 T=8192 H=96), as make gpu-check runs it")
  parser.add_argument("--block", type=int, help="ShortConvTuning.block: kernel channels per program")
  parser.add_argument("--rows", type=int, help="ShortConvTuning.rows: kernel decode rows per program")
  parser.add_argument("--token-block", type=int, help="ShortConvTuning.token_block: kernel prefill tokens per program")
  args = parser.parse_args(argv)
  kernel = ShortConvConfig(impl="pallas",
                           tuning=ShortConvTuning(block=args.block, rows=args.rows, token_block=args.token_block))
  xla = ShortConvConfig(impl="xla")
  faulthandler.dump_traceback_later(540, exit=True)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  rows = []
  print(f"{'phase':>7} {'shape':>18} | {'conv us':>9} {'GB/s':>6} {'copy%':>5} | {'xla us':>8} {'xla/pallas':>10} | "
        f"{'KDA op us':>9} | {'conv share':>10}")

  def report(**row):
    row["conv_share"] = row["conv_us"] / (row["conv_us"] + row["kda_us"])
    rows.append(row)
    shape = f"N={row['N']} T={row['T']} H={row['H']}"
    xla = f"{row['conv_xla_us']:8.1f} {row['conv_xla_us'] / row['conv_us']:10.2f}"
    print(f"{row['phase']:>7} {shape:>18} | {row['conv_us']:9.1f} {row['conv_gbps']:6.0f} "
          f"{100 * row['conv_gbps'] * 1e9 / _harness.COPY_BYTES_PER_S:5.1f} | {xla} | {row['kda_us']:9.1f} | "
          f"{row['conv_share']:10.1%}", flush=True)

  def decode_rows():
    for n, h in ((256, 96),) if args.quick else ((1, 96), (256, 96), (8, 96), (64, 96), (256, 11)):
      rot, iters = _harness.rotation_plan(n * h * K * K * 4)
      conv = conv_decode_ms(n, h, rot, iters, kernel)
      conv_xla = conv_decode_ms(n, h, rot, iters, xla)
      data, slots = kda_decode.make_inputs(n, h, rot, jnp.float32)
      op = kda_decode.time_ours(data, slots, jnp.float32, iters, None)[0]  # the default path rule
      report(phase="decode", N=n, T=n, H=h, conv_us=conv * 1e3, conv_xla_us=conv_xla * 1e3, kda_us=op * 1e3,
             conv_gbps=conv_bytes(n, n, 3 * h * K) / (conv * 1e-3) / 1e9)

  def prefill_rows():
    for lens, h in (((8192,), 96),) if args.quick else (((8192,), 96), ((1024,) * 8, 96), ((8192,), 11)):
      conv = conv_prefill_ms(lens, h, 20, kernel)
      conv_xla = conv_prefill_ms(lens, h, 20, xla)
      op = kda_prefill_ms(lens, h, iters=10)
      report(phase="prefill", N=len(lens), T=sum(lens), H=h, conv_us=conv * 1e3, conv_xla_us=conv_xla * 1e3,
             kda_us=op * 1e3, conv_gbps=conv_bytes(sum(lens), len(lens), 3 * h * K) / (conv * 1e-3) / 1e9)

  for phase in args.phases:
    {"decode": decode_rows, "prefill": prefill_rows}[phase]()
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()

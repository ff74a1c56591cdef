"""wgmma rates on one Hopper GPU in the MLA decode's shapes: what one warpgroup's product costs from issue to
result, and what two warpgroups of one SM get side by side.

Run on the GPU machine from the repository root::

  PYTHONPATH=. python3 benchmarks/wgmma_rates.py [--cases qk pv ...] [--iters 512] [--json FILE]

Every CTA (one per SM) loads its operands into SMEM once, then each of its W warpgroups runs ``--iters`` iterations
of one product into an accumulator carried from iteration to iteration: an iteration waits for the previous
product's result, so it costs one issue-to-result round trip, as a decode kernel's page loop pays it. M = 64 rows:

- ``qk``: ``S[64, N] += q[64, 576] @ tile[N, 576]^T``, both from SMEM (the wide kernel's QK at N = 64: 36 k16 steps).
- ``qk_rq``: the same with q from registers (loaded once).
- ``pv``: ``O[64, N] += P[64, 64] @ V[64, N]`` with V as the page tile holds it (N columns of a 576-wide row:
  MN-major), as each compute warpgroup's half of ``P @ V`` at N = 256.
- ``pv_kt``: the same with V^T stored ``[N, 64]`` (K-major).
- ``qk+pv``: warpgroup 0 runs ``qk`` (N = 64) and warpgroup 1 ``pv`` (N = 256) side by side: the leader's QK beside
  the follower's half of ``P @ V``.

Per case it prints the median time of a call (after a warm-up), kilocycles per iteration per CTA at the SM clock
sampled during the calls (nvidia-smi; the boost clock without it), and TFLOP/s counting every warpgroup's products;
each output is checked against NumPy first. ``--impl interpret`` is not offered: the cases are about the GPU's
timing, and interpret mode cannot take an operand from registers (``tests/test_benchmark_scripts.py`` lowers every
case for sm_90a instead).
"""

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks._harness import gpu_clocks
from pallas_kernels import util

DIM = 576  # a latent cache row: q and the page tile are [*, DIM]
ROWS = 64  # M of every product (a 64-row head tile)
PAGE = 64  # K of P @ V (a page's tokens)
BOOST_MHZ = 1980.0


@dataclasses.dataclass(frozen=True)
class Case:
  """One timed product: ``kind`` (the module docstring's names), its N, and how many warpgroups run it side by
  side (``qk+pv``: two, each its own product)."""
  kind: str
  n: int
  warpgroups: int

  @property
  def name(self) -> str:
    return f"{self.kind} N={self.n} W={self.warpgroups}"

  def flops(self) -> int:
    """The FLOPs of one iteration of one CTA (every warpgroup's product)."""
    qk, pv = 2 * ROWS * 64 * DIM, 2 * ROWS * 256 * PAGE
    if self.kind == "qk+pv":
      return qk + pv
    k = DIM if self.kind.startswith("qk") else PAGE
    return 2 * ROWS * self.n * k * self.warpgroups


CASES = (Case("qk", 64, 1), Case("qk", 64, 2), Case("qk", 128, 1), Case("qk", 128, 2), Case("qk_rq", 64, 1),
         Case("qk_rq", 64, 2), Case("pv", 64, 1), Case("pv", 256, 1), Case("pv", 256, 2), Case("pv_kt", 64, 1),
         Case("pv_kt", 256, 1), Case("qk+pv", 256, 2))
KINDS = tuple(dict.fromkeys(c.kind for c in CASES))


def _operand_shapes(case: Case) -> tuple[tuple[int, int], tuple[int, int]]:
  """The shapes of a (q or P, in its first 64 columns) and b (the page tile, or V^T for ``pv_kt``)."""
  if case.kind == "pv_kt":
    return (ROWS, DIM), (case.n, PAGE)
  if case.kind in ("pv", "qk+pv"):  # a page tile: V is its first N columns (qk+pv: QK's tile at N = 64 too)
    return (ROWS, DIM), (PAGE, DIM)
  return (ROWS, DIM), (case.n, DIM)


def _body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, out_smem, bar, *, case: Case, iters: int):
  wg = lax.axis_index("wg")

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar)
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar)

  plgpu.barrier_wait(bar)

  def warpgroup(w: int):
    kind = ("qk", "pv")[w] if case.kind == "qk+pv" else case.kind
    n = (64, 256)[w] if case.kind == "qk+pv" else case.n
    if kind in ("qk", "qk_rq"):
      a = plgpu.load(a_smem, (), layout=plgpu.Layout.WGMMA, optimized=False) if kind == "qk_rq" else a_smem
      b = b_smem.T
    else:
      a = a_smem.at[:, pl.ds(0, PAGE)]
      b = b_smem.T if kind == "pv_kt" else b_smem.at[:, pl.ds(0, n)]

    def product(acc_ref):
      plgpu.wgmma(acc_ref, a, b)

    acc = plgpu.layout_cast(jnp.zeros((ROWS, n), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, iters, lambda _, acc: util.accumulate(product, acc, from_inits=True)[0], acc)
    out_smem.at[w][...] = acc.sum(axis=1)  # row sums: a [64] check value per warpgroup
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[w], out_gmem.at[lax.axis_index("c"), w])
    plgpu.wait_smem_to_gmem(0)

  for w in range(case.warpgroups):
    pl.when(wg == w)(functools.partial(warpgroup, w))


def make(case: Case, iters: int, ctas: int):
  """The jitted kernel of ``case``: ``(a, b) -> [ctas, W, 64]`` f32 row sums of each warpgroup's accumulator."""
  (a_shape, b_shape) = _operand_shapes(case)
  smem = lambda shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=util.smem_transforms(jnp.bfloat16, shape[1]))
  kernel = plgpu.kernel(
      functools.partial(_body, case=case, iters=iters),
      out_type=jax.ShapeDtypeStruct((ctas, case.warpgroups, ROWS), jnp.float32),
      grid=(ctas,), grid_names=("c",), num_threads=case.warpgroups, thread_name="wg",
      scratch_types=(smem(a_shape), smem(b_shape), plgpu.SMEM((case.warpgroups, ROWS), jnp.float32),
                     plgpu.Barrier(num_arrivals=2)),
      compiler_params=util.compiler_params())
  return jax.jit(kernel)


def inputs(case: Case) -> tuple[jax.Array, jax.Array]:
  a_shape, b_shape = _operand_shapes(case)
  a = jax.random.normal(jax.random.key(0), a_shape, jnp.float32) / 64
  b = jax.random.normal(jax.random.key(1), b_shape, jnp.float32) / 64
  return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)


def expected(case: Case, a: jax.Array, b: jax.Array, iters: int) -> np.ndarray:
  """``[W, 64]``: each warpgroup's row sums after ``iters`` products, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  products = {"qk": lambda n: a @ b[:n].T, "qk_rq": lambda n: a @ b[:n].T, "pv_kt": lambda n: a[:, :PAGE] @ b.T,
              "pv": lambda n: a[:, :PAGE] @ b[:PAGE, :n]}
  parts = ([("qk", 64), ("pv", 256)] if case.kind == "qk+pv" else [(case.kind, case.n)] * case.warpgroups)
  return np.stack([products[k](n).sum(axis=1) * iters for k, n in parts])


def measure(case: Case, iters: int, ctas: int, reps: int = 5) -> dict:
  """Checks ``case`` against NumPy, then times it: a row of the table."""
  f = make(case, iters, ctas)
  a, b = inputs(case)
  got = np.asarray(f(a, b))
  want = expected(case, a, b, iters)
  err = float(np.max(np.abs(got - want[None])) / np.max(np.abs(want)))
  if not err < 1e-2:  # bf16 operands, f32 sums; NaN fails too
    raise AssertionError(f"{case.name}: relative error {err:.3g} against NumPy")
  times = []
  with gpu_clocks() as clocks:
    for _ in range(reps):
      start = time.perf_counter()
      jax.block_until_ready(f(a, b))
      times.append(time.perf_counter() - start)
  s = statistics.median(times)
  mhz = clocks.sm_mhz if clocks.samples else BOOST_MHZ
  return dict(case=case.name, kind=case.kind, n=case.n, warpgroups=case.warpgroups, us=s * 1e6, sm_mhz=mhz,
              kcycles_per_iter=s * mhz * 1e6 / iters / 1e3, tflops=case.flops() * iters * ctas / s / 1e12,
              rel_err=err)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", choices=KINDS, default=list(KINDS), help="kinds of product to time")
  parser.add_argument("--iters", type=int, default=512, help="products per warpgroup per call")
  parser.add_argument("--json", help="also append one JSON line per case to this file")
  args = parser.parse_args(argv)
  if args.iters < 1:
    parser.error(f"--iters must be >= 1, got {args.iters}")
  ctas = util.NUM_SMS
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {ctas} CTAs, {args.iters} iterations", flush=True)
  print(f"{'case':>16} {'us':>9} {'MHz':>6} {'kcyc/iter':>9} {'TFLOP/s':>8}", flush=True)
  for case in (c for c in CASES if c.kind in args.cases):
    row = measure(case, args.iters, ctas)
    print(f"{row['case']:>16} {row['us']:9.1f} {row['sm_mhz']:6.0f} {row['kcycles_per_iter']:9.3f} "
          f"{row['tflops']:8.1f}", flush=True)
    if args.json:
      with open(args.json, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])

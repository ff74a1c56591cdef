"""wgmma rates on one Hopper GPU in the MLA decode's shapes: what one warpgroup's product costs from issue to
result, and what two warpgroups of one SM get side by side.

Run on the GPU machine from the repository root::

  PYTHONPATH=. python3 benchmarks/wgmma_rates.py [--cases qk pv ...] [--iters 512] [--json FILE]

Every CTA (one per SM) loads its operands into SMEM once, then each of its W warpgroups runs ``--iters`` iterations
of its product (or products, each into its own accumulator) into accumulators carried from iteration to iteration:
an iteration waits for the previous one's results, so it costs one issue-to-result round trip, as a decode kernel's
page loop pays it. M = 64 rows:

- ``qk``: ``S[64, N] += q[64, 576] @ tile[N, 576]^T``, both from SMEM (the wide kernel's QK at N = 64: 36 k16 steps).
- ``qk_rq``: the same with q from registers (loaded once).
- ``pv``: ``O[64, N] += P[64, 64] @ V[64, N]`` with V as the page tile holds it (N columns of a 576-wide row:
  MN-major), as each compute warpgroup's half of ``P @ V`` at N = 256.
- ``pv_kt``: the same with V^T stored ``[N, 64]`` (K-major).
- ``pv4``: ``pv`` at N = 256 as four N = 64 products into four accumulators, issued back to back.
- ``qk,pv``: one warpgroup issues ``qk`` (N = 64) and ``pv`` (N = 256) back to back and awaits both: the leader's
  two round trips of a page as one.
- ``qk+pv``: warpgroup 0 runs ``qk`` (N = 64) and warpgroup 1 ``pv`` (N = 256) side by side: the leader's QK beside
  the follower's half of ``P @ V``.
- ``qk8``: the narrow fp8 kernel's QK over a page's latent columns: ``S^T[64 tokens, N] = tile[64, 512] @ q[N,
  512]^T``, both e4m3 from SMEM (16 k32 steps; N = 2 x heads, q's two parts). An e4m3 sum keeps about 14 bits, so
  as in the kernel each iteration's products go to a fresh accumulator that is added to the carried one in f32.
  Timed at N = 16 and 32, by one warpgroup and by two side by side: what a QK step costs by its N, and whether two
  warpgroups' steps overlap on the SM's tensor cores; and at N = 64 and 128, the width of a step with the heads
  as M and a page's tokens (or two pages') as N.

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

from benchmarks._harness import gpu_clocks, positive_int
from pallas_kernels import util

DIM = 576  # a latent cache row: q and the page tile are [*, DIM]
ROWS = 64  # M of every product (a 64-row head tile)
PAGE = 64  # K of P @ V (a page's tokens)
LATENT = 512  # K of ``qk8``: a page's latent columns (e4m3 bytes, whole 128-byte swizzle rows)
BOOST_MHZ = 1980.0


@dataclasses.dataclass(frozen=True)
class Part:
  """One product into its own accumulator: ``kind`` (qk, qk_rq, qk8, pv or pv_kt), its N, and for pv its first column
  of V."""
  kind: str
  n: int
  col: int = 0

  def flops(self) -> int:
    return 2 * ROWS * self.n * (LATENT if self.kind == "qk8" else DIM if self.kind.startswith("qk") else PAGE)


@dataclasses.dataclass(frozen=True)
class Case:
  """One timed case: ``kind`` (the module docstring's names), its N, and how many warpgroups run it side by side
  (``qk+pv``: two, each its own product)."""
  kind: str
  n: int
  warpgroups: int

  @property
  def name(self) -> str:
    return f"{self.kind} N={self.n} W={self.warpgroups}"

  def parts(self, w: int) -> tuple[Part, ...]:
    """Warpgroup w's products, issued back to back and awaited together each iteration."""
    if self.kind == "qk+pv":
      return (Part("qk", 64),) if w == 0 else (Part("pv", 256),)
    if self.kind == "qk,pv":
      return Part("qk", 64), Part("pv", 256)
    if self.kind == "pv4":
      return tuple(Part("pv", 64, 64 * j) for j in range(self.n // 64))
    return (Part(self.kind, self.n),)

  def flops(self) -> int:
    """The FLOPs of one iteration of one CTA (every warpgroup's products)."""
    return sum(p.flops() for w in range(self.warpgroups) for p in self.parts(w))


CASES = (Case("qk", 64, 1), Case("qk", 64, 2), Case("qk", 128, 1), Case("qk", 128, 2), Case("qk_rq", 64, 1),
         Case("qk_rq", 64, 2), Case("pv", 64, 1), Case("pv", 256, 1), Case("pv", 256, 2), Case("pv_kt", 64, 1),
         Case("pv_kt", 256, 1), Case("pv4", 256, 1), Case("qk,pv", 256, 1), Case("qk+pv", 256, 2),
         Case("qk8", 16, 1), Case("qk8", 32, 1), Case("qk8", 16, 2), Case("qk8", 32, 2), Case("qk8", 64, 1),
         Case("qk8", 128, 1), Case("qk8", 64, 2))
KINDS = tuple(dict.fromkeys(c.kind for c in CASES))


def _operand_shapes(case: Case) -> tuple[tuple[int, int], tuple[int, int]]:
  """The shapes of a (q or P, in its first 64 columns) and b (the page tile: its rows are QK's N, or V^T for
  ``pv_kt``)."""
  if case.kind == "pv_kt":
    return (ROWS, DIM), (case.n, PAGE)
  if case.kind == "qk8":
    return (ROWS, LATENT), (case.n, LATENT)
  if case.kind in ("qk", "qk_rq"):
    return (ROWS, DIM), (case.n, DIM)
  return (ROWS, DIM), (PAGE, DIM)  # V is the tile's first columns; a QK beside it is at N = 64


def _body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, out_smem, bar, *, case: Case, iters: int):
  wg = lax.axis_index("wg")

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar)
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar)

  plgpu.barrier_wait(bar)

  def operands(part: Part):
    if part.kind == "qk_rq":
      return plgpu.load(a_smem, layout=plgpu.Layout.WGMMA, optimized=False), b_smem.T
    if part.kind in ("qk", "qk8"):
      return a_smem, b_smem.T
    p = a_smem.at[:, pl.ds(0, PAGE)]
    return p, (b_smem.T if part.kind == "pv_kt" else b_smem.at[:, pl.ds(part.col, part.n)])

  def warpgroup(w: int):
    parts = case.parts(w)
    pairs = [operands(part) for part in parts]

    def products(*acc_refs):
      for acc_ref, (a, b) in zip(acc_refs, pairs):
        plgpu.wgmma(acc_ref, a, b)

    def fresh(accs):  # e4m3: each iteration's products in accumulators of their own, added in f32
      def run(*acc_refs):
        products(*acc_refs)
        return tuple(r[...] for r in acc_refs)
      page = pl.run_scoped(run, *(plgpu.ACC((ROWS, part.n), jnp.float32) for part in parts))
      return tuple(acc + x for acc, x in zip(accs, page))

    accs = tuple(plgpu.layout_cast(jnp.zeros((ROWS, part.n), jnp.float32), plgpu.Layout.WGMMA) for part in parts)
    step = fresh if case.kind == "qk8" else lambda accs: util.accumulate(products, *accs, from_inits=True)
    accs = lax.fori_loop(0, iters, lambda _, accs: step(accs), accs)
    out_smem.at[w][...] = sum(acc.sum(axis=1) for acc in accs)  # row sums: a [64] check value per warpgroup
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[w], out_gmem.at[lax.axis_index("c"), w])
    plgpu.wait_smem_to_gmem(0)

  for w in range(case.warpgroups):
    pl.when(wg == w)(functools.partial(warpgroup, w))


def make(case: Case, iters: int, ctas: int):
  """The jitted kernel of ``case``: ``(a, b) -> [ctas, W, 64]`` f32 row sums of each warpgroup's accumulator."""
  (a_shape, b_shape) = _operand_shapes(case)
  dtype = operand_dtype(case)
  smem = lambda shape: plgpu.SMEM(shape, dtype, transforms=util.smem_transforms(dtype, shape[1]))
  kernel = plgpu.kernel(
      functools.partial(_body, case=case, iters=iters),
      out_type=jax.ShapeDtypeStruct((ctas, case.warpgroups, ROWS), jnp.float32),
      grid=(ctas,), grid_names=("c",), num_threads=case.warpgroups, thread_name="wg",
      scratch_types=(smem(a_shape), smem(b_shape), plgpu.SMEM((case.warpgroups, ROWS), jnp.float32),
                     plgpu.Barrier(num_arrivals=2)),
      compiler_params=util.compiler_params())
  return jax.jit(kernel)


def operand_dtype(case: Case) -> jnp.dtype:
  """The operands' dtype: e4m3 for ``qk8``, bf16 for the rest."""
  return jnp.dtype(jnp.float8_e4m3fn if case.kind == "qk8" else jnp.bfloat16)


def inputs(case: Case) -> tuple[jax.Array, jax.Array]:
  """Random operands in the case's dtype (e4m3: N(0, 1), well inside its normal range; bf16: N(0, 1) / 64)."""
  a_shape, b_shape = _operand_shapes(case)
  spread = 1.0 if case.kind == "qk8" else 1 / 64
  a = jax.random.normal(jax.random.key(0), a_shape, jnp.float32) * spread
  b = jax.random.normal(jax.random.key(1), b_shape, jnp.float32) * spread
  return a.astype(operand_dtype(case)), b.astype(operand_dtype(case))


def expected(case: Case, a: jax.Array, b: jax.Array, iters: int) -> np.ndarray:
  """``[W, 64]``: each warpgroup's row sums (over all its accumulators) after ``iters`` iterations, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  products = {"qk": lambda p: a @ b[:p.n].T, "qk_rq": lambda p: a @ b[:p.n].T, "qk8": lambda p: a @ b[:p.n].T,
              "pv_kt": lambda p: a[:, :PAGE] @ b.T,
              "pv": lambda p: a[:, :PAGE] @ b[:PAGE, p.col:p.col + p.n]}
  return np.stack([sum(products[p.kind](p).sum(axis=1) for p in case.parts(w)) * iters
                   for w in range(case.warpgroups)])


def measure(case: Case, iters: int, ctas: int, reps: int = 5) -> dict:
  """Checks ``case`` against NumPy, then times it: a row of the table."""
  f = make(case, iters, ctas)
  a, b = inputs(case)
  got = np.asarray(f(a, b))
  want = expected(case, a, b, iters)
  err = float(np.max(np.abs(got - want[None])) / np.max(np.abs(want)))
  if not err < 1e-2:  # bf16 operands and f32 sums, or e4m3 ones and sums of about 14 bits; NaN fails too
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
  parser.add_argument("--iters", type=positive_int, default=512, help="products per warpgroup per call")
  parser.add_argument("--json", help="also append one JSON line per case to this file")
  args = parser.parse_args(argv)
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

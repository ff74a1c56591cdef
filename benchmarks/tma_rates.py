"""TMA streaming rates of paged-cache formats on one Hopper GPU: how fast the MLA decode's grid could read its pages
if it did nothing else, per page format and load pattern.

Run on the GPU machine from the repository root::

  PYTHONPATH=. python3 benchmarks/tma_rates.py [--cases f8_row_values ...] [--slots 2 3 4] [--json FILE]

Each program (the decode's grid: ``--splits`` x ``--batch``, one warpgroup) streams its ``--pages`` pages, scattered
over the whole cache by a random block table, into a ring of ``slots`` SMEM slots: it issues the first ``slots``
pages, then waits for each page and issues the next one into its slot at once, so ``slots`` pages are always in
flight. No compute: the time is what the page format's loads cost at best. Cases (``CASES``):

- ``f8_row_values``: the fp8 rows of ``pallas_kernels/mla/cache_format.py`` (640 bytes: 576 values, then the scales
  and zeros), values only, ``[64, 576]`` boxes with the 64-byte swizzle.
- ``f8_row_values_words``: the same plus each row's scale words (``[64, 8]`` f32), the fp8 kernel's loads.
- ``f8_row_whole`` / ``f8_row_whole_s128``: the whole 640-byte rows in one box, 64- or 128-byte swizzle.
- ``f8_scales_apart``: a cache format with the scales apart from the rows: values ``[pages, 64, 576]`` e4m3
  (``[64, 576]`` boxes, 64-byte swizzle) and scales ``[pages, 1, 128]`` f32, a page's 64 tokens' two scales in one
  512-byte box. (One ``[pages, 65, 576]`` array, the scales in a 65th row, cannot be loaded in tiled boxes: Mosaic
  GPU needs the rows of a tiled TMA's source in whole groups of 8.)
- ``bf16_row``: the bf16 cache's ``[64, 576]`` page, 128-byte swizzle.

Per case and ring depth it prints the median time of a call and the bandwidth of the bytes the boxes name, beside
the device-to-device copy bandwidth measured in the same process (``mla_decode.copy_bandwidth``).
"""

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.mla_decode import copy_bandwidth, time_call
from pallas_kernels.mla_prefill.kernel import SMEM_LIMIT  # the SMEM a block may take on a Hopper SM

PAGE = 64  # tokens a page
VALUES = 576  # a row's latent + rope values
ROW_BYTES = 640  # an fp8 row of cache_format: values, two f32 scales, zeros to whole 64-byte tiles
WORDS0 = VALUES // 4  # the scale words' first f32 column in an fp8 row
SMEM_OTHER = 1024  # beside the ring: the output row, the barriers and alignment


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  dtype: str  # the cache's dtype: "float8_e4m3fn" or "bfloat16"
  cols: int  # bytes (fp8) or elements (bf16) of each row that the page box takes
  swizzle: int  # bytes
  words: bool = False  # also each row's two scale words, as f32 ([64, 8] box)
  scales_apart: bool = False  # a second array [pages, 1, 128] f32: one more box a page (512 bytes)

  def cache_shape(self, pages: int) -> tuple[int, ...]:
    if self.dtype == "bfloat16":
      return pages, PAGE, VALUES
    return (pages, PAGE, VALUES) if self.scales_apart else (pages, PAGE, ROW_BYTES)

  def page_bytes(self) -> int:
    """The bytes of one page that the boxes name."""
    return (PAGE * self.cols * jnp.dtype(self.dtype).itemsize + (PAGE * 8 * 4 if self.words else 0)
            + (2 * PAGE * 4 if self.scales_apart else 0))

  def fits(self, slots: int) -> bool:
    """Whether a ring of ``slots`` pages (each with its boxes' bytes) fits in a Hopper SM's shared memory."""
    return slots * self.page_bytes() + SMEM_OTHER <= SMEM_LIMIT


CASES = (Case("f8_row_values", "float8_e4m3fn", VALUES, 64),
         Case("f8_row_values_words", "float8_e4m3fn", VALUES, 64, words=True),
         Case("f8_row_whole", "float8_e4m3fn", ROW_BYTES, 64),
         Case("f8_row_whole_s128", "float8_e4m3fn", ROW_BYTES, 128),
         Case("f8_scales_apart", "float8_e4m3fn", VALUES, 64, scales_apart=True),
         Case("bf16_row", "bfloat16", VALUES, 128))


def make(case: Case, slots: int, batch: int, splits: int, pages: int):
  """A jitted ``f(cache, table[, scales]) -> zeros [splits, batch, 128]`` (``inputs``) that streams every program's
  ``pages`` pages (``table [batch, splits * pages]``) through a ring of ``slots`` slots."""
  dtype = jnp.dtype(case.dtype)
  side = case.words or case.scales_apart  # a second load a page: the rows' scale words or the page's scales

  def body(cache_ref, *refs):
    if side:
      side_ref, table_ref, out_ref, ring, side_ring, bar, side_bar, out_smem = refs
    else:
      table_ref, out_ref, ring, bar, out_smem = refs
    split, b = lax.axis_index("split"), lax.axis_index("b")

    def issue(i):
      slot = lax.rem(i, slots)
      page = table_ref[b, split * pages + i]
      if case.words:
        plgpu.copy_gmem_to_smem(side_ref.at[page, :, pl.ds(WORDS0, 8)], side_ring.at[slot], side_bar.at[slot])
      if case.scales_apart:
        plgpu.copy_gmem_to_smem(side_ref.at[page], side_ring.at[slot], side_bar.at[slot])
      plgpu.copy_gmem_to_smem(cache_ref.at[page, pl.ds(0, PAGE), pl.ds(0, case.cols)], ring.at[slot],
                              bar.at[slot])

    for i in range(slots):
      issue(i)

    @pl.loop(0, pages)
    def _(i):
      slot = lax.rem(i, slots)
      plgpu.barrier_wait(bar.at[slot])
      if side:
        plgpu.barrier_wait(side_bar.at[slot])
      pl.when(i + slots < pages)(lambda: issue(i + slots))

    out_smem[...] = jnp.zeros(out_smem.shape, jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[split, b])
    plgpu.wait_smem_to_gmem(0)

  tiling = (plgpu.TilingTransform((8, case.swizzle // dtype.itemsize)), plgpu.SwizzleTransform(case.swizzle))
  scratch = [plgpu.SMEM((slots, PAGE, case.cols), dtype, transforms=tiling)]
  if side:
    scratch.append(plgpu.SMEM((slots, PAGE, 8) if case.words else (slots, 1, 2 * PAGE), jnp.float32))
  scratch += [plgpu.Barrier(num_barriers=slots)] * (2 if side else 1) + [plgpu.SMEM((128,), jnp.float32)]
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((splits, batch, 128), jnp.float32),
                        grid=(splits, batch), grid_names=("split", "b"), scratch_types=tuple(scratch),
                        kernel_name="tma_rates")

  def call(cache, table, scales=None):
    if case.words:  # the rows' bytes as f32 words (a bitcast, no copy)
      scales = lax.bitcast_convert_type(cache.reshape(cache.shape[:-1] + (cache.shape[-1] // 4, 4)), jnp.float32)
    return kernel(cache, scales, table) if side else kernel(cache, table)

  return jax.jit(call)


def inputs(case: Case, batch: int, splits: int, pages: int, seed: int = 0) -> tuple[jax.Array, ...]:
  """``make``'s arguments: a cache of ``batch * splits * pages`` pages of random bytes (finite e4m3 values or normal
  bf16), a block table that scatters every program's pages over all of it, and (``scales_apart``) the pages'
  scales."""
  total = batch * splits * pages
  table = np.random.default_rng(seed).permutation(total).reshape(batch, splits * pages).astype(np.int32)
  shape = case.cache_shape(total)
  if case.dtype == "bfloat16":
    cache = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
  else:
    cache = lax.bitcast_convert_type(jax.random.randint(jax.random.key(seed), shape, 0, 120, jnp.uint8),
                                     jnp.float8_e4m3fn)
  args = (cache, jnp.asarray(table))
  if case.scales_apart:
    args += (jax.random.uniform(jax.random.key(seed + 1), (total, 1, 2 * PAGE), jnp.float32),)
  return args


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], default=[c.name for c in CASES])
  parser.add_argument("--slots", type=int, nargs="+", default=[2, 3, 4])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--splits", type=int, default=4)
  parser.add_argument("--pages", type=int, default=128, help="pages a program (32K tokens a sequence: 4 x 128)")
  parser.add_argument("--json", help="also append one JSON line per measurement to this file")
  args = parser.parse_args(argv)
  if min(args.slots) < 1 or min(args.batch, args.splits, args.pages) < 1:
    parser.error(f"--slots, --batch, --splits and --pages must be >= 1, got {args.slots}, {args.batch}, "
                 f"{args.splits}, {args.pages}")
  copy_tbs, read_tbs = copy_bandwidth()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; copy {copy_tbs:.2f} TB/s (read + write), "
        f"read-only reduction {read_tbs:.2f} TB/s", flush=True)
  out = open(args.json, "a") if args.json else None
  for case in (c for c in CASES if c.name in args.cases):
    args_ = inputs(case, args.batch, args.splits, args.pages)
    for slots in args.slots:
      if not case.fits(slots):
        print(f"{case.name:>20} {slots} slots: skipped, {slots} x {case.page_bytes()} B of ring do not fit in "
              f"the {SMEM_LIMIT} B of SMEM", flush=True)
        continue
      sec = time_call(make(case, slots, args.batch, args.splits, args.pages), *args_)
      tbs = args_[1].size * case.page_bytes() / sec / 1e12
      print(f"{case.name:>20} {slots} slots: {sec * 1e6:8.1f} us {tbs:5.2f} TB/s ({case.page_bytes()} B a page, "
            f"{tbs / read_tbs:.0%} of the read-only rate)", flush=True)
      if out:
        out.write(json.dumps(dict(dataclasses.asdict(case), slots=slots, batch=args.batch, splits=args.splits,
                                  pages=args.pages, time_us=sec * 1e6, tbs=tbs, copy_tbs=copy_tbs,
                                  read_tbs=read_tbs)) + "\n")
  if out:
    out.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())

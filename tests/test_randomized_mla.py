"""Randomized differential tests of ``mla_decode`` and ``merge_partials`` (hypothesis).

Each example draws a whole decode batch: lengths with the page edges (0, 1, 63, 64, 65, full), scattered
page ids, padding ids past each sequence's last page, ``num_splits`` from 1 to more splits than pages (or
the heuristic), splits balanced by pages or equal, the narrow (transposed) kernel or the 64-row tiles up to 32
heads, both partial dtypes,
diffuse to peaky attention (a few rows aligned with a head's query, whose logits stand far above the rest),
and poison (NaN, +-inf or a huge value) in every cache row that is
no token: the rows past a sequence's end and the pages no table uses. The kernel (``kernel_impl``) is
compared with the split reference (``impl="xla"``, same splits and partial dtype) and with the float64
oracle of ``pallas_kernels.testing``; the same batches over an fp8 cache against the oracle of the values its
rows hold. Shapes are small in interpret mode (CPU) and realistic on a Hopper GPU.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import util
from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning, cache_format, kernel, merge_partials, mla_decode
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM
from pallas_kernels.testing import K3_MLA_SCALE, MLA_PAD_IDS, mla_decode_oracle, mla_merge_oracle
from support import budget
from test_mla_fp8_cache import np_decode_rows, split_q_logit_bound

ON_GPU = util.is_hopper_gpu()
# Interpret mode simulates every warpgroup, copy and barrier, so CPU examples stay small: a few sequences of
# up to 13 pages. Hq = 72 gives a second, mostly empty head tile. On the GPU: K3's 16 or 128 heads per
# device (and 96: one full tile and a half-used one), contexts of up to 8K tokens.
HEADS = (11, 16, 64, 96, 128) if ON_GPU else (1, 5, 16, 72)
MAX_BATCH = 8 if ON_GPU else 3
MAX_PAGES = 128 if ON_GPU else 13
POISON = (np.nan, np.inf, -np.inf, 1e30)  # bf16 holds 1e30 (max 3.4e38): a huge finite row, not just NaN

# Largest per-row relative L2 error of o against the f64 oracle (and between kernel and xla reference), by
# partial dtype. Every path rounds o to bf16 once at the end (about 2^-9 relative, rms); the kernel also
# rounds P to bf16 for ``P @ V`` (2^-9 per weight, averaged down over the tokens); bf16 partials add one more
# rounding of each split's output. With independent tokens that last error does not grow with S (split
# averages of n / S tokens are sqrt(S) larger than the result, but their S errors average down by sqrt(S)),
# so each tolerance is about twice the sum of its terms, to cover the largest of up to ~1000 rows.
O_REL_L2 = {jnp.float32: 6e-3, jnp.bfloat16: 1e-2}
# LSE: f32 logits of bf16 inputs (exact products, f32 sums over 576 terms) up to ~40 with peaky rows, and
# approx_math exp2 / log2 in the kernel.
LSE_ATOL = 5e-5


@st.composite
def decode_batches(draw):
  """``(args, tuning, partial_dtype)``: ``args = (q [B, Hq, 576] bf16, cache bf16, table, lens)``."""
  heads = draw(st.sampled_from(HEADS))
  batch = draw(st.integers(1, MAX_BATCH))
  max_pages = draw(st.integers(1, MAX_PAGES))
  capacity = max_pages * PAGE_SIZE
  edges = [n for n in (0, 1, 63, 64, 65, capacity - 1, capacity) if n <= capacity]
  length = st.one_of(st.sampled_from(edges), st.integers(0, capacity))
  lens = np.array(draw(st.lists(length, min_size=batch, max_size=batch)), np.int32)
  # None is the heuristic (one split below 16 pages); max_pages + 2 splits leave some without a page.
  num_splits = draw(st.one_of(st.sampled_from([2, max_pages + 2, None]), st.integers(1, max_pages + 2)))
  # The narrow (transposed) kernel takes up to 32 heads; None is the default (narrow where it applies).
  narrow = draw(st.sampled_from([None, False, True] if heads <= kernel.NARROW_MAX_HEADS else [None, False]))
  balanced = draw(st.booleans())  # splits spread by pages, or equal (the default)
  partial_dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float32]))
  q_std = draw(st.sampled_from([0.3, 1.0, 2.0]))
  peaky_rows = draw(st.integers(0, 3))
  poison = draw(st.sampled_from(POISON))
  spare_pages = draw(st.integers(0, 4))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

  dim = LATENT_DIM + ROPE_DIM
  need = -(-lens // PAGE_SIZE)
  num_pages = int(need.sum()) + spare_pages + 1
  ids = rng.permutation(num_pages)  # scattered, out of order; the last spare_pages + 1 are never used
  # Past each sequence's last page: padding ids, or ids of any page (which must not be read either).
  table = rng.choice(np.concatenate([MLA_PAD_IDS, ids]), (batch, max_pages)).astype(np.int32)
  q = rng.standard_normal((batch, heads, dim)) * q_std
  cache = np.full((num_pages, PAGE_SIZE, dim), poison, np.float32)
  start = 0
  for b, n in enumerate(lens):
    pages = ids[start:start + need[b]]
    start += need[b]
    table[b, :need[b]] = pages
    rows = rng.standard_normal((n, dim))
    # A peaky row is a multiple of one head's query: a logit of 8-30 for that head, against O(1) for the rest.
    for t in rng.choice(n, min(peaky_rows, n), replace=False):
      h = rng.integers(heads)
      rows[t] = q[b, h] * rng.uniform(8, 30) / (K3_MLA_SCALE * q[b, h] @ q[b, h])
    flat = cache[pages].reshape(-1, dim)
    flat[:n] = rows
    cache[pages] = flat.reshape(-1, PAGE_SIZE, dim)
  args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens))
  return args, MlaDecodeTuning(num_splits=num_splits, narrow=narrow, balanced=balanced), partial_dtype


def _row_rel_l2(o, ref):
  """Largest relative L2 error over the ``[..., Dc]`` rows (NaN anywhere gives NaN, which fails ``<``)."""
  o = np.asarray(jnp.asarray(o, jnp.float32), np.float64)
  return float(np.max(np.linalg.norm(o - ref, axis=-1) / np.linalg.norm(ref, axis=-1), initial=0.0))


@pytest.mark.slow
@budget(cpu=10, gpu=8)
@given(drawn=decode_batches())
def test_mla_decode_matches_reference_and_oracle(kernel_impl, drawn):
  args, tuning, partial_dtype = drawn
  o_ref, lse_ref = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  live = np.asarray(args[3]) > 0
  tol = O_REL_L2[partial_dtype]
  results = {}
  for impl in ("xla", kernel_impl):
    o, lse = mla_decode(*args, config=MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial_dtype, impl=impl,
                                                      tuning=tuning))
    assert o.shape == args[0].shape[:2] + (LATENT_DIM,) and o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse)
    assert (o[~live] == 0).all() and np.isneginf(lse[~live]).all()
    assert _row_rel_l2(o[live], o_ref[live]) < tol, impl
    # assert_allclose fails on a NaN against a number, and matches the -inf of empty sequences exactly.
    np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0, err_msg=impl)
    results[impl] = o, lse
  (o_xla, lse_xla), (o, lse) = results["xla"], results[kernel_impl]
  assert _row_rel_l2(o[live], o_xla[live]) < tol
  np.testing.assert_allclose(lse, lse_xla, atol=LSE_ATOL, rtol=0)


@st.composite
def merge_parts(draw):
  """``(o_parts [S, R, Dc], lse_parts [S, R] f32, out_dtype)`` with empty parts, empty rows and NaN rows."""
  parts = draw(st.integers(1, 6))
  rows = draw(st.integers(1, 12))
  width = draw(st.sampled_from([1, 8, 64]))
  o_dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
  out_dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  lse = rng.standard_normal((parts, rows)) * draw(st.sampled_from([0.5, 5.0, 40.0]))
  lse[rng.random((parts, rows)) < draw(st.sampled_from([0.0, 0.3, 0.8]))] = -np.inf
  lse[:, rng.random(rows) < 0.15] = -np.inf  # all-empty rows
  lse[rng.integers(parts), rng.random(rows) < 0.1] = np.nan  # a split that met a non-finite input
  o = rng.standard_normal((parts, rows, width))
  o[np.isneginf(lse)] = np.nan  # the o of an empty part is not defined and must not leak
  return jnp.asarray(o, o_dtype), jnp.asarray(lse, jnp.float32), out_dtype


# merge_partials against the f64 merge: f32 weights exp(lse_j - max) of LSEs drawn up to a few hundred apart
# (exp's relative error grows with the argument, a few f32 ulps here), plus half an ulp of the output dtype
# when it is bf16. The merged LSE is max + log(sum of weights) in f32: a few ulps of LSEs up to ~200.
MERGE_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0 ** -8}
MERGE_ATOL = 1e-6
MERGE_LSE_ATOL = 1e-5


@budget(cpu=30, gpu=40)
@given(drawn=merge_parts())
def test_merge_partials_matches_oracle(drawn):
  o_parts, lse_parts, out_dtype = drawn
  o, lse = merge_partials(o_parts, lse_parts, out_dtype=out_dtype)
  assert o.dtype == out_dtype and lse.dtype == jnp.float32
  o_ref, lse_ref = mla_merge_oracle(o_parts, lse_parts)
  # NaN must stand exactly where the oracle's is (assert_allclose compares NaN only with NaN).
  np.testing.assert_allclose(np.asarray(o.astype(jnp.float32)), o_ref, rtol=MERGE_RTOL[out_dtype], atol=MERGE_ATOL)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=1e-6, atol=MERGE_LSE_ATOL)


@pytest.mark.slow
@budget(cpu=5, gpu=6)
@given(drawn=decode_batches(), registers=st.booleans())
def test_mla_decode_over_an_fp8_cache_matches_the_oracle_of_its_values(kernel_impl, drawn, registers):
  """The same batches with the cache (poison included) in fp8 rows: the XLA path and the kernel (which reads
  them on chip) are attention over the values the rows hold, decoded by the test's own reading of the row
  layout, within the bf16 cache's tolerances: ``value * scale`` rounded to bf16, or exact for the narrow
  kernel's f16 products (``cache_format``). Where the narrow kernel applies, ``registers`` draws its fp8 pages
  in registers, whose logits may also carry q's two-part e4m3 error (``split_q_logit_bound``)."""
  (q, cache, table, lens), tuning, partial_dtype = drawn
  narrow = kernel.narrow_applies(q.shape[1], cache_format.FP8)
  fp8 = cache_format.quantize_rows(cache, cache_format.FP8, LATENT_DIM)
  decoded = {rounded: np_decode_rows(np.asarray(fp8), rounded) for rounded in (True, False)}
  refs = {rounded: mla_decode_oracle(q, decoded[rounded], table, lens, scale=K3_MLA_SCALE)
          for rounded in (True, False)}
  live = np.asarray(lens) > 0
  for impl in ("xla", kernel_impl):
    o_ref, lse_ref = refs[impl == "xla" or not narrow]
    # The kernel picks narrow or 64-row tiles itself.
    tuning = MlaDecodeTuning(num_splits=tuning.num_splits, fp8_in_registers=registers and narrow and impl != "xla")
    o, lse = mla_decode(q, fp8, table, lens, config=MlaDecodeConfig(
        scale=K3_MLA_SCALE, partial_dtype=partial_dtype, impl=impl, tuning=tuning))
    assert o.shape == q.shape[:2] + (LATENT_DIM,) and o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse)
    assert (o[~live] == 0).all() and np.isneginf(lse[~live]).all()
    assert _row_rel_l2(o[live], o_ref[live]) < O_REL_L2[partial_dtype], impl
    if tuning.fp8_in_registers:  # an lse within the bound counts as the oracle's; NaN and inf stay as they are
      bound = LSE_ATOL + split_q_logit_bound(q, decoded[False], table, lens)
      with np.errstate(invalid="ignore"):
        lse = np.where(np.abs(lse - lse_ref) <= bound, lse_ref, lse)
    np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL, rtol=0, err_msg=impl)

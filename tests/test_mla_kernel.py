"""The Mosaic GPU split-K MLA decode kernel: interpret mode on CPU (tiny shapes), compiled on a Hopper GPU.

Tolerances against the f32 references: the kernel rounds P to bf16 before ``P @ V`` (the wgmma operand),
so each softmax weight carries a relative error up to 2^-8; averaged over the tokens this gives a relative
L2 error around 1e-3 on the output. The logits are exact
products of bf16 inputs accumulated in f32, so the LSE agrees to f32 rounding (and ``approx_math`` exp2/log2).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import (MlaDecodeConfig, MlaDecodeTuning, api, default_tuning, kernel, merge_partials,
                                mla_decode)
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE
from pallas_kernels.mla.reference import (balanced_split_width, mla_decode_partials_reference,
                                          mla_decode_reference)
from pallas_kernels.testing import K3_MLA_SCALE, mla_decode_oracle, mla_paged_inputs, rel_rmse

O_REL_L2 = 5e-3  # bf16 P (2^-8 per weight), plus one bf16 rounding of the output or of bf16 partials
LSE_ATOL = 2e-5  # f32 logits of O(10) and approx_math exp2 / log2


def _config(impl, num_splits=None, partial_dtype=jnp.bfloat16, narrow=None, balanced=None):
  return MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial_dtype, impl=impl,
                         tuning=MlaDecodeTuning(num_splits=num_splits, narrow=narrow, balanced=balanced))


def _check_against_references(args, o, lse, *, num_splits, partial_dtype):
  q = args[0]
  assert o.shape == q.shape[:2] + (LATENT_DIM,) and o.dtype == q.dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  o32, lse = np.asarray(o, np.float32), np.asarray(lse)
  assert not np.isnan(o32).any() and not np.isnan(lse).any()
  o_ref, lse_ref = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  live = np.asarray(args[3]) > 0
  assert (o32[~live] == 0).all() and np.isneginf(lse[~live]).all()
  assert rel_rmse(o[live], o_ref[live]) < O_REL_L2
  np.testing.assert_allclose(lse, lse_ref, atol=LSE_ATOL)
  o_xla, lse_xla = mla_decode(*args, config=_config("xla", num_splits, partial_dtype))
  assert rel_rmse(o[live], np.asarray(o_xla, np.float64)[live]) < O_REL_L2
  np.testing.assert_allclose(lse, np.asarray(lse_xla), atol=LSE_ATOL)


@pytest.mark.parametrize(("num_heads", "partial_dtype", "narrow"),
                         [(1, jnp.float32, False), (16, jnp.bfloat16, False), (1, jnp.bfloat16, True),
                          (11, jnp.float32, True), (32, jnp.bfloat16, True)])
def test_kernel_matches_references(kernel_impl, num_heads, partial_dtype, narrow):
  # Ragged: a partial last page (130), a page-aligned length (64) and an empty sequence (0). Narrow: the
  # transposed kernel, heads as the MMA's N (1 and 11 pad to 8 and 16 rows, 32 its largest).
  args = mla_paged_inputs(20, [130, 64, 0], num_heads=num_heads, max_pages=4, q_dtype=jnp.bfloat16)
  o, lse = mla_decode(*args, config=_config(kernel_impl, 2, partial_dtype, narrow))
  _check_against_references(args, o, lse, num_splits=2, partial_dtype=partial_dtype)


def test_balanced_widths_spread_the_pages_and_leave_full_batches_equal():
  width = functools.partial(balanced_split_width, max_pages=512, budget=2, batch=32, num_splits=4)
  # Full sequences: the equal splits, ceil(512 / 2) pages, in the first two of four splits.
  np.testing.assert_array_equal(width(32 * 512, np.full(32, 512)), np.full(32, 256))
  # One 32K sequence among 2K ones: 1,504 pages for 64 programs, 24 a program; the long one is capped at its
  # four splits (128 pages each), each short one takes two.
  pages = np.array([512] + [32] * 31)
  np.testing.assert_array_equal(width(pages.sum(), pages), [128] + [24] * 31)
  # The floor: min(16, the equal width) pages a split, also with no tokens at all.
  np.testing.assert_array_equal(width(1, np.array([1, 0])), [16, 16])
  assert int(balanced_split_width(0, 0, max_pages=4, budget=1, batch=3, num_splits=2)) == 4


@pytest.mark.parametrize("narrow", [False, True])
def test_each_split_covers_the_pages_its_width_gives(kernel_impl, narrow):
  """Balanced splits: split j of sequence b holds the attention over its pages ``[j w_b, (j + 1) w_b)``
  (``balanced_split_width``), checked against the f64 oracle of that page range alone; splits past a sequence's
  pages are exactly ``(0, -inf)``."""
  # 0, 2, 6 and 50 pages of a 60-page table; a budget of 1 split a sequence over 3 splits: W = max(ceil(58 / 4),
  # 16) = 16, and the long sequence needs ceil(50 / 3) = 17. Equal splits would take 20 pages a split.
  lens = [0, 70, 64 * 5 + 3, 64 * 49 + 10]
  pages = -(-np.array(lens) // PAGE_SIZE)
  widths = balanced_split_width(pages.sum(), pages, max_pages=60, budget=1, batch=4, num_splits=3)
  np.testing.assert_array_equal(widths, [16, 16, 16, 17])
  args = mla_paged_inputs(22, lens, num_heads=16, max_pages=60, q_dtype=jnp.bfloat16)
  o_parts, lse_parts = kernel.mla_decode_partials_mosaic(
      *args, scale=K3_MLA_SCALE, num_splits=3, partial_dtype=jnp.float32, interpret=kernel_impl == "interpret",
      narrow=narrow, budget=1)
  o_parts, lse_parts = np.asarray(o_parts), np.asarray(lse_parts)
  q, cache, table = args[0], args[1], np.asarray(args[2])
  for b, n in enumerate(lens):
    for j in range(3):
      first = j * widths[b]
      sub_len = np.clip(n - first * PAGE_SIZE, 0, widths[b] * PAGE_SIZE)
      sub_table = np.roll(table[b:b + 1], -first, axis=1)  # the range's pages first
      o_ref, lse_ref = mla_decode_oracle(q[b:b + 1], cache, sub_table, np.array([sub_len]), scale=K3_MLA_SCALE)
      if sub_len == 0:
        assert (o_parts[j, b] == 0).all() and np.isneginf(lse_parts[j, b]).all(), (b, j)
        continue
      assert rel_rmse(o_parts[j, b], o_ref[0]) < O_REL_L2, (b, j)
      np.testing.assert_allclose(lse_parts[j, b], lse_ref[0], atol=LSE_ATOL, err_msg=str((b, j)))


def test_every_partial_slot_is_written_and_runs_are_deterministic(kernel_impl):
  # Interpret mode fills every output and SMEM buffer with NaN before the kernel runs (the scratch is
  # poisoned), so a partial slot the kernel forgot, or a stale P / alpha buffer, shows up as NaN here.
  # Split 1 of sequence 1 (65 tokens, pages 2-3 of 4) and all of sequence 2 are empty: (0, -inf).
  args = mla_paged_inputs(21, [250, 65, 0], num_heads=16, max_pages=4, q_dtype=jnp.bfloat16)
  run = functools.partial(kernel.mla_decode_partials_mosaic, *args, scale=K3_MLA_SCALE, num_splits=2,
                          partial_dtype=jnp.float32, interpret=kernel_impl == "interpret")
  o_parts, lse_parts = run()
  assert o_parts.shape == (2, 3, 16, LATENT_DIM) and o_parts.dtype == jnp.float32
  assert lse_parts.shape == (2, 3, 16) and lse_parts.dtype == jnp.float32
  o_parts, lse_parts = np.asarray(o_parts), np.asarray(lse_parts)
  assert not np.isnan(o_parts).any() and not np.isnan(lse_parts).any()
  empty = np.zeros((2, 3), bool)
  empty[1, 1] = empty[:, 2] = True
  assert (o_parts[empty] == 0).all() and np.isneginf(lse_parts[empty]).all()
  assert np.isfinite(lse_parts[~empty]).all()
  o_ref, lse_ref = jax.jit(functools.partial(mla_decode_partials_reference, scale=K3_MLA_SCALE, num_splits=2,
                                             partial_dtype=jnp.float32))(*args)
  assert rel_rmse(o_parts[~empty], np.asarray(o_ref, np.float64)[~empty]) < O_REL_L2
  np.testing.assert_allclose(lse_parts, np.asarray(lse_ref), atol=LSE_ATOL)
  o_again, lse_again = run()
  np.testing.assert_array_equal(np.asarray(o_again), o_parts)
  np.testing.assert_array_equal(np.asarray(lse_again), lse_parts)


@pytest.mark.parametrize("narrow", [False, True])
def test_splits_of_many_pages(kernel_impl, narrow):
  # Splits of 3, 4, 7 and 13 pages (13 pages per split, the last sequence fills both splits, its last page
  # partial) stream through the two-slot KV ring, so every slot is refilled and its last page is never
  # followed by a refill. Interpret mode fails the kernel if a barrier phase completes that no warpgroup
  # awaits (the ring's "consumed" barriers, from 3 pages per split on).
  lens = [3 * PAGE_SIZE - 1, 4 * PAGE_SIZE, 7 * PAGE_SIZE - 30, 13 * PAGE_SIZE, 26 * PAGE_SIZE - 5]
  args = mla_paged_inputs(26, lens, num_heads=8, max_pages=26, q_dtype=jnp.bfloat16)
  o, lse = mla_decode(*args, config=_config(kernel_impl, 2, jnp.float32, narrow))
  _check_against_references(args, o, lse, num_splits=2, partial_dtype=jnp.float32)


def test_tuning_reaches_the_kernel(kernel_impl):
  # Four pages: the heuristic takes one split (a split covers at least 16 pages). The same split given
  # explicitly is the same kernel call (bitwise); two splits run another grid whose bf16 partials round
  # differently, and both are within the kernel's tolerance of the references.
  args = mla_paged_inputs(28, [4 * PAGE_SIZE, 100], num_heads=16, max_pages=4, q_dtype=jnp.bfloat16)
  assert default_tuning(2, 16, 4, cache_dtype=jnp.bfloat16) == MlaDecodeTuning(num_splits=1, narrow=True,
                                                                                   fp8_in_registers=False)
  run = lambda tuning: mla_decode(*args, config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl=kernel_impl,
                                                                  tuning=tuning))
  o_default, lse_default = run(None)
  o_same, lse_same = run(default_tuning(2, 16, 4, cache_dtype=jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(o_same.astype(jnp.float32)), np.asarray(o_default.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(lse_same), np.asarray(lse_default))
  o_two, lse_two = run(MlaDecodeTuning(num_splits=2))
  assert not np.array_equal(np.asarray(o_two.astype(jnp.float32)), np.asarray(o_default.astype(jnp.float32)))
  _check_against_references(args, o_default, lse_default, num_splits=1, partial_dtype=jnp.bfloat16)
  _check_against_references(args, o_two, lse_two, num_splits=2, partial_dtype=jnp.bfloat16)


def _poisoned_inputs():
  """Inputs with NaN / inf in used cache rows and in q, besides the NaN that ``make_inputs`` puts everywhere else.

  Sequence 0: NaN in the rope part of token 70 (its second page). Sequence 1: +inf in the V part of its last
  token (logit +inf or -inf by the sign of q, so NaN or a 0 * inf in ``P @ V``). Sequence 2: NaN in q of
  head 1 only. Sequence 3 is empty. Sequence 5: +inf in q of head 2. Half of the pages no table uses hold
  +inf instead of NaN. Sequence 4 and the other heads are clean and must be unaffected.
  """
  q, cache, table, lens = mla_paged_inputs(27, [150, 130, 100, 0, 65, 90], num_heads=4, max_pages=3,
                                      q_dtype=jnp.bfloat16)
  table = np.asarray(table)
  cache = cache.at[table[0, 1], 70 - PAGE_SIZE, LATENT_DIM + 3].set(jnp.nan)
  cache = cache.at[table[1, 2], 129 - 2 * PAGE_SIZE, 10].set(jnp.inf)
  unused = np.setdiff1d(np.arange(cache.shape[0]), table[table >= 0])
  cache = cache.at[unused[::2]].set(jnp.inf)
  q = q.at[2, 1, 5].set(jnp.nan).at[5, 2, 100].set(jnp.inf)
  return q, cache, jnp.asarray(table), lens


@pytest.mark.parametrize(("partial_dtype", "narrow"), [(jnp.bfloat16, False), (jnp.float32, False),
                                                       (jnp.bfloat16, True)])
@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_non_finite_inputs_propagate_and_unused_rows_do_not(kernel_impl, impl, partial_dtype, narrow):
  # A NaN or inf in a token's cache row or in q is not an empty sequence: the heads it reaches are
  # non-finite (exactly where the f64 oracle's are), whichever split holds it; an empty sequence stays
  # (0, -inf), and the NaN / inf in rows and pages that are no tokens never reach the result.
  args = _poisoned_inputs()
  with np.errstate(invalid="ignore"):
    o_ref, lse_ref = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  bad = ~np.isfinite(o_ref).all(axis=-1)
  assert bad[0].all() and bad[1].all() and bad[2].tolist() == [False, True, False, False]
  assert bad[5].tolist() == [False, False, True, False] and not bad[[3, 4]].any()
  for num_splits in (1, 3):
    o, lse = mla_decode(*args, config=_config(kernel_impl if impl == "kernel" else impl, num_splits, partial_dtype,
                                              narrow))
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    np.testing.assert_array_equal(~np.isfinite(o).all(axis=-1), bad)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
    assert (o[3] == 0).all() and np.isneginf(lse[3]).all()
    live = ~bad & (np.asarray(args[3]) > 0)[:, None]
    assert rel_rmse(o[live], o_ref[live]) < O_REL_L2
    np.testing.assert_allclose(lse[live], lse_ref[live], atol=LSE_ATOL)


def test_f32_partials_closer_to_oracle_than_bf16_partials(kernel_impl):
  # Diffuse attention (q_std 0.3) over 8 one-page splits: split averages are ~sqrt(8) larger than the
  # result, so rounding them to bf16 costs more than the kernel's bf16 P. The merge output is f32 here,
  # so the final rounding does not hide the difference.
  args = mla_paged_inputs(22, [512], num_heads=16, max_pages=8, q_std=0.3, q_dtype=jnp.bfloat16)
  o_ref, _ = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  err = {}
  for dt in (jnp.float32, jnp.bfloat16):
    parts = kernel.mla_decode_partials_mosaic(*args, scale=K3_MLA_SCALE, num_splits=8, partial_dtype=dt,
                                              interpret=kernel_impl == "interpret")
    err[dt] = rel_rmse(merge_partials(*parts, out_dtype=jnp.float32)[0], o_ref)
  print(f"kernel, relative L2 error vs f64: f32 partials {err[jnp.float32]:.2e}, "
        f"bf16 partials {err[jnp.bfloat16]:.2e}")
  assert err[jnp.float32] < 0.75 * err[jnp.bfloat16] and err[jnp.float32] < O_REL_L2


@pytest.mark.parametrize(("num_heads", "narrow", "budget"),
                         [(16, False, None), (128, False, 1), (11, True, 1), (32, True, None)])
@pytest.mark.parametrize("partial_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_lowers_for_cuda(num_heads, narrow, budget, partial_dtype):
  # Runs Mosaic GPU lowering, layout inference and the shared-memory check (the compiled variant, whose
  # P @ V accumulates in place) on the CPU machine; both kernels with equal and with balanced splits (budget).
  shapes = (jax.ShapeDtypeStruct((2, num_heads, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((9, PAGE_SIZE, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
  f = functools.partial(kernel.mla_decode_partials_mosaic, scale=K3_MLA_SCALE, num_splits=2,
                        partial_dtype=partial_dtype, interpret=False, narrow=narrow, smem_operands=False,
                        budget=budget)
  lowered = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "narrow"), [(1, False), (16, False), (96, False), (128, False), (1, True),
                                                   (11, True), (16, True), (32, True)])
@pytest.mark.parametrize(("partial_dtype", "splits"), [(jnp.bfloat16, (1, None)), (jnp.float32, (3, 64))])
def test_gpu_kernel_ragged_batches_and_splits(num_heads, narrow, partial_dtype, splits):
  lens = [0, 1, 63, 64, 65, 4096, 3000, 777]
  args = mla_paged_inputs(23, lens, num_heads=num_heads, max_pages=64, q_dtype=jnp.bfloat16)
  for num_splits, balanced in itertools.product(splits, (False, True)):
    o, lse = mla_decode(*args, config=_config("pallas", num_splits, partial_dtype, narrow, balanced))
    _check_against_references(args, o, lse, num_splits=num_splits, partial_dtype=partial_dtype)


@pytest.mark.gpu
def test_gpu_kernel_page_ids_above_65535():
  # 70,000 pages (5 GB of cache), used ids drawn from [66000, 70000) in random order.
  args = mla_paged_inputs(24, [1000, 4096], num_heads=16, max_pages=64, num_pages=70_000, first_page=66_000,
                     q_dtype=jnp.bfloat16)
  assert np.asarray(args[2])[:, 0].min() > 65535
  o, lse = mla_decode(*args, config=_config("pallas", 4))
  _check_against_references(args, o, lse, num_splits=4, partial_dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_kernel_long_context_matches_unsplit_reference():
  # 32K tokens at Hq = 96 (two head tiles, the second only half used), default splits, equal and balanced.
  args = mla_paged_inputs(25, [32768, 20000], num_heads=96, max_pages=512, q_dtype=jnp.bfloat16)
  o_ref, lse_ref = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  for balanced in (False, True):
    o, lse = mla_decode(*args, config=_config("pallas", balanced=balanced))
    assert rel_rmse(o, np.asarray(o_ref, np.float64)) < O_REL_L2, balanced
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=LSE_ATOL, err_msg=str(balanced))


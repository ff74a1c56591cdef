"""MLA decode references (unsplit and split-K, ``impl="xla"``) and ``merge_partials`` vs a float64 oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning, api, default_tuning, merge_partials, mla_decode
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM
from pallas_kernels.mla.reference import mla_decode_partials_reference, mla_decode_reference
from pallas_kernels.testing import (K3_MLA_SCALE, mla_decode_oracle, mla_hand_case, mla_merge_oracle, mla_paged_inputs,
                                    rel_rmse)

LENS = [0, 1, 63, 64, 65, 200, 1000]


def _xla(num_splits=None, partial_dtype=jnp.bfloat16):
  return MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial_dtype, impl="xla",
                         tuning=MlaDecodeTuning(num_splits=num_splits))


def _check_outputs(o, lse, q):
  assert o.shape == q.shape[:2] + (LATENT_DIM,) and o.dtype == q.dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  assert not np.isnan(np.asarray(o, np.float32)).any() and not np.isnan(np.asarray(lse)).any()


def test_reference_hand_case():
  (q, cache, table, lens), (o_want, lse_want) = mla_hand_case()
  o, lse = mla_decode_reference(q, cache, table, lens, scale=1.0, latent_dim=1)
  assert o.shape == (3, 2, 1) and o.dtype == jnp.float32 and lse.dtype == jnp.float32
  # rtol 1e-6: f32 arithmetic on O(1) numbers (a few roundings of 6e-8).
  np.testing.assert_allclose(np.asarray(o), o_want, rtol=1e-6)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
  np.testing.assert_allclose(np.asarray(lse), lse_want, rtol=1e-6)


@pytest.mark.parametrize("q_std", [0.3, 1.0, 3.0])
def test_reference_matches_oracle_f32(q_std):
  # q_std 0.3 / 1 / 3: diffuse to peaky attention (logit std 0.5 / 1.7 / 5).
  args = mla_paged_inputs(1, LENS, num_heads=16, max_pages=17, q_std=q_std)
  o, lse = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  _check_outputs(o, lse, args[0])
  o_ref, lse_ref = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  # atol 2e-5: f32 sums of <= 1000 terms of O(1) (the bf16 cache is exact in f32 and f64 alike).
  np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=2e-5)
  assert np.isneginf(np.asarray(lse[0])).all() and (np.asarray(o[0]) == 0).all()


def test_reference_bf16_q_rounds_output_once():
  args = mla_paged_inputs(2, LENS, num_heads=16, max_pages=17, q_dtype=jnp.bfloat16)
  o, lse = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  _check_outputs(o, lse, args[0])
  o_ref, lse_ref = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  # One bf16 rounding of the output: half an ulp, 2^-8 relative, plus the f32 noise of the test above.
  np.testing.assert_array_less(np.abs(np.asarray(o, np.float64) - o_ref), 2.0 ** -8 * np.abs(o_ref) + 2e-5)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 33, 64])
def test_split_k_f32_partials_equal_unsplit(num_splits):
  args = mla_paged_inputs(3, [4096, 4001, 1000, 0], num_heads=16, max_pages=64)
  o, lse = mla_decode(*args, config=_xla(num_splits, jnp.float32))
  _check_outputs(o, lse, args[0])
  o_ref, lse_ref = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  # atol 1e-5: f32 partials and an f32 merge differ from one f32 softmax only by f32 rounding.
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=1e-5)
  assert np.isneginf(np.asarray(lse[3])).all() and (np.asarray(o[3]) == 0).all()


@pytest.mark.parametrize("num_splits", [3, 64])
def test_split_k_bf16_partials_within_one_partial_rounding(num_splits):
  args = mla_paged_inputs(4, [4096, 3000, 65], num_heads=16, max_pages=64)
  o, lse = mla_decode(*args, config=_xla(num_splits, jnp.bfloat16))
  _check_outputs(o, lse, args[0])
  o_ref, lse_ref = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  o_parts, _ = jax.jit(functools.partial(mla_decode_partials_reference, scale=K3_MLA_SCALE, num_splits=num_splits,
                                         partial_dtype=jnp.float32))(*args)
  # Each partial is rounded once to bf16 (2^-8 relative) and the weights sum to 1, so the merged error is
  # at most 2^-8 * max_j |o_j| per element; the LSE stays f32.
  bound = 2.0 ** -8 * np.abs(np.asarray(o_parts)).max(axis=0) + 1e-5
  np.testing.assert_array_less(np.abs(np.asarray(o) - np.asarray(o_ref)), bound)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=1e-5)


def test_f32_partials_closer_to_oracle_than_bf16_partials():
  # Diffuse attention (q_std 0.3) over 16 splits: split averages cancel, the case where bf16 partials hurt.
  args = mla_paged_inputs(5, [4096, 4096], num_heads=16, max_pages=64, q_std=0.3)
  o_ref, _ = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  err = {dt: rel_rmse(mla_decode(*args, config=_xla(16, dt))[0], o_ref)
         for dt in (jnp.float32, jnp.bfloat16)}
  print(f"relative L2 error vs f64: f32 partials {err[jnp.float32]:.2e}, bf16 partials {err[jnp.bfloat16]:.2e}")
  assert err[jnp.float32] < 1e-5 < err[jnp.bfloat16]


def test_empty_sequences_give_zero_and_neg_inf():
  args = mla_paged_inputs(6, [0, 0, 0], num_heads=16, max_pages=4)
  for config in (_xla(1), _xla(4, jnp.float32)):
    o, lse = mla_decode(*args, config=config)
    _check_outputs(o, lse, args[0])
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_far_apart_out_of_order_pages_and_nan_padding():
  # 1024 pages, used ids drawn at random from [600, 1024) in random order; everything else is NaN.
  args = mla_paged_inputs(7, [130, 64, 700], num_heads=16, max_pages=12, num_pages=1024, first_page=600)
  table = np.asarray(args[2])
  assert (np.diff(table[2, :11]) < 0).any() and np.ptp(table[2, :11]) > 100
  o_ref, lse_ref = mla_decode_oracle(*args, scale=K3_MLA_SCALE)
  for o, lse in (mla_decode_reference(*args, scale=K3_MLA_SCALE),
                 mla_decode(*args, config=_xla(5, jnp.float32))):
    _check_outputs(o, lse, args[0])
    # atol 2e-5: as in test_reference_matches_oracle_f32.
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=2e-5)


def test_mla_decode_under_jit_with_traced_lengths():
  args = mla_paged_inputs(8, [100, 0], num_heads=16, max_pages=3)
  f = jax.jit(lambda *a: mla_decode(*a, config=_xla(2, jnp.float32)))
  o, lse = f(*args)
  o_ref, lse_ref = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=1e-5)


def test_merge_partials_hand_case():
  # Row 0: parts (o, lse) = (1, 0), (3, ln 3) and an empty (NaN, -inf): weights 1/4, 3/4 and 0, so
  # o = 1/4 + 9/4 = 2.5 and lse = ln 4; the empty part contributes nothing, whatever its o holds.
  # Row 1 has only empty parts: (0, -inf). Row 2 has a NaN LSE beside a real part and row 3 a +inf LSE
  # (a split that met an infinite logit): both are non-finite inputs, so (NaN, NaN), not an empty part.
  nan, inf = np.nan, np.inf
  o_parts = jnp.array([[[1.0], [nan], [1.0], [1.0]], [[3.0], [0.0], [nan], [nan]], [[nan], [nan], [0.0], [0.0]]],
                      jnp.float32)
  lse_parts = jnp.array([[0.0, -inf, 0.0, 0.0], [np.log(3), -inf, nan, inf], [-inf, -inf, -inf, -inf]],
                        jnp.float32)
  o, lse = merge_partials(o_parts, lse_parts, out_dtype=jnp.float32)
  assert o.shape == (4, 1) and o.dtype == jnp.float32 and lse.shape == (4,) and lse.dtype == jnp.float32
  # rtol 1e-6: a handful of f32 roundings.
  np.testing.assert_allclose(np.asarray(o), [[2.5], [0.0], [nan], [nan]], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), [np.log(4), -inf, nan, nan], rtol=1e-6)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_merge_partials_matches_oracle_with_empty_parts(out_dtype):
  rng = np.random.default_rng(9)
  o_parts = rng.standard_normal((6, 3, 4, 32)).astype(np.float32)
  lse_parts = (rng.standard_normal((6, 3, 4)) * 5).astype(np.float32)
  lse_parts[rng.random((6, 3, 4)) < 0.3] = -np.inf
  lse_parts[:, 1, 2] = -np.inf  # an all-empty row
  o_parts[lse_parts == -np.inf] = 0.0
  o, lse = merge_partials(jnp.asarray(o_parts, jnp.bfloat16), jnp.asarray(lse_parts), out_dtype=out_dtype)
  assert o.shape == (3, 4, 32) and o.dtype == out_dtype and lse.shape == (3, 4) and lse.dtype == jnp.float32
  o_ref, lse_ref = mla_merge_oracle(jnp.asarray(o_parts, jnp.bfloat16).astype(jnp.float32), lse_parts)
  # f32 merge of bf16-exact parts: 1e-5 of f32 noise, plus half a bf16 ulp (2^-8 relative) when rounding to bf16.
  rtol = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 0.0
  np.testing.assert_array_less(np.abs(np.asarray(o, np.float64) - o_ref), rtol * np.abs(o_ref) + 1e-5)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=1e-5)
  assert (np.asarray(o[1, 2]) == 0).all() and np.isneginf(np.asarray(lse[1, 2]))


@pytest.mark.parametrize(("batch", "num_heads", "max_pages", "want"), [
    (1, 16, 64, 4),  # 4K context: capped at 64 // 16 pages per split
    (1, 16, 2048, 109),  # 128K: 109 programs reach 85% of the best wave efficiency
    (32, 16, 512, 4),  # 128 of 132 SMs
    (32, 128, 512, 2),  # two 64-head tiles per sequence
    (128, 16, 2048, 1),  # the batch fills the machine
    (4, 16, 15, 1),  # under 16 pages: never split
])
def test_choose_num_splits(batch, num_heads, max_pages, want):
  assert api.choose_num_splits(batch, num_heads, max_pages) == want


def test_effective_num_splits_has_no_empty_split():
  for max_pages in (1, 5, 64, 100):
    for s in range(1, 70):
      eff = api.effective_num_splits(max_pages, s)
      pps = -(-max_pages // s)
      assert eff <= s and (eff - 1) * pps < max_pages <= eff * pps


def _bad(args, **changes):
  names = ("q_abs", "kv_cache", "block_table", "seq_lens")
  d = dict(zip(names, args))
  d.update(changes)
  return [d[n] for n in names]


_ARGS = mla_paged_inputs(10, [70, 5], num_heads=16, max_pages=3)


@pytest.mark.parametrize(("changes", "match"), [
    ({"q_abs": _ARGS[0].astype(jnp.int32)}, "q_abs must have dtype"),
    ({"kv_cache": _ARGS[1].astype(jnp.int8)}, "kv_cache must have dtype"),
    ({"block_table": _ARGS[2].astype(jnp.float32)}, "block_table must have dtype"),
    ({"seq_lens": _ARGS[3].astype(jnp.float32)}, "seq_lens must have dtype"),
    ({"q_abs": _ARGS[0][0]}, r"q_abs must have shape \(B, Hq, Dc \+ Dr\)"),
    ({"q_abs": _ARGS[0][..., :LATENT_DIM]}, "q_abs last dim must be Dc"),
    ({"q_abs": jnp.pad(_ARGS[0], ((0, 0), (0, 0), (0, 8))),
      "kv_cache": jnp.pad(_ARGS[1], ((0, 0), (0, 0), (0, 8)))},
     r"q_abs must have shape .*576\), got \(2, 16, 584\)"),
    ({"kv_cache": _ARGS[1][..., :-1]}, r"kv_cache must have shape .*64, 576\), got \(6, 64, 575\)"),
    ({"kv_cache": _ARGS[1][:, :32]}, r"kv_cache must have shape .*64, 576\), got \(6, 32, 576\)"),
    ({"block_table": _ARGS[2][:1]}, r"block_table must have shape \(2, .*got \(1, 3\)"),
    ({"seq_lens": _ARGS[3][:1]}, r"seq_lens must have shape \(2,\), got \(1,\)"),
    ({"block_table": _ARGS[2][:, :0]}, "must be >= 1"),
    ({"seq_lens": jnp.array([70, -1], jnp.int32)}, r"seq_lens must lie in \[0, max_pages \* page_size\]"),
    ({"seq_lens": jnp.array([193, 5], jnp.int32)}, r"seq_lens must lie in \[0, max_pages \* page_size\]"),
    ({"block_table": _ARGS[2].at[0, 1].set(_ARGS[1].shape[0])}, r"block_table\[0, 1\] = .* used page"),
    ({"block_table": _ARGS[2].at[1, 0].set(-1)}, r"block_table\[1, 0\] = -1 is a used page"),
])
def test_mla_decode_validation(changes, match):
  with pytest.raises(ValueError, match=match):
    mla_decode(*_bad(_ARGS, **changes), config=_xla())


@pytest.mark.parametrize("scale", ["x", float("nan"), float("inf"), 0.0, -1.0, None])
def test_bad_scale_is_named(scale):
  # The op takes its scale from the config, which checks it; the reference takes it as an argument.
  with pytest.raises(ValueError, match=r"scale must be a finite float > 0, got"):
    MlaDecodeConfig(scale=scale, impl="xla")
  with pytest.raises(ValueError, match="scale must be a finite positive"):
    mla_decode_reference(*_ARGS, scale=scale)


def test_scale_is_required_and_config_checked():
  # Absorbed queries are Dc + Dr wide whatever the head dims: no default scale can be derived from them.
  with pytest.raises(TypeError, match="scale"):
    MlaDecodeConfig(impl="xla")
  with pytest.raises(ValueError, match="config must be an MlaDecodeConfig, got None"):
    mla_decode(*_ARGS, config=None)
  with pytest.raises(ValueError, match="tuning must be an MlaDecodeTuning or None, got 2"):
    MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla", tuning=2)


def test_reference_validation_uses_the_same_checks():
  with pytest.raises(ValueError, match="q_abs last dim must be Dc"):
    mla_decode_reference(*_ARGS, scale=K3_MLA_SCALE, latent_dim=LATENT_DIM + ROPE_DIM)
  with pytest.raises(ValueError, match="seq_lens must lie"):
    mla_decode_reference(*_bad(_ARGS, seq_lens=jnp.array([70, 3 * PAGE_SIZE + 1], jnp.int32)), scale=K3_MLA_SCALE)


def test_kernels_need_bf16_inputs():
  match = "needs a bf16 q_abs and a bf16 or fp8 kv_cache"
  with pytest.raises(NotImplementedError, match=match):
    mla_decode(*_ARGS, config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="interpret"))
  q, cache, *rest = _ARGS
  with pytest.raises(NotImplementedError, match=match):  # an f32 cache, even with a bf16 q
    mla_decode(q.astype(jnp.bfloat16), cache.astype(jnp.float32), *rest,
               config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="interpret"))


@pytest.mark.parametrize(("o_parts", "lse_parts", "out_dtype", "match"), [
    (jnp.zeros((2, 3, 8)), jnp.zeros((2, 3), jnp.bfloat16), jnp.float32, "lse_parts must have dtype"),
    (jnp.zeros((2, 3, 8), jnp.int32), jnp.zeros((2, 3)), jnp.float32, "o_parts must have dtype"),
    (jnp.zeros((2, 3, 8)), jnp.zeros((2, 4)), jnp.float32, r"lse_parts must have shape \(2, 3\), got \(2, 4\)"),
    (jnp.zeros((8,)), jnp.zeros(()), jnp.float32, r"o_parts must have shape \(S, \.\.\., Dc\)"),
    (jnp.zeros((0, 3, 8)), jnp.zeros((0, 3)), jnp.float32, "at least one part"),
    (jnp.zeros((2, 3, 8)), jnp.zeros((2, 3)), jnp.int32, "out_dtype must be one of"),
])
def test_merge_partials_validation(o_parts, lse_parts, out_dtype, match):
  with pytest.raises(ValueError, match=match):
    merge_partials(o_parts, lse_parts, out_dtype=out_dtype)


@pytest.mark.parametrize("num_splits", [0, -1, 2.0, True, "4"])
def test_tuning_rejects_bad_num_splits(num_splits):
  with pytest.raises(ValueError, match=r"num_splits must be an int >= 1 or None, got"):
    MlaDecodeTuning(num_splits=num_splits)


@pytest.mark.parametrize("narrow", [1, "yes", 0.0])
def test_tuning_rejects_bad_narrow(narrow):
  with pytest.raises(ValueError, match=r"narrow must be a bool or None, got"):
    MlaDecodeTuning(narrow=narrow)


def test_narrow_kernel_takes_at_most_32_heads():
  # Valid but unsupported: the transposed kernel's SMEM holds 32 head rows; impl xla ignores the knob.
  args = mla_paged_inputs(12, [100], num_heads=40, max_pages=2, q_dtype=jnp.bfloat16)
  narrow = lambda impl: MlaDecodeConfig(scale=K3_MLA_SCALE, impl=impl, tuning=MlaDecodeTuning(narrow=True))
  with pytest.raises(NotImplementedError, match="narrow=True takes at most 32 query heads with a bf16 kv_cache "
                                                "and 16 with an fp8 one, got q_abs with 40"):
    mla_decode(*args, config=narrow("interpret"))
  mla_decode(*args, config=narrow("xla"))


def test_default_tuning_takes_the_narrow_kernel_only_where_it_applies():
  # At most 32 heads with a bf16 cache, 16 with an fp8 one (K3 under TP9 has 11 per GPU); else the 64-row tiles.
  narrow = lambda heads, dtype: default_tuning(8, heads, 64, cache_dtype=dtype).narrow
  assert narrow(1, jnp.bfloat16) and narrow(11, jnp.bfloat16) and narrow(32, "bfloat16")
  assert not narrow(33, jnp.bfloat16) and not narrow(128, jnp.bfloat16)
  assert narrow(11, jnp.float8_e4m3fn) and narrow(16, jnp.float8_e4m3fn) and not narrow(17, jnp.float8_e4m3fn)
  assert not narrow(11, jnp.float32)


def test_tuning_reaches_the_split_reference():
  # 4096 tokens of one sequence: the heuristic splits them 4 ways. The same splits given explicitly are the
  # same computation (bitwise); other splits round other bf16 partials, within the bound of
  # test_split_k_bf16_partials_within_one_partial_rounding.
  args = mla_paged_inputs(11, [4096, 1000], num_heads=16, max_pages=64)
  assert default_tuning(2, 16, 64, cache_dtype=jnp.bfloat16) == MlaDecodeTuning(num_splits=4, narrow=True,
                                                                                    fp8_in_registers=False)
  run = lambda tuning: mla_decode(*args, config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla", tuning=tuning))
  o_default, lse_default = run(None)
  for same in (MlaDecodeTuning(), default_tuning(2, 16, 64, cache_dtype=jnp.bfloat16)):
    o, lse = run(same)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_default))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_default))
  o_one, _ = run(MlaDecodeTuning(num_splits=1))
  assert not np.array_equal(np.asarray(o_one), np.asarray(o_default))
  o_ref, _ = mla_decode_reference(*args, scale=K3_MLA_SCALE)
  o_parts, _ = jax.jit(functools.partial(mla_decode_partials_reference, scale=K3_MLA_SCALE, num_splits=4,
                                         partial_dtype=jnp.float32))(*args)
  bound = 2.0 ** -8 * np.abs(np.asarray(o_parts)).max(axis=0) + 1e-5
  np.testing.assert_array_less(np.abs(np.asarray(o_default) - np.asarray(o_ref)), bound)
  np.testing.assert_array_less(np.abs(np.asarray(o_one) - np.asarray(o_ref)), 2.0 ** -8 * np.abs(o_ref) + 1e-5)

"""The fp8 (e4m3) latent cache: its row format, ``mla_decode`` over it (XLA path and kernel), and the model that
writes and reads it.

Every path over an fp8 cache must be attention over the values its rows hold (``value * scale`` rounded to
bf16), which a NumPy decoder of the documented row layout gives independently here: the XLA path to f32
rounding, the kernel to its bf16 tolerances (those of a bf16 cache). Against the rows before quantisation the
error is e4m3's own (3 mantissa bits: about 2.6-2.8% rms per element), bounded below with that reason.
"""

import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from layer_oracles import tiny
from support import users_xla_env
from test_mla_kernel import _poisoned_inputs
from test_model import T, Runner, tokens_for

from k3jax import ops
from k3jax.cache import init_cache
from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning, api, cache_format, mla_decode
from pallas_kernels.mla import kernel as mla_kernel
from pallas_kernels.mla.config import LATENT_DIM, PAGE_SIZE, ROPE_DIM
from pallas_kernels.testing import K3_MLA_SCALE, mla_decode_oracle, mla_paged_inputs

DIM = LATENT_DIM + ROPE_DIM
FP8 = cache_format.FP8
# e4m3: a normal value is within half a unit in the last of 3 mantissa bits (2^-4 relative); below the
# smallest normal (2^-6, times the scale) the spacing is fixed at 2^-9 (times the scale). Reading back rounds
# value * scale to bf16 once more (2^-9 relative).
NORMAL_REL, SUBNORMAL_ABS, READ_REL = 2.0 ** -4, 2.0 ** -10, 2.0 ** -9
# Output of mla_decode over an fp8 cache against the f64 oracle of the rows before quantisation (random
# rows and queries, diffuse to peaky): V's 2.8% rms element error reaches o unaveraged (the output is a
# weighted mean of rows whose errors are as independent as the rows), and the keys' error moves the logits.
FP8_VS_UNQUANTISED_REL_L2 = 0.1
# The kernel against the oracle of the held values: what the bf16 cache's kernel tests allow (the output rounded
# once, P rounded to bf16 for P @ V, bf16 partials one more rounding; test_randomized_mla.O_REL_L2).
KERNEL_O_REL_L2 = {jnp.float32: 6e-3, jnp.bfloat16: 1e-2}


def np_row_parts(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """fp8 cache rows' e4m3 values ``[..., 576]`` and their (latent, rope) f32 scales ``[..., 2]``, from the
  documented layout (independent of ``cache_format``)."""
  tail = np.ascontiguousarray(rows[..., DIM:DIM + 8]).view(np.uint8)
  return rows[..., :DIM].astype(np.float32), tail.reshape(tail.shape[:-1] + (2, 4)).copy().view("<f4")[..., 0]


def np_decode_rows(rows: np.ndarray, rounded: bool = True) -> np.ndarray:
  """float64 latent rows of fp8 cache rows (``np_row_parts``): ``value * scale`` in f32, rounded to bf16
  (``rounded``) or exact (what the narrow kernel's f16 products read)."""
  values, scales = np_row_parts(rows)
  x = np.concatenate([values[..., :LATENT_DIM] * scales[..., :1], values[..., LATENT_DIM:] * scales[..., 1:]],
                     axis=-1)
  return x.astype(ml_dtypes.bfloat16).astype(np.float64) if rounded else x.astype(np.float64)


def _rows(rng, shape, std=1.0):
  return rng.standard_normal(shape + (DIM,)) * std


def split_q_logit_bound(q, rows: np.ndarray, table, lens) -> np.ndarray:
  """``[B, Hq]``: the largest logit error (natural units, the softmax scale applied) that ``fp8_in_registers``'s
  q in two e4m3 parts allows over each sequence's tokens: ``|q_i - q~_i| <= 2^-8 |q_i| + 2^-14 s_q`` with ``s_q
  = max |q| / 448`` (the second part carries the first's remainder at 16 times its scale, to e4m3's 2^-4, or to
  its subnormal spacing), times ``|k_i|`` summed. ``rows``: the decoded ``[pages, 64, 576]`` values."""
  q = np.abs(np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64))
  err = 2.0 ** -8 * q + 2.0 ** -14 * q.max(-1, keepdims=True) / cache_format.FP8_MAX
  bound = np.zeros(q.shape[:2])
  for b, n in enumerate(np.asarray(lens)):
    if n:
      k = np.abs(rows[np.asarray(table)[b, :-(-n // PAGE_SIZE)]].reshape(-1, DIM)[:n])
      bound[b] = K3_MLA_SCALE * (err[b] @ k.T).max(-1)
  return bound


def test_e4m3_pair_bytes_are_the_words_bytes():
  """``e4m3_pair_bytes`` (interpret mode's form of the GPU's byte permutes): every uint16 word's low and high bytes
  as e4m3 arrays of the input's shape, bit for bit (NaN bytes included)."""
  words = np.arange(2 ** 16, dtype=np.uint16)
  got = mla_kernel.e4m3_pair_bytes(jnp.asarray(words))
  for x, byte in zip(got, (words & 0xFF, words >> 8)):
    assert x.dtype == FP8 and x.shape == words.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), byte.astype(np.uint8))


def np_prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
  """PTX ``prmt.b32 d, a, b, selector`` (default mode) on uint32 arrays: byte k of d is byte ``selector``'s
  nibble k (its low 3 bits) of the eight bytes b:a, a's first."""
  pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
  out = np.zeros_like(a, dtype=np.uint32)
  for k in range(4):
    src = (selector >> (4 * k)) & 7
    out |= (((pool >> np.uint64(8 * src)) & np.uint64(0xFF)).astype(np.uint32)) << np.uint32(8 * k)
  return out


def test_pair_selectors_put_the_tokens_in_p_token_order():
  """The GPU's ``P @ V`` operands: thread q of a row holds the uint16 words of tokens 2q, 2q + 1 in one register
  and of tokens 2q + 8, 2q + 9 in another (the 16-bit transposed load); ``EVEN_BYTES`` and ``ODD_BYTES`` permute
  the two into the even and the odd column's e4m3 register of the 8-bit A layout, k = 4q .. 4q + 3, which must
  hold tokens ``p_token(k)``. Random bytes, every q, both columns."""
  rng = np.random.default_rng(11)
  even, odd = (rng.integers(0, 256, (64, 16), dtype=np.uint32) for _ in range(2))  # [case, token]
  words = even | (odd << np.uint32(8))
  for q in range(4):
    first = words[:, 2 * q] | (words[:, 2 * q + 1] << np.uint32(16))
    second = words[:, 2 * q + 8] | (words[:, 2 * q + 9] << np.uint32(16))
    for column, selector in ((even, mla_kernel.EVEN_BYTES), (odd, mla_kernel.ODD_BYTES)):
      got = np_prmt(first, second, selector)
      for j in range(4):
        token = mla_kernel.p_token(4 * q + j)
        np.testing.assert_array_equal((got >> np.uint32(8 * j)) & np.uint32(0xFF), column[:, token])


def test_p_token_order_is_a_permutation_with_each_rows_pair_side_by_side():
  """``p_token`` permutes each 16 tokens of a page, and the leader's thread that holds tokens t = 16 w + r and
  t + 8 (row r of warp w's two halves of the WGMMA layout) finds them at k = 16 w + 2 r and the next k, as
  ``store_p_e4m3`` writes them (one 16-bit store)."""
  order = [mla_kernel.p_token(k) for k in range(PAGE_SIZE)]
  assert sorted(order) == list(range(PAGE_SIZE))
  assert all(k // 16 == t // 16 for k, t in enumerate(order))
  for w in range(4):
    for r in range(8):
      assert order[16 * w + 2 * r: 16 * w + 2 * r + 2] == [16 * w + r, 16 * w + r + 8]


def test_p_in_two_e4m3_parts():
  """``e4m3_parts`` (the conversions of ``store_p_e4m3``, interpret mode's form) of P's weights times
  ``P_SCALE``: two e4m3 values (exact round trips) with ``x = hi + lo / Q_LO_FACTOR`` to ``2^-8 x`` plus the
  second part's subnormal spacing; 0 stays 0 and NaN stays NaN."""
  rng = np.random.default_rng(5)
  p = np.concatenate([rng.random(4096), 10.0 ** rng.uniform(-12, 0, 4096), [0.0, 1.0, np.nan]])
  x = (p * mla_kernel.P_SCALE).astype(np.float32)
  hi, lo = (np.asarray(v, np.float64) for v in mla_kernel.e4m3_parts(jnp.asarray(x)))
  for part in (hi, lo):
    np.testing.assert_array_equal(part, part.astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
  x = x.astype(np.float64)
  err = np.abs(hi + lo / mla_kernel.Q_LO_FACTOR - x)
  finite = np.isfinite(x)
  assert (err[finite] <= 2.0 ** -8 * x[finite] + 2.0 ** -9 / mla_kernel.Q_LO_FACTOR).all()
  assert hi[-3] == lo[-3] == 0 and np.isnan(hi[-1]) and np.isnan(lo[-1])


def test_round_to_e4m3_is_the_e4m3_conversion_in_f32():
  """``round_to_e4m3`` (q_hi's rounding by integer operations) gives, bit for bit, what ml_dtypes' e4m3
  conversion gives: every finite e4m3 value, every midpoint between neighbours (ties to even) and the f32 values
  beside it, random values over nine decades (e4m3's subnormals included), both zeros; NaN stays NaN."""
  finite = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  grid = np.unique(finite[np.isfinite(finite)])
  mids = (grid[:-1] + grid[1:]) / 2
  rng = np.random.default_rng(5)
  spread = rng.uniform(-1, 1, 100_000) * 10.0 ** rng.uniform(-6, np.log10(448), 100_000)
  x = np.concatenate([grid, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                      spread, [0.0, -0.0, 448.0, -448.0]]).astype(np.float32)
  got = np.asarray(mla_kernel.round_to_e4m3(jnp.asarray(x)))
  assert got.dtype == np.float32 and got.shape == x.shape
  np.testing.assert_array_equal(got.view(np.uint32), x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32).view(
      np.uint32))
  assert np.isnan(np.asarray(mla_kernel.round_to_e4m3(jnp.asarray([np.nan], jnp.float32)))).all()


def test_q_in_two_e4m3_parts():
  """``split_e4m3``: each element within ``2^-8 |q| + 2^-14 s_q`` (the bound ``split_q_logit_bound`` uses) over
  six decades of magnitude; an all-zero row is exact with ``s_q = 1``; a NaN or inf row gives a non-finite
  ``s_q`` or NaN parts, never finite logits."""
  rng = np.random.default_rng(4)
  q = rng.standard_normal((3, 8, DIM)) * 10.0 ** rng.uniform(-4, 2, (3, 8, DIM))
  q[1, 2] = 0.0
  q[2, 3, 7], q[2, 4, 9] = np.nan, np.inf
  q = jnp.asarray(q, jnp.bfloat16)
  parts, amax = mla_kernel.split_e4m3(q)
  assert parts.shape == (3, 16, DIM) and parts.dtype == FP8 and amax.shape == (3, 8) and amax.dtype == jnp.float32
  parts, s_q = np.asarray(parts, np.float64), np.asarray(cache_format.amax_scale(amax), np.float64)
  with np.errstate(invalid="ignore"):  # the non-finite rows
    back = s_q[..., None] * (parts[:, :8] + parts[:, 8:] / mla_kernel.Q_LO_FACTOR)
  x = np.asarray(q.astype(jnp.float32), np.float64)
  finite = np.isfinite(x).all(-1)
  err = np.abs(back - x)[finite]
  assert (err <= 2.0 ** -8 * np.abs(x[finite]) + 2.0 ** -14 * s_q[finite][:, None] + 1e-30).all()
  assert s_q[1, 2] == 1.0 and (back[1, 2] == 0).all()
  assert not np.isfinite(back[2, 3]).any() and not np.isfinite(back[2, 4]).any()


# The split under jit at XLA's default flags (the tests' conftest disables excess precision), on the default
# device: on a GPU, XLA may fold the e4m3 round trip that q_lo's remainder needs.
_SPLIT_AT_DEFAULT_FLAGS = """
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.mla import cache_format, kernel
q = jnp.asarray(np.random.default_rng(4).standard_normal((4, 16, 576)), jnp.bfloat16)
parts, amax = jax.jit(kernel.split_e4m3)(q)
parts, s_q = (np.asarray(a, np.float64) for a in (parts, cache_format.amax_scale(amax)))
x = np.asarray(q.astype(jnp.float32), np.float64)
err = np.abs(s_q[..., None] * (parts[:, :16] + parts[:, 16:] / kernel.Q_LO_FACTOR) - x)
bound = 2.0 ** -8 * np.abs(x) + 2.0 ** -14 * s_q[..., None]
print(jax.devices()[0].platform, float((err / bound).max()))
"""


def test_q_split_keeps_its_bound_under_jit_at_xlas_default_flags():
  """``test_q_in_two_e4m3_parts``'s bound for the split compiled whole (as ``mla_decode`` runs it) with the flags
  users run with: a GPU compiler that folded q_hi's rounding away would leave q about e4m3's 3 bits."""
  proc = subprocess.run([sys.executable, "-c", _SPLIT_AT_DEFAULT_FLAGS], env=users_xla_env(),
                        cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  platform, worst = proc.stdout.split()[-2:]
  assert platform == jax.default_backend() and float(worst) <= 1.0, proc.stdout


@pytest.mark.parametrize("std", [1e-3, 1.0, 300.0])
def test_row_format(std):
  rng = np.random.default_rng(0)
  x = _rows(rng, (4, 7), std)
  x[..., LATENT_DIM:] *= 25.0  # the rope part at another magnitude gets its own scale
  q = np.asarray(cache_format.quantize_rows(jnp.asarray(x, jnp.float32), FP8, LATENT_DIM))
  assert q.shape == (4, 7, cache_format.row_width(DIM, FP8)) == (4, 7, DIM + cache_format.TAIL)
  assert q.dtype == ml_dtypes.float8_e4m3fn
  tail = np.ascontiguousarray(q[..., DIM:]).view(np.uint8)
  assert (tail[..., 8:] == 0).all()
  scales = tail[..., :8].copy().view("<f4")
  x32 = x.astype(np.float32)
  # amax / 448 in f32, to an ulp (XLA may multiply by the reciprocal).
  np.testing.assert_allclose(scales[..., 0], np.abs(x32[..., :LATENT_DIM]).max(-1) / 448, rtol=2.5e-7, atol=0)
  np.testing.assert_allclose(scales[..., 1], np.abs(x32[..., LATENT_DIM:]).max(-1) / 448, rtol=2.5e-7, atol=0)
  assert np.abs(q[..., :DIM].astype(np.float64)).max() <= 448
  back = np.asarray(cache_format.dequantize_rows(jnp.asarray(q), LATENT_DIM))
  assert back.dtype == ml_dtypes.bfloat16 and back.shape == x.shape
  back = back.astype(np.float64)
  np.testing.assert_array_equal(back, np_decode_rows(q))
  s = np.concatenate([np.broadcast_to(scales[..., :1], x.shape[:-1] + (LATENT_DIM,)),
                      np.broadcast_to(scales[..., 1:], x.shape[:-1] + (ROPE_DIM,))], axis=-1)
  err = np.abs(back - x32)
  normal = np.abs(x32) >= 2.0 ** -6 * s
  assert (err[normal] <= (NORMAL_REL + READ_REL) * np.abs(x32[normal]) * (1 + 1e-6)).all()
  assert (err[~normal] <= SUBNORMAL_ABS * s[~normal] * (1 + 1e-6) + READ_REL * np.abs(x32[~normal])).all()


@pytest.mark.parametrize("batch", [(), (3, 8)])
def test_zero_and_non_finite_parts(batch):
  """Also inside a batch of rows, the shape at which XLA's CPU max reduction skips a NaN
  (``cache_format.part_scale``)."""
  x = np.ones(batch + (4, DIM), np.float32)
  x[..., 0, :] = 0.0
  x[..., 1, 3] = np.nan
  x[..., 2, LATENT_DIM + 5] = np.inf
  x[..., 3, 7] = -np.inf
  back = np.asarray(cache_format.dequantize_rows(cache_format.quantize_rows(jnp.asarray(x), FP8, LATENT_DIM),
                                                 LATENT_DIM)).reshape((-1, 4, DIM))[-1]
  assert (back[0] == 0).all()
  # A non-finite value makes its whole part non-finite (never a finite row that hides it); the other part stays.
  assert np.isnan(back[1, :LATENT_DIM]).all() and (back[1, LATENT_DIM:] == 1).all()
  assert not np.isfinite(back[2, LATENT_DIM:]).any() and (back[2, :LATENT_DIM] == 1).all()
  assert not np.isfinite(back[3, :LATENT_DIM]).any()


def test_sixteen_and_thirty_two_bit_rows_are_unchanged():
  x = jnp.asarray(_rows(np.random.default_rng(1), (3,)), jnp.float32)
  for dtype in (jnp.float32, jnp.bfloat16):
    q = cache_format.quantize_rows(x, dtype, LATENT_DIM)
    assert q.dtype == dtype and q.shape == x.shape and cache_format.row_width(DIM, dtype) == DIM
    assert cache_format.dequantize_rows(q, LATENT_DIM) is q


def _decode_case(rng, lens, heads=8, max_pages=5, peaky=False):
  pages = len(lens) * max_pages + 2
  table = rng.permutation(pages)[:len(lens) * max_pages].reshape(len(lens), max_pages).astype(np.int32)
  q = rng.standard_normal((len(lens), heads, DIM))
  rows = _rows(rng, (pages, PAGE_SIZE))
  if peaky:  # token 0 of each sequence aligned with head 0's query: a logit of about 20
    for b in range(len(lens)):
      rows[table[b, 0], 0] = q[b, 0] * 20 / (K3_MLA_SCALE * q[b, 0] @ q[b, 0])
  rows[table.ravel()[-1]] = np.nan  # rows past every sequence's end are poison (the table's last page)
  return q, rows, table, np.asarray(lens, np.int32)


@pytest.mark.parametrize("partial_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("peaky", [False, True])
def test_mla_decode_over_fp8_rows_is_attention_over_their_values(partial_dtype, peaky):
  rng = np.random.default_rng(2)
  q, rows, table, lens = _decode_case(rng, [0, 1, 63, 65, 4 * PAGE_SIZE], peaky=peaky)
  cache = cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM)
  q_bf16 = jnp.asarray(q, jnp.bfloat16)
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial_dtype, impl="xla",
                           tuning=MlaDecodeTuning(num_splits=3))
  o, lse = mla_decode(q_bf16, cache, jnp.asarray(table), jnp.asarray(lens), config=config, out_dtype=jnp.float32)
  assert o.shape == (5, 8, LATENT_DIM) and o.dtype == jnp.float32 and lse.dtype == jnp.float32
  o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
  assert (o[0] == 0).all() and np.isneginf(lse[0]).all()
  # Exact attention over the values the fp8 rows hold: the bf16/f32 tolerances of the 16-bit cache.
  o_ref, lse_ref = mla_decode_oracle(q_bf16, np_decode_rows(np.asarray(cache)), table, lens, scale=K3_MLA_SCALE)
  tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}[partial_dtype]
  rel = np.linalg.norm(o[1:] - o_ref[1:], axis=-1) / np.linalg.norm(o_ref[1:], axis=-1)
  assert rel.max() < tol
  np.testing.assert_allclose(lse, lse_ref, atol=5e-5, rtol=0)
  # Against the rows before quantisation: e4m3's own error.
  o_raw, _ = mla_decode_oracle(q_bf16, rows, table, lens, scale=K3_MLA_SCALE)
  rel = np.linalg.norm(o[1:] - o_raw[1:], axis=-1) / np.linalg.norm(o_raw[1:], axis=-1)
  assert rel.max() < FP8_VS_UNQUANTISED_REL_L2


# A model of Hopper's e4m3 wgmma accumulation (DeepSeek-V3's report of its fp8 accumulation): each product is
# added to the running sum at the larger of the two exponents and truncated toward zero to about 14 significant
# bits. It covers the chain of additions only, not the error within one instruction's products.
E4M3_WGMMA_BITS = 14


def truncated_e4m3_sum(products: np.ndarray, chunk: int, bits: int = E4M3_WGMMA_BITS) -> np.ndarray:
  """The sum over the last axis as the model above adds it, with a fresh running sum every ``chunk`` products
  (one accumulator each) and those sums added exactly."""
  total = np.zeros(products.shape[:-1])
  for c0 in range(0, products.shape[-1], chunk):
    acc = np.zeros(products.shape[:-1])
    for k in range(c0, min(c0 + chunk, products.shape[-1])):
      p = products[..., k]
      big = np.maximum(np.abs(acc), np.abs(p))
      ulp = np.exp2(np.floor(np.log2(np.where(big > 0, big, 1.0))) - bits + 1)
      acc = acc + np.trunc(p / ulp) * ulp
    total += acc
  return total


@pytest.mark.parametrize(("chunk", "within"), [(mla_kernel.QK_CHUNK, True), (LATENT_DIM, False)])
def test_registers_qk_accumulators_keep_the_gpus_sums_within_the_q_split_bound(chunk, within):
  """The registers path's QK as the GPU adds it (the model above; interpret mode multiplies in f32): the next
  test's peaky case, each token's logit from the e4m3 values and q's two e4m3 parts, the latent products in
  accumulators of ``chunk`` columns. With one accumulator for all 512 the model puts the peaky head of the
  one-token sequence beyond the q split's lse bound, as an H100 did (benchmarks/RESULTS.md, session 40);
  with the kernel's ``QK_CHUNK`` every sequence and head stays within it."""
  rng = np.random.default_rng(3)
  q, rows, table, lens = _decode_case(rng, [0, 1, 63, 65, 4 * PAGE_SIZE - 7], heads=11, peaky=True)
  cache = np.asarray(cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM))
  q_bf16 = jnp.asarray(q, jnp.bfloat16)
  decoded = np_decode_rows(cache, rounded=False)
  _, lse_ref = mla_decode_oracle(q_bf16, decoded, table, lens, scale=K3_MLA_SCALE)
  bound = split_q_logit_bound(q_bf16, decoded, table, lens)
  q8, amax = mla_kernel.split_e4m3(q_bf16)
  q8, s_q = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q8, cache_format.amax_scale(amax)))
  heads = q.shape[1]
  values, scales = (x.astype(np.float64) for x in np_row_parts(cache))
  ok = []
  for b, n in enumerate(lens):
    if not n:
      continue
    pages = table[b, :-(-n // PAGE_SIZE)]
    v, s = values[pages].reshape(-1, DIM)[:n], scales[pages].reshape(-1, 2)[:n]
    parts = []
    for part in (q8[b, :heads], q8[b, heads:]):  # q_hi, q_lo: accumulators of their own
      prods = part[:, None, :] * v[None]  # [heads, tokens, 576], exact
      parts.append((truncated_e4m3_sum(prods[..., :LATENT_DIM], chunk),
                    truncated_e4m3_sum(prods[..., LATENT_DIM:], ROPE_DIM)))
    (lat_hi, rope_hi), (lat_lo, rope_lo) = parts
    latent, rope = lat_hi + lat_lo / mla_kernel.Q_LO_FACTOR, rope_hi + rope_lo / mla_kernel.Q_LO_FACTOR
    logits = (latent * s[:, 0] + rope * s[:, 1]) * s_q[b][:, None] * K3_MLA_SCALE
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ok.append(np.abs(lse - lse_ref[b]) <= 5e-5 + bound[b])
  assert np.concatenate(ok).all() == within


@pytest.mark.parametrize("partial_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("heads", "registers"), [(72, False), (11, False), (11, True)])
def test_kernel_over_fp8_rows_is_attention_over_their_values(kernel_impl, partial_dtype, heads, registers):
  """72 heads: the 64-row tiles' compute warpgroups dequantise each page on chip into the bf16 tile their matmuls
  read. 11: the narrow kernel's memory warpgroup converts each page to f16 unscaled, and the scales enter S and
  P, so its products read the exact ``value * scale``, not its bf16 rounding; or (``registers``) QK reads the
  e4m3 values against q in two e4m3 parts, whose error the logits (and so lse) may carry up to
  ``split_q_logit_bound``. Each against the oracle of the values it reads within the bf16 cache's tolerances,
  and against the XLA path within those twice."""
  rng = np.random.default_rng(3)
  q, rows, table, lens = _decode_case(rng, [0, 1, 63, 65, 4 * PAGE_SIZE - 7], heads=heads, peaky=True)
  cache = cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM)
  q_bf16 = jnp.asarray(q, jnp.bfloat16)
  decoded = {rounded: np_decode_rows(np.asarray(cache), rounded) for rounded in (True, False)}
  refs = {rounded: mla_decode_oracle(q_bf16, decoded[rounded], table, lens, scale=K3_MLA_SCALE)
          for rounded in (True, False)}
  logit_err = split_q_logit_bound(q_bf16, decoded[False], table, lens) if registers else 0.0
  outs = {}
  for impl in ("xla", kernel_impl):
    o_ref, lse_ref = refs[impl == "xla" or not mla_kernel.narrow_applies(heads, FP8)]
    tuning = MlaDecodeTuning(num_splits=2, fp8_in_registers=registers and impl != "xla")
    o, lse = mla_decode(q_bf16, cache, jnp.asarray(table), jnp.asarray(lens), out_dtype=jnp.float32,
                        config=MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=partial_dtype, impl=impl,
                                               tuning=tuning))
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()
    rel = np.linalg.norm(o[1:] - o_ref[1:], axis=-1) / np.linalg.norm(o_ref[1:], axis=-1)
    assert rel.max() < KERNEL_O_REL_L2[partial_dtype], impl
    err = np.abs(lse[1:] - lse_ref[1:])  # sequence 0 is empty: -inf on both sides
    assert (err <= 5e-5 + (logit_err[1:] if tuning.fp8_in_registers else 0.0)).all(), (impl, err.max())
    outs[impl] = o
  rel = np.linalg.norm(outs[kernel_impl][1:] - outs["xla"][1:], axis=-1) / np.linalg.norm(outs["xla"][1:], axis=-1)
  assert rel.max() < 2 * KERNEL_O_REL_L2[partial_dtype]


# lse of the narrow kernel over tens of thousands of tokens against the f64 oracle: f32 running sums of P and
# of the logits' maxima over hundreds of pages, with exact f16 products.
LONG_LSE_ATOL = 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("registers", [False, True])
@pytest.mark.parametrize(("lens", "num_splits"), [([32768, 20000], 4), ([32768] * 4, None)])
def test_gpu_fp8_narrow_kernel_at_32k_tokens_is_attention_over_the_held_values(lens, num_splits, registers):
  """Real sizes at 16 heads, q and rows N(0, 1) (diffuse attention, as in ``benchmarks/mla_decode.py``), in fp8
  rows, with poisoned unused rows: the narrow kernel (the f16 ring, the default, and the fp8 pages in registers)
  against the f64 oracle of the values the rows hold, within the bf16 cache's kernel tolerance (f32 partials).
  Sequences of 32768 and 20000 tokens (512 and 313 pages) in four splits (up to 128 pages a split), and four of
  32768 tokens in the default splits (about 18 pages a split)."""
  q, cache, table, lens = mla_paged_inputs(41, lens, num_heads=16, max_pages=512, q_dtype=jnp.bfloat16)
  fp8 = cache_format.quantize_rows(cache.astype(jnp.float32), FP8, LATENT_DIM)
  assert mla_kernel.narrow_applies(16, FP8)
  with np.errstate(invalid="ignore"):  # the poisoned rows decode to NaN; no sequence reads them
    held = np_decode_rows(np.asarray(fp8), rounded=False)
  o_ref, lse_ref = mla_decode_oracle(q, held, np.asarray(table), np.asarray(lens), scale=K3_MLA_SCALE)
  o, lse = mla_decode(q, fp8, table, lens, out_dtype=jnp.float32, config=MlaDecodeConfig(
      scale=K3_MLA_SCALE, partial_dtype=jnp.float32, impl="pallas",
      tuning=MlaDecodeTuning(num_splits=num_splits, fp8_in_registers=registers)))
  assert o.shape == (len(lens), 16, LATENT_DIM) and o.dtype == jnp.float32 and lse.shape == (len(lens), 16)
  o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
  rel = np.linalg.norm(o - o_ref, axis=-1) / np.linalg.norm(o_ref, axis=-1)
  assert rel.max() < KERNEL_O_REL_L2[jnp.float32], rel.max()
  np.testing.assert_allclose(lse, lse_ref, atol=LONG_LSE_ATOL, rtol=0)


@pytest.mark.parametrize(("narrow", "registers"), [(True, False), (True, True), (False, False)])
def test_non_finite_fp8_rows_propagate_and_unused_rows_do_not(kernel_impl, narrow, registers):
  """test_mla_kernel's poisoned batch in fp8 rows: a NaN or inf written into a token's row makes that part's scale
  non-finite, so the row reads back NaN, and the heads that attend to it (and those of a non-finite q) are
  non-finite exactly where the oracle of the decoded rows has them; the empty sequence stays (0, -inf), the
  poisoned unused pages never reach the result, and the clean heads match. Narrow: the f16 kernel, which applies
  the scales to S and P (its page's largest scale then is non-finite too), or the fp8 pages in registers (whose
  q in two e4m3 parts is non-finite with q); else the 64-row tiles."""
  q, rows, table, lens = _poisoned_inputs()
  cache = cache_format.quantize_rows(rows.astype(jnp.float32), FP8, LATENT_DIM)
  with np.errstate(invalid="ignore"):
    decoded = np_decode_rows(np.asarray(cache), rounded=not narrow)
    o_ref, lse_ref = mla_decode_oracle(q, decoded, table, lens, scale=K3_MLA_SCALE)
    logit_err = split_q_logit_bound(q, decoded, table, lens) if registers else np.zeros(lse_ref.shape)
  bad = ~np.isfinite(o_ref).all(axis=-1)
  assert bad[0].all() and bad[1].all() and bad[2].tolist() == [False, True, False, False]
  assert bad[5].tolist() == [False, False, True, False] and not bad[[3, 4]].any()
  for num_splits in (1, 3):
    o, lse = mla_decode(q, cache, table, lens, out_dtype=jnp.float32,
                        config=MlaDecodeConfig(scale=K3_MLA_SCALE, partial_dtype=jnp.float32, impl=kernel_impl,
                                               tuning=MlaDecodeTuning(num_splits=num_splits, narrow=narrow,
                                                                      fp8_in_registers=registers)))
    o, lse = np.asarray(o, np.float64), np.asarray(lse)
    np.testing.assert_array_equal(~np.isfinite(o).all(axis=-1), bad)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
    assert (o[3] == 0).all() and np.isneginf(lse[3]).all()
    live = ~bad & (np.asarray(lens) > 0)[:, None]
    rel = np.linalg.norm(o[live] - o_ref[live], axis=-1) / np.linalg.norm(o_ref[live], axis=-1)
    assert rel.max() < KERNEL_O_REL_L2[jnp.float32]
    assert (np.abs(lse[live] - lse_ref[live]) <= 5e-5 + logit_err[live]).all()


@pytest.mark.parametrize("impl", ["interpret", "pallas"])
def test_kernels_refuse_a_non_bf16_query(impl):
  rng = np.random.default_rng(3)
  q, rows, table, lens = _decode_case(rng, [5])
  cache = cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM)
  with pytest.raises(NotImplementedError, match="bf16 q_abs"):
    mla_decode(jnp.asarray(q, jnp.float32), cache, jnp.asarray(table), jnp.asarray(lens),
               config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl=impl))


@pytest.mark.parametrize(("num_heads", "narrow", "registers"),
                         [(16, False, False), (128, False, False), (11, True, False), (16, True, False),
                          (11, True, True), (16, True, True)])
@pytest.mark.parametrize("partial_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_kernel_lowers_for_cuda(num_heads, narrow, registers, partial_dtype):
  """Mosaic GPU lowering, layout inference and the shared-memory check of the fp8 variant, on the CPU."""
  shapes = (jax.ShapeDtypeStruct((2, num_heads, DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((9, PAGE_SIZE, DIM + cache_format.TAIL), FP8),
            jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
  f = functools.partial(mla_kernel.mla_decode_partials_mosaic, scale=K3_MLA_SCALE, num_splits=2,
                        partial_dtype=partial_dtype, interpret=False, narrow=narrow, smem_operands=False,
                        registers=registers)
  assert "mosaic_gpu" in jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_fp8_cache_of_the_wrong_width_is_refused():
  q = jnp.zeros((1, 4, DIM), jnp.bfloat16)
  for width in (DIM, DIM + 8):
    with pytest.raises(ValueError, match="kv_cache"):
      mla_decode(q, jnp.zeros((2, PAGE_SIZE, width), FP8), jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                 config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla"))


def test_config_takes_an_fp8_cache():
  assert tiny(cache_dtype=FP8, impl="pallas").cache_dtype == FP8
  cfg = tiny(cache_dtype=FP8, impl="xla")
  assert cfg.cache_dtype == FP8 and cfg.cache_row_width == DIM + cache_format.TAIL
  assert tiny(impl="xla").cache_row_width == DIM
  cache = init_cache(cfg, 2, 100)
  assert all(kv.shape[1:] == (PAGE_SIZE, DIM + cache_format.TAIL) and kv.dtype == FP8 for kv in cache.mla)
  with pytest.raises(ValueError, match="cache_dtype"):
    tiny(cache_dtype=jnp.float8_e5m2, impl="xla")


_FP8_RUNNER = {}


def fp8_runner():
  if not _FP8_RUNNER:
    _FP8_RUNNER["r"] = Runner(tiny(cache_dtype=FP8, impl="xla"))
  return _FP8_RUNNER["r"]


def test_model_with_an_fp8_cache():
  """Chunked prefill and decode read the same fp8 rows a one-shot prefill attends to (f32 elsewhere: only
  summation orders differ); against an f32 cache the logits move by e4m3's rounding of the latent."""
  # Full f32 matmuls: on the GPU XLA would take TF32 for them, whose input rounding differs between the
  # absorbed (decode) and the expanded (prefill) forms of the attention by far more than summation order.
  with jax.default_matmul_precision("highest"):
    r = fp8_runner()
    toks = tokens_for(r.cfg, 2)
    full_logits, full_cache = r.prefill(toks, [9, 5, T - 14], r.cache())
    assert all(kv.dtype == FP8 for kv in full_cache.mla)
    seq0, seq1 = toks[:9], toks[9:14]
    _, cache = r.prefill(np.concatenate([seq0[:6], seq1[:3], tokens_for(r.cfg, 8, T - 9)]), [6, 3, T - 9],
                         r.cache())
    logits, cache = r.prefill(np.concatenate([seq0[6:8], seq1[3:4], tokens_for(r.cfg, 9, T - 3)]), [2, 1, T - 3],
                              cache)
    # The chunked and one-shot forms sum in different f32 orders (XLA's CPU code differs by shape and by CPU), so
    # a latent element at an e4m3 rounding boundary can round to the neighbouring fp8 value in one of them. Its
    # effect on a logit scales with the logits, so the bound does too: 2e-4 of their largest magnitude, far
    # below the fp8 cache's own effect (checked below).
    tol = dict(atol=2e-4 * float(np.abs(np.asarray(full_logits)).max()), rtol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[:2]), np.asarray(full_logits[6:8]), **tol)
    np.testing.assert_allclose(np.asarray(logits[2]), np.asarray(full_logits[12]), **tol)
    step, _ = r.decode([seq0[8], seq1[4], 7], cache)
    np.testing.assert_allclose(np.asarray(step[0]), np.asarray(full_logits[8]), **tol)
    np.testing.assert_allclose(np.asarray(step[1]), np.asarray(full_logits[13]), **tol)
    f32 = Runner(r.cfg.replace(cache_dtype=jnp.float32))
    f32.state = r.state  # the same weights
    ref_logits, _ = f32.prefill(toks, [9, 5, T - 14], f32.cache())
    ref = np.asarray(ref_logits)
    diff = np.abs(np.asarray(full_logits) - ref).max(axis=-1)
    # Most rows move by about the latent's 2.7% rounding; a few by far more, where the perturbation flips an
    # MoE routing choice of this random model (as bf16 caches do, less often): so the median, not the max.
    assert 0 < np.median(diff) < 0.03 * np.abs(ref).max()


def test_cache_writes_take_fp8_rows_exactly_for_an_fp8_cache():
  fp8_cache = jnp.zeros((2, PAGE_SIZE, DIM + cache_format.TAIL), FP8)
  f32_cache = jnp.zeros((2, PAGE_SIZE, DIM), jnp.float32)
  table, seq, pos = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  rows = jnp.ones((1, DIM), jnp.float32)
  for cache, new in ((fp8_cache, jnp.ones((1, DIM + cache_format.TAIL), jnp.float32)),
                     (f32_cache, cache_format.quantize_rows(rows, FP8, LATENT_DIM))):
    with pytest.raises(ValueError, match="kv_new must be fp8 rows"):
      ops.mesh_write_rows(cache, new, table, seq, pos)
  written = ops.mesh_write_rows(fp8_cache, cache_format.quantize_rows(rows, FP8, LATENT_DIM), table, seq, pos)
  np.testing.assert_array_equal(np.asarray(cache_format.dequantize_rows(written[0, :1], LATENT_DIM)), rows)
  assert np.asarray(cache_format.dequantize_rows(written, LATENT_DIM))[:, 1:].max() == 0


def test_narrow_kernel_entry_names_both_head_limits():
  q = jnp.zeros((1, 17, DIM), jnp.bfloat16)
  cache = jnp.zeros((2, PAGE_SIZE, DIM + cache_format.TAIL), FP8)
  with pytest.raises(NotImplementedError, match="32 heads with a bf16 cache or 16 with an fp8 one, got 17"):
    mla_kernel.mla_decode_partials_mosaic(q, cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                                          scale=K3_MLA_SCALE, num_splits=1, partial_dtype=jnp.float32,
                                          interpret=True, narrow=True)


def test_narrow_kernel_refuses_an_fp8_cache_past_16_heads():
  rng = np.random.default_rng(4)
  q, rows, table, lens = _decode_case(rng, [70], heads=17)
  cache = cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM)
  with pytest.raises(NotImplementedError, match="16 with an fp8 one, got q_abs with 17 .* float8_e4m3fn kv_cache"):
    mla_decode(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(table), jnp.asarray(lens),
               config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="interpret", tuning=MlaDecodeTuning(narrow=True)))


def test_fp8_pages_stay_in_registers_by_default_where_the_narrow_kernel_reads_them():
  """``default_tuning``: ``fp8_in_registers`` wherever the narrow kernel reads an fp8 cache (Hq <= 16), nowhere
  else; ``mla_decode`` without a tuning takes that path (the same bits as asking for it), and a tuning that asks
  for the 64-row tiles over an fp8 cache leaves it off instead of refusing."""
  for heads, dtype, want in ((16, FP8, True), (17, FP8, False), (16, jnp.bfloat16, False)):
    tuning = api.default_tuning(2, heads, 8, cache_dtype=dtype)
    assert tuning.fp8_in_registers is want and tuning.narrow is (heads <= 16 or dtype == jnp.bfloat16)
  rng = np.random.default_rng(6)
  q, rows, table, lens = _decode_case(rng, [70, 0, 1], heads=8)
  args = (jnp.asarray(q, jnp.bfloat16), cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM),
          jnp.asarray(table), jnp.asarray(lens))
  run = lambda tuning: [np.asarray(x) for x in mla_decode(
      *args, config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="interpret", tuning=tuning))]
  by_default, asked = run(None), run(MlaDecodeTuning(fp8_in_registers=True))
  for got, want in zip(by_default, asked):
    np.testing.assert_array_equal(got, want)
  ring = run(MlaDecodeTuning(fp8_in_registers=False))
  assert not all(np.array_equal(a, b) for a, b in zip(ring, asked))  # the two paths round differently
  wide = run(MlaDecodeTuning(narrow=False))
  np.testing.assert_allclose(wide[0].astype(np.float32), ring[0].astype(np.float32), atol=2e-2)


def test_fp8_in_registers_needs_the_narrow_kernel_over_an_fp8_cache():
  rng = np.random.default_rng(4)
  q, rows, table, lens = _decode_case(rng, [70], heads=8)
  q = jnp.asarray(q, jnp.bfloat16)
  fp8 = cache_format.quantize_rows(jnp.asarray(rows, jnp.float32), FP8, LATENT_DIM)
  for cache, narrow, got in ((jnp.asarray(rows, jnp.bfloat16), None, "narrow=True and a bfloat16"),
                             (fp8, False, "narrow=False and a float8_e4m3fn")):
    with pytest.raises(NotImplementedError, match=f"fp8_in_registers=True needs .* got {got} kv_cache"):
      mla_decode(q, cache, jnp.asarray(table), jnp.asarray(lens),
                 config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="interpret",
                                        tuning=MlaDecodeTuning(narrow=narrow, fp8_in_registers=True)))
  with pytest.raises(ValueError, match="fp8_in_registers must be a bool or None, got 1"):
    MlaDecodeTuning(fp8_in_registers=1)
  # The XLA path has one form: the kernels' knob leaves it as it is.
  o, _ = mla_decode(q, fp8, jnp.asarray(table), jnp.asarray(lens),
                    config=MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla",
                                           tuning=MlaDecodeTuning(fp8_in_registers=True)))
  assert o.shape == (1, 8, LATENT_DIM)
  with pytest.raises(NotImplementedError, match="smem_operands equal to interpret"):
    mla_kernel.mla_decode_partials_mosaic(q, fp8, jnp.asarray(table), jnp.asarray(lens), scale=K3_MLA_SCALE,
                                          num_splits=1, partial_dtype=jnp.float32, interpret=True, narrow=True,
                                          smem_operands=False, registers=True)

"""DCP MLA decode and cache writes on up to 9 CPU devices (impl="xla"), against a float64 NumPy oracle."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import device_mesh

from k3jax import dcp, sharding, steps
from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning, mla_decode
from pallas_kernels.mla.config import LATENT_DIM, ROPE_DIM
from pallas_kernels.testing import K3_MLA_SCALE, MLA_PAD_IDS, mla_attention_oracle, mla_paged_cache

D, DC = LATENT_DIM + ROPE_DIM, LATENT_DIM
PAD_ID = MLA_PAD_IDS[0]  # must never be dereferenced


def oracle(q, tokens, lens):
  """Float64 absorbed MLA decode at K3's scale: q ``[B, H, D]``, tokens ``[B, L, D]``."""
  return mla_attention_oracle(q, tokens, lens, scale=K3_MLA_SCALE)


def make_inputs(rng, batch, heads, lens, dtype=np.float32):
  """Unit-RMS latents (as after kv_a_layernorm) and absorbed queries of unit scale."""
  tokens = rng.standard_normal((batch, max(max(lens), 1), D)).astype(dtype)
  q = rng.standard_normal((batch, heads, D)).astype(dtype)
  return q, tokens


def dcp_table(rng, lens, n):
  """A shuffled local block table shared by all devices; unused entries hold PAD_ID."""
  pages = [dcp.pages_per_device(int(length), n) for length in lens]
  width = max(max(pages), 1)
  ids = rng.permutation(sum(pages) + 2).astype(np.int32)  # two spare pages stay unused
  table = np.full((len(lens), width), PAD_ID, np.int32)
  start = 0
  for b, k in enumerate(pages):
    table[b, :k] = ids[start:start + k]
    start += k
  return table, sum(pages) + 2


def run_dcp(mesh, q, cache, table, lens, partial_dtype):
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla", partial_dtype=partial_dtype)
  q = jax.device_put(q, sharding.named_sharding(mesh, *dcp.Q_NAMES))
  cache = jax.device_put(cache, sharding.named_sharding(mesh, *dcp.CACHE_NAMES))
  return dcp.dcp_mla_decode(q, cache, jnp.asarray(table), jnp.asarray(lens, jnp.int32), mesh=mesh, config=config)


def single_device(q, tokens, lens, partial_dtype):
  """mla_decode on the ordinary paged layout (one split: an unsplit reference)."""
  width = max(-(-max(lens) // 64), 1)
  table = np.arange(len(lens) * width, dtype=np.int32).reshape(len(lens), width)
  cache = mla_paged_cache(tokens, lens, table, table.size)
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla", partial_dtype=partial_dtype,
                           tuning=MlaDecodeTuning(num_splits=1))
  return mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table), jnp.asarray(lens, jnp.int32),
                    config=config)


# Ragged: empty, shorter than 9 (empty local shards on most devices), exactly 9, and several pages per device.
LENS = [0, 1, 5, 9, 10, 150]


@pytest.mark.parametrize("n", [1, 2, 9])
def test_dcp_decode_matches_single_device_and_oracle(n):
  rng = np.random.default_rng(n)
  mesh = device_mesh(n)
  q, tokens = make_inputs(rng, len(LENS), 2 * n, LENS)
  table, pages = dcp_table(rng, LENS, n)
  o, lse = run_dcp(mesh, q, mla_paged_cache(tokens, LENS, table, pages, devices=n), table, LENS, jnp.float32)
  o1, lse1 = single_device(q, tokens, LENS, jnp.float32)
  ref_o, ref_lse = oracle(q, tokens, LENS)
  assert o.shape == (len(LENS), 2 * n, DC) and o.dtype == jnp.float32
  assert lse.shape == (len(LENS), 2 * n) and lse.dtype == jnp.float32
  assert o.sharding.is_equivalent_to(sharding.named_sharding(mesh, *dcp.Q_NAMES), 3)
  assert lse.sharding.is_equivalent_to(sharding.named_sharding(mesh, *dcp.LSE_NAMES), 2)
  o, lse = np.asarray(o), np.asarray(lse)
  # f32 throughout. Each side is within ~2e-6 of the oracle: the f32 LSE (|lse| <= 9, ulp ~1e-6) enters
  # the merge weights exp(lse_d - lse), so a few LSE ulps become ~2e-6 on O(1) outputs; DCP vs one device
  # adds both sides' errors.
  np.testing.assert_allclose(o, np.asarray(o1), rtol=0, atol=6e-6)
  np.testing.assert_allclose(lse[1:], np.asarray(lse1)[1:], rtol=0, atol=6e-6)
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=5e-6)
  np.testing.assert_allclose(lse[1:], ref_lse[1:], rtol=0, atol=5e-6)
  # The empty sequence is the identity (0, -inf) exactly, with no NaN anywhere.
  assert (o[0] == 0).all() and (lse[0] == -np.inf).all()
  assert not np.isnan(o).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("io_dtype", [np.float32, jnp.bfloat16])
def test_partial_dtype_on_the_wire(io_dtype):
  n = 9
  rng = np.random.default_rng(7)
  mesh = device_mesh(n)
  q, tokens = make_inputs(rng, len(LENS), n, LENS, io_dtype)
  table, pages = dcp_table(rng, LENS, n)
  cache = mla_paged_cache(tokens, LENS, table, pages, devices=n)
  ref_o, ref_lse = oracle(q, tokens, LENS)
  vmax = np.abs(ref_o).max()
  err = {}
  for partial in (jnp.float32, jnp.bfloat16):
    o, lse = run_dcp(mesh, q, cache, table, LENS, partial)
    assert o.dtype == io_dtype and lse.dtype == jnp.float32
    o, lse = np.asarray(o, np.float64), np.asarray(lse)
    assert not np.isnan(o).any()
    err[partial] = np.abs(o - ref_o).max()
    # The LSE always travels in f32: the oracle's lse to f32 accuracy over the O(10) logits.
    np.testing.assert_allclose(lse[1:], ref_lse[1:], rtol=0, atol=2e-5)
    # One bf16 rounding of each per-device partial (rel 2^-9), plus a bf16 output if io is bf16 (2^-9).
    tol = 2.0 ** -8 * vmax if (partial == jnp.bfloat16 or io_dtype == jnp.bfloat16) else 5e-6
    assert err[partial] <= tol, (partial, err[partial], tol)
    if partial == jnp.float32:
      # f32 partials stay f32 on the wire even with bf16 activations: the only bf16 rounding is the final
      # one, at most half a bf16 ulp (2^-8 relative) of each output, plus the f32 error (5e-6 above).
      bound = 2.0 ** -8 * np.abs(ref_o) + 5e-6
      assert (np.abs(o - ref_o) <= bound).all(), (np.abs(o - ref_o) - bound).max()
  # f32 partials skip the bf16 rounding of the partials: at least 30x closer to the float64 oracle with f32
  # outputs, and closer with bf16 outputs (rounded once, where bf16 partials are rounded twice).
  assert err[jnp.float32] * (30 if io_dtype == np.float32 else 1) < err[jnp.bfloat16], err


def test_mla_decode_out_dtype():
  """``out_dtype`` sets o's dtype (None: q's); the f32 merge is the same, only its final rounding differs."""
  rng = np.random.default_rng(8)
  lens = [0, 70, 200]
  q, tokens = make_inputs(rng, len(lens), 3, lens, jnp.bfloat16)
  table = np.arange(len(lens) * 4, dtype=np.int32).reshape(len(lens), 4)
  cache = mla_paged_cache(tokens, lens, table, table.size)
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla", partial_dtype=jnp.float32,
                           tuning=MlaDecodeTuning(num_splits=2))
  run = lambda **kw: mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table), jnp.asarray(lens, jnp.int32),
                                config=config, **kw)
  (o_q, lse_q), (o_32, lse_32) = run(), run(out_dtype=jnp.float32)
  assert o_q.dtype == jnp.bfloat16 and o_32.dtype == jnp.float32 and o_32.shape == o_q.shape == (3, 3, DC)
  assert lse_q.dtype == lse_32.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(lse_q), np.asarray(lse_32))
  np.testing.assert_array_equal(np.asarray(o_32.astype(jnp.bfloat16)), np.asarray(o_q))
  assert run(out_dtype="bfloat16")[0].dtype == jnp.bfloat16
  # The f32 output is the oracle to f32 accuracy (inputs are exactly bf16 on both sides).
  ref_o, _ = oracle(q, tokens, lens)
  np.testing.assert_allclose(np.asarray(o_32), ref_o, rtol=0, atol=5e-6)
  with pytest.raises(ValueError, match=r"out_dtype must be one of \['float32', 'bfloat16', 'float16'\], got int32"):
    run(out_dtype=jnp.int32)


def test_dcp_write_places_tokens_on_their_owner_only():
  n = 9
  rng = np.random.default_rng(3)
  mesh = device_mesh(n)
  lens = [0, 3, 9, 70, 700]
  _, tokens = make_inputs(rng, len(lens), 1, lens)
  table, pages = dcp_table(rng, lens, n)
  # Packed tokens in shuffled order, with two skipped entries (seq -1 and position -1) carrying garbage.
  seq_ids = np.concatenate([np.full(length, b) for b, length in enumerate(lens)] + [[-1, 2]]).astype(np.int32)
  positions = np.concatenate([np.arange(length) for length in lens] + [[0, -1]]).astype(np.int32)
  kv_new = np.concatenate([tokens[seq_ids[:-2], positions[:-2]], np.full((2, D), 1e30, np.float32)])
  perm = rng.permutation(len(seq_ids))
  cache = jax.device_put(np.full((n * pages, 64, D), np.nan, np.float32),
                         sharding.named_sharding(mesh, *dcp.CACHE_NAMES))
  write = jax.jit(lambda c, *a: dcp.dcp_write(c, *a, mesh=mesh), donate_argnums=0)
  out = write(cache, jnp.asarray(table), jnp.asarray(seq_ids[perm]), jnp.asarray(positions[perm]),
              jnp.asarray(kv_new[perm]))
  assert out.shape == (n * pages, 64, D) and out.dtype == jnp.float32
  assert out.sharding.is_equivalent_to(sharding.named_sharding(mesh, *dcp.CACHE_NAMES), 3)
  # Bitwise: written rows hold the tokens, every other row keeps its NaN poison.
  np.testing.assert_array_equal(np.asarray(out), mla_paged_cache(tokens, lens, table, pages, devices=n))


@pytest.mark.parametrize("n", [1, 9])
def test_dcp_read_gathers_each_token_from_its_owner(n):
  """``dcp_read`` (``read_local`` without a mesh) returns the rows ``dcp_write`` put there, bitwise (NaN rows
  included), and zeros for skipped tokens (seq -1, position -1, a -1 page)."""
  rng = np.random.default_rng(4)
  lens = [0, 3, 9, 70, 700]
  _, tokens = make_inputs(rng, len(lens), 1, lens)
  tokens[3, 5] = np.nan  # a poisoned row comes back as it is
  table, pages = dcp_table(rng, lens, n)
  cache = mla_paged_cache(tokens, lens, table, pages, devices=n)
  table[1, 0] = -1  # sequence 1's page is no longer held: its tokens read as zeros
  seq_ids = np.concatenate([np.full(length, b) for b, length in enumerate(lens)] + [[-1, 2]]).astype(np.int32)
  positions = np.concatenate([np.arange(length) for length in lens] + [[0, -1]]).astype(np.int32)
  perm = rng.permutation(len(seq_ids))
  if n == 1:
    got = dcp.read_local(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(seq_ids[perm]),
                         jnp.asarray(positions[perm]), n=1, rank=0)
  else:
    mesh = device_mesh(n)
    cache = jax.device_put(cache, sharding.named_sharding(mesh, *dcp.CACHE_NAMES))
    got = jax.jit(lambda *a: dcp.dcp_read(*a, mesh=mesh))(cache, jnp.asarray(table), jnp.asarray(seq_ids[perm]),
                                                          jnp.asarray(positions[perm]))
  want = np.zeros((len(seq_ids), D), np.float32)
  real = seq_ids >= 0
  want[:-2] = tokens[seq_ids[:-2], positions[:-2]]
  want[seq_ids == 1] = 0
  want[~real | (positions < 0)] = 0
  np.testing.assert_array_equal(np.asarray(got), want[perm])


def test_append_token_then_decode():
  n = 9
  rng = np.random.default_rng(4)
  mesh = device_mesh(n)
  lens = np.array([0, 4, 8, 63, 64 * 9], np.int32)  # the last one starts a new page on device 0
  q, tokens = make_inputs(rng, len(lens), n, list(lens + 1))
  table, pages = dcp_table(rng, lens + 1, n)
  before = mla_paged_cache(tokens, lens, table, pages, devices=n)
  cache = jax.device_put(before, sharding.named_sharding(mesh, *dcp.CACHE_NAMES))
  append = jax.jit(lambda c, t, l, x: dcp.dcp_append_token(c, t, l, x, mesh=mesh), donate_argnums=0)
  rows = np.arange(len(lens))
  after = append(cache, jnp.asarray(table), jnp.asarray(lens), jnp.asarray(tokens[rows, lens]))
  after = np.asarray(after)
  changed = np.argwhere(~np.all((after == before) | (np.isnan(after) & np.isnan(before)), axis=-1))
  # Exactly one row per sequence changed, on device (position mod n), holding the new token.
  owners = sorted(int(p) // pages for p, _ in changed)
  assert owners == sorted(int(length) % n for length in lens)
  np.testing.assert_array_equal(after, mla_paged_cache(tokens, lens + 1, table, pages, devices=n))
  o, _ = run_dcp(mesh, q, after, table, lens + 1, jnp.float32)
  np.testing.assert_allclose(np.asarray(o), oracle(q, tokens, lens + 1)[0], rtol=0, atol=5e-6)


def test_hlo_moves_queries_and_partials_never_the_cache():
  n = 9
  rng = np.random.default_rng(5)
  mesh = device_mesh(n)
  q, tokens = make_inputs(rng, len(LENS), n, LENS)
  table, pages = dcp_table(rng, LENS, n)
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla", partial_dtype=jnp.bfloat16)
  step = jax.jit(lambda q, c, t, l: dcp.dcp_mla_decode(q, c, t, l, mesh=mesh, config=config))
  args = (jax.device_put(q, sharding.named_sharding(mesh, *dcp.Q_NAMES)),
          jax.device_put(mla_paged_cache(tokens, LENS, table, pages, devices=n),
                         sharding.named_sharding(mesh, *dcp.CACHE_NAMES)),
          jnp.asarray(table), jnp.asarray(LENS, jnp.int32))
  lowered = step.lower(*args)
  ops = [(op, shape) for op, _, shape in steps.collectives(lowered.compile().as_text())]
  # One all-gather of the queries over heads, one all-to-all of the packed partials (Dc + 2 bf16 halves of
  # the f32 LSE); nothing else, so no latent-cache bytes cross devices.
  assert ops == [("all-gather", (len(LENS), n, D)), ("all-to-all", (1, len(LENS), 1, DC + 2))]
  # The CPU backend widens bf16 collectives when compiling; the program itself sends bf16.
  wire = f"tensor<{n}x{len(LENS)}x1x{DC + 2}xbf16>"
  assert re.search(rf"stablehlo.all_to_all.*\({wire}\) -> {wire}", lowered.as_text())


def test_capacity_follows_the_ambient_mesh():
  assert dcp.capacity(2, 9) == 9 * 2 * 64 and dcp.capacity(3, 1, page_size=16) == 48
  assert dcp.capacity(2) == 128  # no mesh: the plain paged cache
  with jax.set_mesh(device_mesh(9)):
    assert dcp.capacity(2) == 1152
  with jax.set_mesh(device_mesh(1)):
    assert dcp.capacity(2) == 128


def test_validation_errors():
  n = 9
  mesh = device_mesh(n)
  rng = np.random.default_rng(6)
  lens = [5, 20]
  q, tokens = make_inputs(rng, 2, n, lens)
  table, pages = dcp_table(rng, lens, n)
  cache = mla_paged_cache(tokens, lens, table, pages, devices=n)
  config = MlaDecodeConfig(scale=K3_MLA_SCALE, impl="xla")
  decode = lambda q=q, c=cache, t=table, l=lens: dcp.dcp_mla_decode(
      jnp.asarray(q), jnp.asarray(c), jnp.asarray(t), jnp.asarray(l, jnp.int32), mesh=mesh, config=config)
  with pytest.raises(ValueError, match="q_abs: dim 1 .* not a multiple of the 9 devices"):
    decode(q=q[:, :8])
  with pytest.raises(ValueError, match="kv_cache: dim 0"):
    decode(c=cache[:-1])
  with pytest.raises(ValueError, match="seq_lens must lie in"):
    decode(l=[5, n * 64 * table.shape[1] + 1])
  bad = table.copy()
  bad[1, 0] = pages
  with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
    decode(t=bad)
  with pytest.raises(ValueError, match="block_table must have dtype"):
    decode(t=table.astype(np.float32))
  with pytest.raises(ValueError, match="q_abs must be"):
    decode(q=q[0])
  write = lambda ids, pos, x: dcp.dcp_write(jnp.asarray(cache), jnp.asarray(table), jnp.asarray(ids, jnp.int32),
                                           jnp.asarray(pos, jnp.int32), jnp.asarray(x), mesh=mesh)
  with pytest.raises(ValueError, match="positions in"):
    write([0], [n * 64 * table.shape[1]], tokens[0, :1])
  with pytest.raises(ValueError, match="seq_ids must lie in"):
    write([2], [0], tokens[0, :1])
  with pytest.raises(ValueError, match="kv_new must have shape"):
    write([0], [0], tokens[0, :1, :DC])
  with pytest.raises(ValueError, match="seq_lens must have shape"):
    dcp.dcp_append_token(jnp.asarray(cache), jnp.asarray(table), jnp.zeros(3, jnp.int32), jnp.asarray(tokens[:, 0]),
                         mesh=mesh)

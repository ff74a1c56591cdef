"""MLA prefill attention (``pallas_kernels.mla_prefill``): dense reference, blockwise ``impl="xla"`` path and the
Mosaic GPU kernel (interpret mode on the CPU, compiled on a Hopper GPU) vs a float64 NumPy oracle of causal varlen
attention with a rope key shared by all heads."""

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import MlaPrefillConfig, MlaPrefillTuning, mla_prefill_attention, util
from pallas_kernels.mla_prefill import default_tuning, kernel
from pallas_kernels.mla_prefill import reference
from pallas_kernels.mla_prefill.reference import mla_prefill_reference
from pallas_kernels.testing import K3_MLA_SCALE, mla_prefill_oracle, rel_rmse
from support import budget

DN, DR, DV = 8, 4, 6  # small dims; Dv differs from Dn + Dr on purpose
BLOCK = 8
# f32 arithmetic on O(1) logits and values: sums of at most a few hundred terms, a few roundings of 6e-8 each.
F32_ATOL = 2e-5
# bf16 inputs are exact in f32 and f64 alike; the output is rounded once to bf16: half an ulp, 2^-8 relative.
BF16_RTOL = 2.0 ** -8
# Blockwise vs dense in f32: the same f32 terms summed in another order (online rescaling).
PATH_ATOL = 1e-5


def make_inputs(lens, num_heads, dtype=jnp.float32, seed=0, q_std=1.0, dims=(DN, DR, DV)):
  """N(0, 1) keys and values, N(0, q_std) queries (``dims`` = Dn, Dr, Dv) and the ``cu_seqlens`` of ``lens``."""
  rng = np.random.default_rng(seed)
  t = int(sum(lens))
  dn, dr, dv = dims
  x = lambda *shape, std=1.0: jnp.asarray(rng.standard_normal(shape) * std, jnp.float32).astype(dtype)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  return (x(t, num_heads, dn + dr, std=q_std), x(t, num_heads, dn), x(t, dr), x(t, num_heads, dv)), cu


def _xla(scale=None, **blocks):
  return MlaPrefillConfig(scale=scale, impl="xla", tuning=MlaPrefillTuning(**{"block_q": BLOCK, "block_k": BLOCK,
                                                                              **blocks}))


def _check_against_oracle(o, lse, args, cu, scale):
  q = args[0]
  assert o.shape == q.shape[:2] + (DV,) and o.dtype == q.dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  o_ref, lse_ref = mla_prefill_oracle(*args, cu, scale)
  o64 = np.asarray(o, np.float64)
  if q.dtype == jnp.bfloat16:
    np.testing.assert_array_less(np.abs(o64 - o_ref), BF16_RTOL * np.abs(o_ref) + F32_ATOL)
  else:
    np.testing.assert_allclose(o64, o_ref, atol=F32_ATOL)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=F32_ATOL)


LENS = {"one": [1], "block-1": [BLOCK - 1], "block": [BLOCK], "block+1": [BLOCK + 1],
        "packed": [3, 0, BLOCK + 1, 5, 2 * BLOCK + 3], "long": [5 * BLOCK + 3]}


@pytest.mark.parametrize("q_std", [0.3, 1.0, 3.0])
def test_dense_reference_matches_oracle(q_std):
  # q_std 0.3 / 1 / 3: diffuse to peaky attention.
  args, cu = make_inputs(LENS["packed"], 4, q_std=q_std)
  o, lse = mla_prefill_reference(*args, cu_seqlens=cu, scale=0.4)
  _check_against_oracle(o, lse, args, cu, 0.4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_heads", [1, 3, 8])
@pytest.mark.parametrize("case", list(LENS))
def test_blockwise_matches_oracle_and_dense(case, num_heads, dtype):
  args, cu = make_inputs(LENS[case], num_heads, dtype, seed=num_heads)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_xla())
  scale = (DN + DR) ** -0.5
  _check_against_oracle(o, lse, args, cu, scale)
  o_d, lse_d = mla_prefill_reference(*args, cu_seqlens=cu)
  if dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_d), atol=PATH_ATOL)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_d), atol=PATH_ATOL)


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 5), (5, 3), (16, 4), (512, 512)])
def test_block_sizes_do_not_change_the_result(block_q, block_k):
  args, cu = make_inputs(LENS["packed"], 2, seed=3)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_xla(block_q=block_q, block_k=block_k, scale=0.5))
  _check_against_oracle(o, lse, args, cu, 0.5)


def test_tuning_fields_left_none_take_the_default_tuning():
  # A None field is default_tuning's block size: the same static blocks, hence the same computation (bitwise);
  # an explicit block reaches the blockwise loop (here 3-row key blocks: f32 sums in another order).
  args, cu = make_inputs([300, 5, 400], 2, seed=6)
  assert default_tuning() == MlaPrefillTuning(block_q=256, block_k=512, kernel_block_k=128, num_stages=2)
  run = lambda tuning: mla_prefill_attention(*args, cu_seqlens=cu, config=MlaPrefillConfig(impl="xla", tuning=tuning))
  o_default, lse_default = run(None)
  for same in (MlaPrefillTuning(), MlaPrefillTuning(block_q=256), default_tuning()):
    o, lse = run(same)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_default))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_default))
  o_small, lse_small = run(MlaPrefillTuning(block_k=3))
  assert not np.array_equal(np.asarray(o_small), np.asarray(o_default))
  _check_against_oracle(o_small, lse_small, args, cu, (DN + DR) ** -0.5)
  _check_against_oracle(o_default, lse_default, args, cu, (DN + DR) ** -0.5)


def test_empty_batch():
  for lens in ([], [0], [0, 0]):
    args, cu = make_inputs(lens, 3)
    for fn in (lambda: mla_prefill_attention(*args, cu_seqlens=cu, config=_xla()),
               lambda: mla_prefill_reference(*args, cu_seqlens=cu)):
      o, lse = fn()
      assert o.shape == (0, 3, DV) and o.dtype == jnp.float32 and lse.shape == (0, 3) and lse.dtype == jnp.float32


def test_traced_cu_seqlens_under_jit():
  args, cu = make_inputs(LENS["packed"], 2, seed=4)
  o, lse = jax.jit(lambda *a, cu: mla_prefill_attention(*a, cu_seqlens=cu, config=_xla()))(*args, cu=cu)
  _check_against_oracle(o, lse, args, cu, (DN + DR) ** -0.5)


@pytest.mark.parametrize("path", ["blockwise", "dense"])
@pytest.mark.parametrize("where", ["q", "k_nope", "k_rope", "v"])
def test_nan_reaches_exactly_the_rows_that_see_it(where, path):
  """A NaN reaches the later tokens of its own sequence (its head, or all heads via the shared rope key) and
  nothing else; it is never masked away inside a block shared with rows that must not see it."""
  lens = [3, BLOCK + 5, 4]
  args, cu = make_inputs(lens, 3, seed=5)
  run = ((lambda a: mla_prefill_attention(*a, cu_seqlens=cu, config=_xla(block_q=4, block_k=4)))
         if path == "blockwise" else (lambda a: mla_prefill_reference(*a, cu_seqlens=cu)))
  clean_o, clean_lse = (np.asarray(x) for x in run(args))
  tok, head = 3 + 6, 1  # token 6 of the second sequence, in the middle of a key block
  names = ["q", "k_nope", "k_rope", "v"]
  x = np.array(args[names.index(where)])
  x[(tok, head, 0) if where != "k_rope" else (tok, 0)] = np.nan
  o, lse = (np.asarray(y) for y in run(tuple(jnp.asarray(x) if n == where else a for n, a in zip(names, args))))
  seq_end = 3 + BLOCK + 5
  rows = np.arange(sum(lens))
  reached = np.zeros(o.shape[:2], bool)
  later = (rows >= tok) & (rows < seq_end)
  if where == "q":
    reached[tok, head] = True
  elif where == "k_rope":
    reached[later, :] = True
  else:
    reached[later, head] = True
  assert np.isnan(o[reached]).all() and not np.isnan(o[~reached]).any()
  np.testing.assert_allclose(o[~reached], clean_o[~reached], atol=PATH_ATOL)
  lse_nan = reached if where != "v" else np.zeros_like(reached)
  assert np.isnan(lse[lse_nan]).all() and not np.isnan(lse[~lse_nan]).any()
  np.testing.assert_allclose(lse[~lse_nan], clean_lse[~lse_nan], atol=PATH_ATOL)


def test_bad_inputs_raise():
  (q, kn, kr, v), cu = make_inputs([3, 4], 2)
  good = dict(q=q, k_nope=kn, k_rope=kr, v=v)
  cases = [
      (dict(q=q[0]), "q must have shape"),
      (dict(k_nope=kn[:5]), "k_nope must have shape"),
      (dict(k_nope=jnp.zeros((7, 2, DN + DR + 1))), "k_nope last dim"),
      (dict(k_rope=jnp.broadcast_to(kr[:, None], (7, 2, DR))), "k_rope must have shape"),
      (dict(k_rope=kr[:, :2]), "k_rope must have shape"),
      (dict(v=v[:, :1]), "v must have shape"),
      (dict(v=v.astype(jnp.bfloat16)), "v must have dtype"),
      (dict(q=q.astype(jnp.int32)), "q must have dtype"),
  ]
  for change, msg in cases:
    args = {**good, **change}
    with pytest.raises(ValueError, match=msg):
      mla_prefill_attention(args["q"], args["k_nope"], args["k_rope"], args["v"], cu_seqlens=cu, config=_xla())
  for bad_cu, msg in [(cu.astype(jnp.float32), "cu_seqlens must have dtype"),
                      (jnp.zeros((0,), jnp.int32), r"cu_seqlens must have shape \(N \+ 1,\)"),
                      (jnp.asarray([0, 5, 3, 7], jnp.int32), "non-decreasing from 0 to T = 7"),
                      (jnp.asarray([0, 3, 6], jnp.int32), "non-decreasing from 0 to T = 7")]:
    with pytest.raises(ValueError, match=msg):
      mla_prefill_attention(q, kn, kr, v, cu_seqlens=bad_cu, config=_xla())
  for kw, msg in [(dict(block_q=0), "block_q must be an int >= 1"), (dict(block_k=2.0), "block_k must be an int"),
                  (dict(block_q=True), "block_q must be an int"),
                  (dict(num_stages=1), "num_stages must be an int >= 2"),
                  (dict(kernel_block_k=96), r"kernel_block_k must be one of \(64, 128\)"),
                  (dict(kernel_block_k=True), "kernel_block_k must be one of")]:
    with pytest.raises(ValueError, match=msg):
      MlaPrefillTuning(**kw)
  for kw, msg in [(dict(scale=-1.0), "scale must be a finite float > 0"),
                  (dict(scale="x"), "scale must be a finite float"), (dict(impl="cuda"), "impl must be one of"),
                  (dict(tuning=dict(block_q=4)), "tuning must be an MlaPrefillTuning or None")]:
    with pytest.raises(ValueError, match=msg):
      MlaPrefillConfig(**kw)
  # Valid inputs the kernel does not take: f32, and head dims that are not multiples of 64.
  for impl in ("pallas", "interpret"):
    with pytest.raises(NotImplementedError, match="bf16 or f16 inputs, got q dtype float32"):
      mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, config=MlaPrefillConfig(impl=impl))
    with pytest.raises(NotImplementedError, match="k_nope's last dim to be a positive multiple of 64, got 8"):
      mla_prefill_attention(*(x.astype(jnp.bfloat16) for x in (q, kn, kr, v)), cu_seqlens=cu,
                            config=MlaPrefillConfig(impl=impl))


def test_long_prompt_lowers_without_a_t_by_t_array():
  """T = 32768, H = 11 (K3 heads over 9 devices, rounded up) compiles on the CPU with a working set far below
  one ``[T, T]`` f32 array (4 GiB; the dense form's ``[H, T, T]`` scores are 44 GiB). Compiled, not run."""
  t, h = 32768, 11
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  args = (spec(t, h, 192), spec(t, h, 128), spec(t, 64), spec(t, h, 128), jax.ShapeDtypeStruct((5,), jnp.int32))
  config = MlaPrefillConfig(impl="xla", tuning=MlaPrefillTuning(block_q=256, block_k=512))
  fn = lambda q, k_nope, k_rope, v, cu: mla_prefill_attention(q, k_nope, k_rope, v, cu_seqlens=cu, config=config)
  compiled = jax.jit(fn).lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  # The working set is the stacked outputs, O(T * H * Dv), and a few [H, 256, 512] f32 score blocks (5.5 MiB
  # each): below the bf16 bytes of q alone, and far below one [T, T] array: 1/64 of it on the CPU, 1/32 on a GPU
  # (XLA's GPU buffer assignment keeps more).
  assert temp < t * h * 192 * 2
  assert temp < t * t * 4 // (64 if jax.default_backend() == "cpu" else 32)
  assert not re.search(rf"\b{t},(\d+,)*{t}\b", compiled.as_text())


def test_logits_multiply_in_f32():
  """bf16 q and keys reach the logits' dots as f32 operands. On the H200, XLA lowered the blockwise path's small
  bf16 dots as a bf16 multiply then an f32 sum: every product rounded to bf16, the LSE off by 2e-3 (found by the
  randomized test below on the GPU). The CPU computes those products exactly, so the lowering is checked."""
  t, h = 6, 2
  args = [jnp.zeros(shape, jnp.bfloat16) for shape in ((t, h, DN + DR), (t, h, DN), (t, DR))]
  text = jax.jit(lambda *a: reference.logits(*a, scale=0.5)).lower(*args).as_text()
  dots = re.findall(r"stablehlo.dot_general.*", text)
  assert len(dots) == 2 and all("bf16" not in d for d in dots), dots


@budget(cpu=8, gpu=60)
@given(lens=st.lists(st.integers(0, 40), min_size=0, max_size=4), num_heads=st.integers(1, 4),
       block_q=st.integers(1, 24), block_k=st.integers(1, 24), bf16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_randomized_blockwise_vs_oracle(lens, num_heads, block_q, block_k, bf16, seed):
  args, cu = make_inputs(lens, num_heads, jnp.bfloat16 if bf16 else jnp.float32, seed=seed)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_xla(block_q=block_q, block_k=block_k))
  _check_against_oracle(o, lse, args, cu, (DN + DR) ** -0.5)


def keys_apart(lens, extra, num_heads, dtype=jnp.float32, seed=0, spare=3, dims=(DN, DR, DV)):
  """Queries of ``lens`` tokens whose sequences have ``extra`` earlier (cached) tokens each: q ``[T]``, keys
  ``[Tk + spare]`` (the spare rows after the last sequence are NaN: no query may see them) and both pointers."""
  rng = np.random.default_rng(seed)
  dn, dr, dv = dims
  klens = np.asarray(lens) + np.asarray(extra)
  tk = int(klens.sum()) + spare
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  kn, kr, v = x(tk, num_heads, dn), x(tk, dr), x(tk, num_heads, dv)
  if spare:
    kn, kr, v = kn.at[-spare:].set(jnp.nan), kr.at[-spare:].set(jnp.nan), v.at[-spare:].set(jnp.nan)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  cuk = jnp.asarray(np.concatenate([[0], np.cumsum(klens)]), jnp.int32)
  return (x(int(sum(lens)), num_heads, dn + dr), kn, kr, v), cu, cuk


def _check_keys_apart(config, args, cu, cuk):
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, cu_seqlens_k=cuk, config=config)
  o_ref, lse_ref = mla_prefill_oracle(*args, cu, (DN + DR) ** -0.5, cu_seqlens_k=cuk)
  o64 = np.asarray(o, np.float64)
  if args[0].dtype == jnp.bfloat16:
    np.testing.assert_array_less(np.abs(o64 - o_ref), BF16_RTOL * np.abs(o_ref) + F32_ATOL)
  else:
    np.testing.assert_allclose(o64, o_ref, atol=F32_ATOL)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=F32_ATOL)


@pytest.mark.parametrize("lens,extra", [([5, 0, 9, 1], [7, 3, 0, 69]), ([1], [0]), ([BLOCK + 1], [3 * BLOCK - 1])])
def test_keys_apart_match_the_oracle(lens, extra):
  """``cu_seqlens_k``: each sequence's queries are its last tokens over keys packed apart (a chunk after a
  cached prefix, an empty query sequence with keys, key rows past the last sequence never seen)."""
  args, cu, cuk = keys_apart(lens, extra, 3)
  for config in (_xla(), _xla(block_q=3, block_k=5), MlaPrefillConfig(impl="xla")):
    _check_keys_apart(config, args, cu, cuk)
  o, lse = reference.mla_prefill_reference(*args, cu_seqlens=cu, cu_seqlens_k=cuk)
  o_ref, lse_ref = mla_prefill_oracle(*args, cu, (DN + DR) ** -0.5, cu_seqlens_k=cuk)
  np.testing.assert_allclose(np.asarray(o), o_ref, atol=F32_ATOL)
  # Without a prefix the form is the self-attention one.
  (q, kn, kr, v), cu, cuk = keys_apart([4, 9], [0, 0], 2, spare=0)
  same = mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, cu_seqlens_k=cuk, config=_xla())
  plain = mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, config=_xla())
  for a, b in zip(same, plain):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keys_apart_bad_inputs_raise():
  args, cu, cuk = keys_apart([3, 4], [2, 0], 2)
  for bad, msg in [(cuk[:2], r"cu_seqlens_k must have shape \(3,\)"),
                   (cuk.astype(jnp.float32), "cu_seqlens_k must have dtype"),
                   (jnp.asarray([0, 5, 20], jnp.int32), "non-decreasing from 0 to at most Tk = 12"),
                   (jnp.asarray([0, 2, 9], jnp.int32), "at least as many keys as queries")]:
    with pytest.raises(ValueError, match=msg):
      mla_prefill_attention(*args, cu_seqlens=cu, cu_seqlens_k=bad, config=_xla())
  with pytest.raises(ValueError, match=r"v must have shape \(12, 2, \*\), got \(5, 2, 6\)"):  # Tk: k_nope's rows
    mla_prefill_attention(*args[:3], args[3][:5], cu_seqlens=cu, cu_seqlens_k=cuk, config=_xla())


@budget(cpu=8, gpu=20)
@given(lens=st.lists(st.integers(0, 30), min_size=1, max_size=3), extra=st.lists(st.integers(0, 40), min_size=3,
                                                                                  max_size=3),
       num_heads=st.integers(1, 3), block_q=st.integers(1, 24), block_k=st.integers(1, 24), bf16=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_randomized_keys_apart_vs_oracle(lens, extra, num_heads, block_q, block_k, bf16, seed):
  args, cu, cuk = keys_apart(lens, extra[:len(lens)], num_heads, jnp.bfloat16 if bf16 else jnp.float32, seed)
  _check_keys_apart(_xla(block_q=block_q, block_k=block_k), args, cu, cuk)


# ------------------------------------------------------------------------------------ in the MLA layer
@pytest.mark.parametrize("prefix_rows", [None, 29, 64, 1000])
def test_layer_chunked_prefill_matches_oracle(prefix_rows):
  """A fresh prefill then a chunked one whose sequences read their 20 and 9 cached rows back (``prefix_rows``:
  None, the capacity bound; 29, exact; 64, the rounded bound; 1000, loose) equal the non-absorbed float64
  oracle over the whole sequences; a bound below 29 makes the chunk's output NaN, never short."""
  from flax import nnx
  from layer_oracles import np_mla, npf, rand_x, run_module, tiny

  import k3jax.layers.mla as mla_layer
  from k3jax.cache import init_cache

  cfg = tiny()
  m = mla_layer.MlaLayer(cfg, rngs=nnx.Rngs(8))
  table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
  kv = init_cache(cfg, 2, 128).mla[0]

  def step(x, kv, lens, prefix, rows):
    seq = np.repeat(np.arange(2), lens).astype(np.int32)
    pos = (np.concatenate([np.arange(n) for n in lens]) + np.asarray(prefix)[seq]).astype(np.int32)
    fn = lambda m, x, kv, s, p, pre: m.prefill(x, kv, seq=s, pos=p, block_table=table, prefix_lens=pre,
                                               prefix_rows=rows)
    return run_module(m, fn, x, kv, jnp.asarray(seq), jnp.asarray(pos), jnp.asarray(prefix, jnp.int32))

  x0, x1 = rand_x(cfg, 29, seed=1), rand_x(cfg, 17, seed=2)
  y0, kv = step(x0, kv, [20, 9], [0, 0], 0)
  y1, _ = step(x1, kv, [11, 6], [20, 9], prefix_rows)
  seqs = [np.concatenate([npf(x0)[:20], npf(x1)[:11]]), np.concatenate([npf(x0)[20:], npf(x1)[11:]])]
  want = [np_mla(cfg, m, s, np.array([0, len(s)]))[0] for s in seqs]
  # f32 activations against a float64 oracle (the tolerance of tests/test_layers.py).
  np.testing.assert_allclose(np.asarray(y0), np.concatenate([want[0][:20], want[1][:9]]), atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(np.asarray(y1), np.concatenate([want[0][20:], want[1][9:]]), atol=2e-4, rtol=2e-4)
  short, _ = step(x1, kv, [11, 6], [20, 9], 28)
  assert np.isnan(np.asarray(short)).all()


def test_layer_prefill_of_a_long_prompt_compiles_to_a_bounded_working_set():
  """The K3 MLA layer (96 heads, one device, bf16) prefilling T = 32768 fresh tokens compiles (not run) to a
  working set of O(T * H * D). Before: the dense [H, T, T] f32 scores (384 GiB), and a cached-prefix attention
  gathering ``[T, capacity, 576]``, reserved by XLA even when no prefix exists (the measurements are in
  benchmarks/RESULTS.md)."""
  from benchmarks import prefill_memory

  temp = prefill_memory.layer_temp_bytes(32768)
  # A few [T, H, D] buffers in bf16 and f32 (q, k, v, the output and its projections): about 1.2 GiB each in
  # f32; 12 GiB leaves room for XLA's buffer assignment to change.
  assert temp < 12 * 2 ** 30


# ------------------------------------------------------------------------------------ the Mosaic GPU kernel
K3_DIMS = (128, 64, 128)  # Dn, Dr, Dv
# The kernel rounds each softmax weight to bf16 before P @ V (relative error at most U_BF16) and the output once
# more, while the logits and the softmax statistics stay f32. So per element |o - o_oracle| <= U_BF16 * (sum_j
# p_j |v_j| / l + |o|) plus f32 rounding, and the first term is the oracle's output for |v|. The slack covers
# the wgmma's f32 accumulation, which does not round to nearest.
U_BF16 = 2.0 ** -8
BOUND_SLACK = 1.25
KERNEL_ATOL = 1e-5
# f32 logits of O(10) and (on the GPU) approx exp2 / log2: the LSE of the decode kernel's tests.
LSE_ATOL = 2e-5
# The bound above, summarised: bf16 P and output over O(1) values average to a relative L2 error near 1e-3.
O_REL_L2 = 5e-3


def _kernel_config(impl, block_k=None, num_stages=None):
  return MlaPrefillConfig(impl=impl, tuning=MlaPrefillTuning(kernel_block_k=block_k, num_stages=num_stages))


def _check_kernel(o, lse, o_ref, lse_ref, o_ref_abs_v, rows=slice(None)):
  """The kernel's ``o``, ``lse`` against a reference's (the float64 oracle, or a path checked against it), within
  the bound above (``o_ref_abs_v``: the reference's output for ``|v|``), on ``rows``."""
  o64 = np.asarray(o, np.float64)[rows]
  o_ref, lse_ref = o_ref[rows], lse_ref[rows]
  np.testing.assert_array_less(np.abs(o64 - o_ref),
                               BOUND_SLACK * U_BF16 * (o_ref_abs_v[rows] + np.abs(o_ref)) + KERNEL_ATOL)
  assert rel_rmse(o64, o_ref) < O_REL_L2
  np.testing.assert_allclose(np.asarray(lse)[rows], lse_ref, atol=LSE_ATOL)


# lens, heads, kernel block_k and stages (None: default_tuning's), q_std, dtype. Lengths 1, 127 and 129 straddle
# a 128-row query block, 63 / 65 a 64-row key block; "packed" has empty sequences (one last), query blocks that
# span several sequences and sequence starts inside key blocks, with peaky attention (q_std 2). The bound holds
# for f16 too (its P rounds to 2^-11).
KERNEL_CASES = {
    "one": ([1], 1, None, None, 1.0, jnp.bfloat16),
    "q-block-1": ([127], 1, 64, 3, 1.0, jnp.bfloat16),
    "q-block+1": ([129], 2, None, None, 1.0, jnp.bfloat16),
    "k-block+-1": ([65, 63, 1], 1, 64, 2, 1.0, jnp.bfloat16),
    "packed": ([3, 0, 129, 5, 70, 0], 2, 64, 4, 2.0, jnp.bfloat16),
    "f16": ([40, 100], 1, None, None, 1.0, jnp.float16),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_oracle_and_xla(kernel_impl, case):
  lens, heads, block_k, stages, q_std, dtype = KERNEL_CASES[case]
  args, cu = make_inputs(lens, heads, dtype, seed=len(lens) + heads, q_std=q_std, dims=K3_DIMS)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_kernel_config(kernel_impl, block_k, stages))
  t = sum(lens)
  assert o.shape == (t, heads, K3_DIMS[2]) and o.dtype == dtype
  assert lse.shape == (t, heads) and lse.dtype == jnp.float32
  o_ref, lse_ref = mla_prefill_oracle(*args, cu, K3_MLA_SCALE)
  o_ref_abs_v, _ = mla_prefill_oracle(*args[:3], np.abs(np.asarray(args[3], np.float64)), cu, K3_MLA_SCALE)
  _check_kernel(o, lse, o_ref, lse_ref, o_ref_abs_v)
  # Against the xla path (f32 throughout, rounded once): the same bound, plus that path's own output rounding.
  o_xla, lse_xla = (np.asarray(x, np.float64) for x in mla_prefill_attention(*args, cu_seqlens=cu,
                                                                               config=MlaPrefillConfig(impl="xla")))
  _check_kernel(o, lse, o_xla, lse_xla, o_ref_abs_v + np.abs(o_ref))


@pytest.mark.parametrize("block_k", [64, 128])
def test_block_table_ranges(block_k):
  """``kernel.block_table`` on random non-decreasing bounds (empty rows and ``lo > hi`` included): each consumer's
  range holds every key its rows see, its full blocks are inside every row's range of the program (no mask
  needed), and each of its masked blocks is a checked one (outside ``[F0, F1)``: V cleaned, flags written)."""
  rng = np.random.default_rng(block_k)
  table_fn = jax.jit(functools.partial(kernel.block_table, block_k=block_k))
  nq = 3
  for _ in range(50):
    tk = int(rng.integers(1, 1200))
    lo = np.sort(rng.integers(0, tk + 1, nq * kernel.BLOCK_Q))
    hi = np.sort(np.clip(lo + rng.integers(-40, 400, lo.shape), 0, tk))
    table = np.asarray(table_fn(jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)))
    for qb in range(nq):
      p0, p1, f0, f1 = table[qb, :4]
      rows = slice(qb * kernel.BLOCK_Q, (qb + 1) * kernel.BLOCK_Q)
      for w in range(kernel.COMPUTE_WGS):
        a, b, c, d = table[qb, 4 + 4 * w:8 + 4 * w]
        assert p0 <= a <= b <= c <= d <= p1
        r = slice(rows.start + w * kernel.WG_ROWS, rows.start + (w + 1) * kernel.WG_ROWS)
        for row_lo, row_hi in zip(lo[r], hi[r]):
          if row_lo < row_hi:
            assert a * block_k <= row_lo and row_hi <= d * block_k
        for x in range(b, c):
          assert f0 <= x < f1
          assert (lo[rows] <= x * block_k).all() and ((x + 1) * block_k <= hi[rows]).all()
        for x in [*range(a, b), *range(c, d)]:
          assert x < f0 or x >= f1


ON_GPU = util.is_hopper_gpu()
# Interpret mode simulates every warpgroup, copy and barrier: a few sequences of up to 300 tokens on the CPU;
# up to 3000 and K3's 11 heads per device on the GPU.
RANDOM_MAX_LEN, RANDOM_HEADS = (3000, (1, 11)) if ON_GPU else (300, (1, 2))
EDGE_LENS = (0, 1, 63, 64, 65, 127, 128, 129)


@budget(cpu=5, gpu=12)
@given(lens=st.lists(st.one_of(st.sampled_from(EDGE_LENS), st.integers(0, RANDOM_MAX_LEN)), min_size=1, max_size=4),
       heads=st.sampled_from(RANDOM_HEADS), tuning=st.sampled_from([(64, 2), (64, 4), (128, 2)]),
       q_std=st.sampled_from([0.3, 1.0, 3.0]), f16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_randomized_kernel_vs_xla(kernel_impl, lens, heads, tuning, q_std, f16, seed):
  """Random packed batches against the xla path (itself checked against the oracle above), within the bound
  of the kernel's rounding plus that path's output rounding."""
  args, cu = make_inputs(lens, heads, jnp.float16 if f16 else jnp.bfloat16, seed=seed, q_std=q_std, dims=K3_DIMS)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_kernel_config(kernel_impl, *tuning))
  xla = MlaPrefillConfig(impl="xla")
  o_xla, lse_xla = (np.asarray(x, np.float64) for x in mla_prefill_attention(*args, cu_seqlens=cu, config=xla))
  f32_args = [a.astype(jnp.float32) for a in args[:3]] + [jnp.abs(args[3].astype(jnp.float32))]
  o_abs_v = np.asarray(mla_prefill_attention(*f32_args, cu_seqlens=cu, config=xla)[0], np.float64)
  _check_kernel(o, lse, o_xla, lse_xla, o_abs_v + np.abs(o_xla))


def _rows_oracle(q, k_nope, k_rope, v, row_lo, row_hi, scale):
  """float64 attention of query row i over the key rows [row_lo[i], row_hi[i]); ``(0, -inf)`` for none."""
  q, k_nope, k_rope, v = (np.asarray(x, np.float64) for x in (q, k_nope, k_rope, v))
  dn = k_nope.shape[-1]
  o = np.zeros(q.shape[:2] + v.shape[-1:])
  lse = np.full(q.shape[:2], -np.inf)
  for i, (lo, hi) in enumerate(zip(row_lo, row_hi)):
    if lo >= hi:
      continue
    s = (np.einsum("hd,khd->hk", q[i, :, :dn], k_nope[lo:hi]) + np.einsum("hr,kr->hk", q[i, :, dn:], k_rope[lo:hi]))
    s *= scale
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    o[i] = np.einsum("hk,khv->hv", p / p.sum(-1, keepdims=True), v[lo:hi])
    lse[i] = m[:, 0] + np.log(p.sum(-1))
  return o, lse


def test_kernel_general_row_bounds(kernel_impl):
  """The kernel entry over general row bounds, ``Tk != Tq``: a chunked prefill where two sequences with cached
  prefixes of 100 and 37 keys get 30 and 70 new tokens (each sequence's keys packed as prefix then new tokens,
  so the queries are the last rows of their key ranges), then 3 rows that see no key (``lo = hi``). The 20 key
  rows after the sequences are NaN and inside a visited key block, but no row sees them. Dv = 192 > Dn + Dr = 128:
  the output staging tile cannot alias the q tile and takes its own SMEM."""
  prefix, new, key_start = [100, 37], [30, 70], [0, 130]
  row_lo = [s for s, n in zip(key_start, new) for _ in range(n)] + [237] * 3
  row_hi = [s + p + i + 1 for s, p, n in zip(key_start, prefix, new) for i in range(n)] + [237] * 3
  tq, tk, heads = len(row_lo), 237 + 20, 2
  rng = np.random.default_rng(11)
  x = lambda *shape: rng.standard_normal(shape).astype(jnp.bfloat16)
  q, k_nope, k_rope, v = x(tq, heads, 128), x(tk, heads, 64), x(tk, 64), x(tk, heads, 192)
  for a in (k_nope, k_rope, v):
    a[237:] = np.nan
  o, lse = kernel.mla_prefill_mosaic(q, k_nope, k_rope, v, jnp.asarray(row_lo, jnp.int32),
                                     jnp.asarray(row_hi, jnp.int32), scale=K3_MLA_SCALE, block_k=64, num_stages=2,
                                     interpret=kernel_impl == "interpret")
  assert o.shape == (tq, heads, 192) and o.dtype == jnp.bfloat16 and lse.shape == (tq, heads)
  o_ref, lse_ref = _rows_oracle(q, k_nope, k_rope, v, row_lo, row_hi, K3_MLA_SCALE)
  o_ref_abs_v, _ = _rows_oracle(q, k_nope, k_rope, np.abs(v.astype(np.float64)), row_lo, row_hi, K3_MLA_SCALE)
  assert (np.asarray(o[100:], np.float32) == 0).all() and np.isneginf(np.asarray(lse[100:])).all()
  _check_kernel(o, lse, o_ref, lse_ref, o_ref_abs_v, rows=slice(0, 100))


def test_kernel_keys_apart_match_oracle(kernel_impl):
  """``cu_seqlens_k`` through the public function on the kernel: chunks of 70 and 1 new tokens after 60 and 129
  cached ones, an empty query sequence with keys, and NaN key rows after the last sequence."""
  args, cu, cuk = keys_apart([70, 0, 1], [60, 5, 129], 2, jnp.bfloat16, seed=12, dims=K3_DIMS)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, cu_seqlens_k=cuk, config=_kernel_config(kernel_impl, 64, 2))
  o_ref, lse_ref = mla_prefill_oracle(*args, cu, K3_MLA_SCALE, cu_seqlens_k=cuk)
  o_ref_abs_v, _ = mla_prefill_oracle(*args[:3], np.abs(np.asarray(args[3], np.float64)), cu, K3_MLA_SCALE,
                                      cu_seqlens_k=cuk)
  _check_kernel(o, lse, o_ref, lse_ref, o_ref_abs_v)


def _poisoned_prefill():
  """Sequences of 300, 40 and 90 tokens, 2 heads, with NaN / inf planted where the masks matter: a NaN and an inf
  in V of sequence 0 (key blocks on the diagonal of its first query block, full blocks of the later ones), a NaN
  in q and one in k_nope of sequence 1 (the key in a block shared with sequence 2), a NaN in V of sequence 1 in a
  block shared with sequence 0's last rows, an inf in the shared rope key of sequence 2 (every head of its later
  rows) and a NaN in V in the middle of a key block of sequence 2, whose earlier rows see that block."""
  args, cu = make_inputs([300, 40, 90], 2, jnp.bfloat16, seed=9, dims=K3_DIMS)
  q, k_nope, k_rope, v = (np.array(a) for a in args)
  v[5, 0, 3] = np.nan
  v[70, 1, 0] = np.inf
  q[310, 1, 7] = np.nan
  k_nope[320, 0, 1] = np.nan
  v[302, 1, 5] = np.nan
  k_rope[350, 2] = np.inf
  v[420, 0, 9] = np.nan
  return tuple(jnp.asarray(a) for a in (q, k_nope, k_rope, v)), cu


# Interpret mode's wgmma is a NumPy matmul, which warns about the NaN planted on purpose.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("block_k,num_stages", [(64, 4), (128, 2)])
def test_kernel_nan_reaches_exactly_the_rows_that_see_it(kernel_impl, block_k, num_stages):
  """NaN in exactly the (row, head) pairs where the dense reference has NaN, the whole row; every other row as
  the reference (checked against the float64 oracle elsewhere: the oracle itself would leak ``0 * NaN``)."""
  args, cu = _poisoned_prefill()
  o, lse = (np.asarray(x, np.float32) for x in mla_prefill_attention(
      *args, cu_seqlens=cu, config=_kernel_config(kernel_impl, block_k, num_stages)))
  o_ref, lse_ref = (np.asarray(x, np.float64) for x in mla_prefill_reference(*args, cu_seqlens=cu))
  reached = np.isnan(o_ref).any(-1)
  # Anchors of the reference's own pattern: V's NaN and inf reach the later rows of their head only; the rope
  # key's inf gives +inf logits (NaN rows) or -inf ones (finite rows) by the sign of q.
  assert reached[5:300, 0].all() and not reached[:5, 0].any() and reached[70:300, 1].all()
  assert not reached[:70, 1].any() and reached[310, 1] and reached[302:340, 1].all() and reached[420:, 0].all()
  assert not reached[340:350].any() and reached[350:420].any() and not reached[350:420].all()
  np.testing.assert_array_equal(np.isnan(o).any(-1), reached)
  np.testing.assert_array_equal(np.isnan(o).all(-1), reached)
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
  abs_v = jnp.abs(args[3].astype(jnp.float32))
  o_ref_abs_v = np.asarray(mla_prefill_reference(*(a.astype(jnp.float32) for a in args[:3]), abs_v,
                                                 cu_seqlens=cu)[0], np.float64)
  _check_kernel(o, lse, o_ref, lse_ref, o_ref_abs_v, rows=~reached)


def test_kernel_bad_inputs_raise():
  (q, kn, kr, v), cu = make_inputs([3, 4], 2, jnp.bfloat16, dims=K3_DIMS)
  for dims, name in (((128, 32, 128), "k_rope"), ((128, 0, 128), "k_rope"), ((128, 64, 96), "v")):
    args, _ = make_inputs([3, 4], 2, jnp.bfloat16, dims=dims)
    with pytest.raises(NotImplementedError, match=f"{name}'s last dim to be a positive multiple of 64"):
      mla_prefill_attention(*args, cu_seqlens=cu, config=MlaPrefillConfig(impl="pallas"))
  with pytest.raises(ValueError, match="needs .* bytes of SMEM"):
    mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, config=_kernel_config("pallas", 128, 3))
  run = functools.partial(kernel.mla_prefill_mosaic, q, kn, kr, v, scale=1.0, block_k=64, num_stages=2,
                          interpret=True)
  lo, hi = reference.row_bounds(cu, None, 7)
  for bad_lo, bad_hi, msg in [(lo[::-1], hi, "row_lo must be non-decreasing"),
                              (lo, hi.at[-1].set(8), r"row_hi must be non-decreasing within \[0, Tk = 7\]"),
                              (lo[:6], hi, r"row_lo must have shape \(7,\)"),
                              (lo, hi.astype(jnp.float32), "row_hi must have dtype")]:
    with pytest.raises(ValueError, match=msg):
      run(bad_lo, bad_hi)
  with pytest.raises(ValueError, match="v must have shape"):
    kernel.mla_prefill_mosaic(q, kn, kr, v[:, :1], lo, hi, scale=1.0, block_k=64, num_stages=2, interpret=True)


@pytest.mark.parametrize("t,num_heads,tuning,dtype", [
    (32768, 96, None, jnp.bfloat16), (32768, 11, (64, 4), jnp.bfloat16), (4097, 96, (64, 4), jnp.bfloat16),
    (4097, 11, None, jnp.float16)])
def test_kernel_lowers_for_cuda(t, num_heads, tuning, dtype):
  """Mosaic GPU lowering, layout inference and the SMEM check of the compiled kernel at K3's shapes (96 heads, or
  11 per device under tensor parallelism; T = 4097 pads to whole 8-row tiles), on the CPU. Lowering must take
  seconds: a layout-inference blow-up (pallas_kernels/README.md) would take minutes."""
  spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
  args = (spec(t, num_heads, 192), spec(t, num_heads, 128), spec(t, 64), spec(t, num_heads, 128),
          spec(5, dt=jnp.int32))
  config = _kernel_config("pallas", *(tuning or (None, None)))
  f = lambda q, k_nope, k_rope, v, cu: mla_prefill_attention(q, k_nope, k_rope, v, cu_seqlens=cu, config=config)
  start = time.perf_counter()
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert time.perf_counter() - start < 60
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [11, 96])
@pytest.mark.parametrize("tuning", [None, (64, 4)])
def test_gpu_kernel_long_ragged_batches(num_heads, tuning):
  lens = [0, 1, 127, 128, 129, 4097, 3000, 777, 64, 65, 20000]
  args, cu = make_inputs(lens, num_heads, jnp.bfloat16, seed=num_heads, dims=K3_DIMS)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_kernel_config("pallas", *(tuning or (None, None))))
  o_xla, lse_xla = mla_prefill_attention(*args, cu_seqlens=cu, config=MlaPrefillConfig(impl="xla"))
  assert rel_rmse(o, np.asarray(o_xla, np.float64)) < O_REL_L2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_xla), atol=LSE_ATOL)

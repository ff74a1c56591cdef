"""MLA prefill attention (``pallas_kernels.mla_prefill``): dense reference and blockwise ``impl="xla"`` path vs
a float64 NumPy oracle of causal varlen attention with a rope key shared by all heads."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import MlaPrefillConfig, MlaPrefillTuning, mla_prefill_attention
from pallas_kernels.mla_prefill import default_tuning
from pallas_kernels.mla_prefill import reference
from pallas_kernels.mla_prefill.reference import mla_prefill_reference
from pallas_kernels.testing import mla_prefill_oracle
from support import budget

DN, DR, DV = 8, 4, 6  # small dims; Dv differs from Dn + Dr on purpose
BLOCK = 8
# f32 arithmetic on O(1) logits and values: sums of at most a few hundred terms, a few roundings of 6e-8 each.
F32_ATOL = 2e-5
# bf16 inputs are exact in f32 and f64 alike; the output is rounded once to bf16: half an ulp, 2^-8 relative.
BF16_RTOL = 2.0 ** -8
# Blockwise vs dense in f32: the same f32 terms summed in another order (online rescaling).
PATH_ATOL = 1e-5


def make_inputs(lens, num_heads, dtype=jnp.float32, seed=0, q_std=1.0):
  rng = np.random.default_rng(seed)
  t = int(sum(lens))
  x = lambda *shape, std=1.0: jnp.asarray(rng.standard_normal(shape) * std, jnp.float32).astype(dtype)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  return (x(t, num_heads, DN + DR, std=q_std), x(t, num_heads, DN), x(t, DR), x(t, num_heads, DV)), cu


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
  assert default_tuning() == MlaPrefillTuning(block_q=256, block_k=512)
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
                  (dict(block_q=True), "block_q must be an int")]:
    with pytest.raises(ValueError, match=msg):
      MlaPrefillTuning(**kw)
  for kw, msg in [(dict(scale=-1.0), "scale must be a finite float > 0"),
                  (dict(scale="x"), "scale must be a finite float"), (dict(impl="cuda"), "impl must be one of"),
                  (dict(tuning=dict(block_q=4)), "tuning must be an MlaPrefillTuning or None")]:
    with pytest.raises(ValueError, match=msg):
      MlaPrefillConfig(**kw)
  for impl in ("pallas", "interpret"):
    with pytest.raises(NotImplementedError, match="Mosaic GPU prefill kernel is not implemented yet"):
      mla_prefill_attention(q, kn, kr, v, cu_seqlens=cu, config=MlaPrefillConfig(impl=impl))


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
  # each): below the bf16 bytes of q alone, and far below one [T, T] array.
  assert temp < t * h * 192 * 2
  assert temp < t * t * 4 // 64
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


@budget(cpu=12, gpu=60)
@given(lens=st.lists(st.integers(0, 40), min_size=0, max_size=4), num_heads=st.integers(1, 4),
       block_q=st.integers(1, 24), block_k=st.integers(1, 24), bf16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_randomized_blockwise_vs_oracle(lens, num_heads, block_q, block_k, bf16, seed):
  args, cu = make_inputs(lens, num_heads, jnp.bfloat16 if bf16 else jnp.float32, seed=seed)
  o, lse = mla_prefill_attention(*args, cu_seqlens=cu, config=_xla(block_q=block_q, block_k=block_k))
  _check_against_oracle(o, lse, args, cu, (DN + DR) ** -0.5)


def keys_apart(lens, extra, num_heads, dtype=jnp.float32, seed=0, spare=3):
  """Queries of ``lens`` tokens whose sequences have ``extra`` earlier (cached) tokens each: q ``[T]``, keys
  ``[Tk + spare]`` (the spare rows after the last sequence are NaN: no query may see them) and both pointers."""
  rng = np.random.default_rng(seed)
  klens = np.asarray(lens) + np.asarray(extra)
  tk = int(klens.sum()) + spare
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  kn, kr, v = x(tk, num_heads, DN), x(tk, DR), x(tk, num_heads, DV)
  if spare:
    kn, kr, v = kn.at[-spare:].set(jnp.nan), kr.at[-spare:].set(jnp.nan), v.at[-spare:].set(jnp.nan)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  cuk = jnp.asarray(np.concatenate([[0], np.cumsum(klens)]), jnp.int32)
  return (x(int(sum(lens)), num_heads, DN + DR), kn, kr, v), cu, cuk


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


@budget(cpu=8, gpu=40)
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

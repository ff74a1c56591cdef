"""The routed experts' Hopper grouped matmul (``ragged_dot_mgpu``): when it is chosen, that it lowers for the
GPU, and its numerics (Mosaic GPU interpret mode here, compiled on a Hopper GPU) against a float64 oracle.

The kernel leaves the rows past the groups unwritten (NaN in interpret mode): the copies routed to another
device's experts. The tests run such shares and check that nothing of them reaches the sum.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import device_mesh

from k3jax import config as cfg_lib
from k3jax import sharding
from k3jax.cache import init_cache
from k3jax.layers import moe
from k3jax.layers.moe import MoE
from k3jax.model import KimiK3Model
from pallas_kernels import mosaic_interpret

BF16 = jnp.bfloat16
BLOCK = moe.MGPU_BLOCKS["block_n"]  # 128: the widths below divide by it and by block_k
ROWS = moe.MGPU_MIN_ROWS


@pytest.mark.parametrize("impl, dtype, rows, widths, experts, want", [
    ("pallas", BF16, ROWS, (3584, 3072), 896, "mgpu"),  # K3's latent expert widths
    ("pallas", jnp.float16, 65536, (256, 128), 32, "mgpu"),
    ("interpret", BF16, ROWS, (128, 128), 32, "mgpu"),
    ("xla", BF16, 65536, (3584, 3072), 32, "xla"),  # impl
    ("pallas", jnp.float32, 65536, (3584, 3072), 32, "xla"),  # dtype
    ("pallas", BF16, ROWS - 1, (3584, 3072), 32, "xla"),  # decode-sized, rows >= experts: ragged_dot
    ("pallas", BF16, 128, (3584, 3072), 32, "xla"),
    ("pallas", BF16, 65536, (3584, 3136), 32, "xla"),  # 3136 = 49 * 64: divides by block_k, not block_n
    ("pallas", BF16, 65536, (96, 128), 32, "xla"),  # 96: not even by block_k
    ("xla", BF16, 128, (3584, 3072), 880, "gather"),  # a 128-row decode over 880 experts
    ("pallas", BF16, 128, (3584, 3072), 440, "gather"),
    ("pallas", jnp.float32, 65536, (3584, 3072), 896, "xla"),  # rows >= experts
    ("xla", BF16, 880, (3584, 3072), 880, "xla"),
])
def test_backend_selection(impl, dtype, rows, widths, experts, want):
  assert moe.grouped_matmul_backend(impl, dtype, rows, widths, experts) == want


@pytest.mark.parametrize("impl, rows, experts, match", [
    ("cuda", ROWS, 8, "impl must be"), ("pallas", -1, 8, "rows must be"), ("pallas", 1024.0, 8, "rows must be"),
    ("pallas", ROWS, -8, "experts must be"), ("pallas", ROWS, True, "experts must be")])
def test_backend_selection_rejects_bad_input(impl, rows, experts, match):
  with pytest.raises(ValueError, match=match):
    moe.grouped_matmul_backend(impl, BF16, rows, (128, 128), experts)


def _silu_gate(g, u):
  return jax.nn.silu(g) * u


def _problem(t, k, e, de, i, seed=0):
  """bf16 inputs and weights (``w ~ N(0, 1 / fan_in)``: O(1) activations), ids with an unused expert."""
  rng = np.random.default_rng(seed)
  bf = lambda a: jnp.asarray(a, BF16)
  experts = np.stack([rng.choice(e - 1, size=k, replace=False) for _ in range(t)])  # expert e - 1: no copies
  return dict(x=bf(rng.standard_normal((t, de))), experts=jnp.asarray(experts, jnp.int32),
              weights=jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32),
              w1=bf(rng.standard_normal((e, de, i)) / np.sqrt(de)),
              w3=bf(rng.standard_normal((e, de, i)) / np.sqrt(de)),
              w2=bf(rng.standard_normal((e, i, de)) / np.sqrt(i)))


def _oracle(x, experts, weights, w1, w3, w2):
  """float64 ``sum_j weights[t, j] * (silu(x W1) * (x W3)) W2`` of expert ``experts[t, j]``."""
  x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
  experts, weights = np.asarray(experts), np.asarray(weights, np.float64)
  out = np.zeros_like(x)
  for e in range(w1.shape[0]):
    tok, slot = np.nonzero(experts == e)
    g, u = x[tok] @ w1[e], x[tok] @ w3[e]
    np.add.at(out, tok, weights[tok, slot, None] * ((g / (1 + np.exp(-g))) * u) @ w2[e])
  return out


def _check(got, want):
  """bf16 operands, f32 accumulation; the mgpu path rounds gate, up and y to bf16 once more (2^-9 each)."""
  got = np.asarray(got, np.float64)
  assert not np.isnan(got).any()
  np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max(), rtol=2e-2)


def test_rows_past_the_groups_are_left_unwritten():
  """The premise of the masking tests below: in interpret mode the unwritten rows are NaN."""
  rng = np.random.default_rng(1)
  lhs = jnp.asarray(rng.standard_normal((256, BLOCK)), BF16)
  rhs = jnp.asarray(rng.standard_normal((2, BLOCK, BLOCK)), BF16)
  with mosaic_interpret.interpret_mode():
    out = np.asarray(moe._grouped_matmul(lhs, rhs, jnp.asarray([70, 60], jnp.int32), None, "mgpu"), np.float32)
  assert np.isnan(out[130:]).all() and not np.isnan(out[:130]).any()


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("backend", ["mgpu", "gather"])
def test_expert_shares_match_the_oracle(kernel_impl, backend, skewed):
  """Each half of the experts as one of 2 devices runs it (``_experts_on`` without a mesh: the other half's
  copies are not its own, so the kernel leaves their rows unwritten, the gather multiplies them by a wrong
  expert); the halves add up to the oracle and carry no NaN.

  Balanced routing: each half's copies fit its static share (640 of 1024 rows). Skewed: every copy goes to
  the first half, which must fall back to all rows (the share would drop 384 copies); the second half has
  no copies at all.
  """
  p = _problem(t=ROWS // 4, k=4, e=8, de=BLOCK, i=2 * BLOCK)
  if skewed:
    rng = np.random.default_rng(3)
    p["experts"] = jnp.asarray(np.stack([rng.permutation(4) for _ in range(ROWS // 4)]), jnp.int32)
  assert moe.share_rows(ROWS, 2, BLOCK) == moe.share_rows(ROWS, 2, moe.GATHER_ROWS) == 640
  args = [p[n] for n in ("x", "experts", "weights")]
  halves = []
  for first in (0, 4):
    run = jax.jit(functools.partial(moe._experts_on, act=_silu_gate, dtype=BF16, backend=backend,
                                    interpret=kernel_impl == "interpret", shards=2, first=first))
    weights = [p[w][first:first + 4] for w in ("w1", "w3", "w2")]
    jaxpr = str(jax.make_jaxpr(run)(*args, *weights))
    assert "ragged_dot" not in jaxpr and "cond[" in jaxpr  # on the share, or on all rows
    halves.append(run(*args, *weights))
  for half in halves:
    assert not np.isnan(np.asarray(half)).any()
  want = _oracle(**p)
  _check(halves[0] + halves[1], want)
  xla = jax.jit(functools.partial(moe.routed_experts, act=_silu_gate, dtype=BF16, impl="xla"))
  _check(xla(*args, p["w1"], p["w3"], p["w2"]), want)


def test_expert_parallel_on_a_mesh_through_the_kernel(kernel_impl):
  """``routed_experts`` on a 2-device mesh (4 experts each, one psum) under the kernel equals the oracle.

  Compiled kernels only: interpret mode keeps one barrier table for the process, so two CPU devices
  interpreting at once trip each other's end-of-kernel check (a race in the interpreter, not in the kernel).
  On the CPU the per-device shares are tested one device at a time above, and the mesh wiring of
  ``routed_experts`` by the gather and XLA backends below.
  """
  if kernel_impl != "pallas" or len(jax.devices()) < 2:
    pytest.skip("needs 2 Hopper GPUs (interpret mode cannot run one kernel on two devices at once)")
  p = _problem(t=ROWS // 4, k=4, e=8, de=BLOCK, i=BLOCK, seed=2)
  with jax.set_mesh(sharding.make_mesh(2)):
    run = jax.jit(functools.partial(moe.routed_experts, act=_silu_gate, dtype=BF16, impl=kernel_impl))
    args = (p["x"], p["experts"], p["weights"], p["w1"], p["w3"], p["w2"])
    assert "cond[" in str(jax.make_jaxpr(run)(*args))
    got = run(*args)
  _check(got, _oracle(**p))


@pytest.mark.parametrize("mesh_devices", [None, 2])
def test_decode_over_many_experts_gathers(mesh_devices):
  """64 copies over 160 experts (fewer rows than experts): the ``"gather"`` backend, without and with a mesh
  (a 48-row share of each device, one psum), equals the oracle in f32 and ``ragged_dot`` in bf16."""
  p = _problem(t=16, k=4, e=160, de=BLOCK, i=BLOCK, seed=4)
  args = [p[n] for n in ("x", "experts", "weights", "w1", "w3", "w2")]
  assert moe.share_rows(64, 2, moe.GATHER_ROWS) == 48
  on_mesh = jax.set_mesh(device_mesh(mesh_devices)) if mesh_devices else contextlib.nullcontext()
  got = {}
  # Full f32 products also on a GPU (whose default f32 matmul may round operands to TF32).
  with on_mesh, jax.default_matmul_precision("highest"):
    for dtype in (jnp.float32, BF16):
      run = jax.jit(functools.partial(moe.routed_experts, act=_silu_gate, dtype=dtype, impl="pallas"))
      jaxpr = str(jax.make_jaxpr(run)(*args))
      assert "ragged_dot" not in jaxpr and ("cond[" in jaxpr) == bool(mesh_devices)
      got[dtype] = np.asarray(run(*args), np.float64)
      assert got[dtype].shape == (16, BLOCK) and not np.isnan(got[dtype]).any()
  # bf16-valued operands, f32 products and sums: f32 rounding only.
  np.testing.assert_allclose(got[jnp.float32], _oracle(**p), rtol=1e-5, atol=1e-5 * np.abs(got[jnp.float32]).max())
  # The same bf16 rounding of the activation as ragged_dot; the sums differ in order only.
  want = jax.jit(functools.partial(moe._experts_on, act=_silu_gate, dtype=BF16, backend="xla", interpret=False,
                                   first=0))(*args)
  np.testing.assert_allclose(got[BF16], np.asarray(want, np.float64), rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("rows, shards, want", [(1024, 2, 640), (1024, 1, 1024), (1024, 9, 256), (100, 9, 100),
                                                (262144, 8, 40960)])
def test_share_rows(rows, shards, want):
  assert moe.share_rows(rows, shards, BLOCK) == want


@pytest.mark.slow
def test_moe_layer_takes_the_kernel_from_the_config(kernel_impl):
  """The MoE layer passes ``cfg.impl`` on: the kernel path equals the xla path (same parameters, the same
  routing: the router does not depend on ``impl``) within the extra bf16 roundings."""
  cfg = cfg_lib.preset("tiny", impl="xla", routed_expert_hidden_size=BLOCK, moe_intermediate_size=BLOCK,
                       num_experts=16, num_experts_per_token=8)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((ROWS // 8, cfg.hidden_size)), BF16)
  out = {}
  for impl in ("xla", kernel_impl):
    graph, state = nnx.split(MoE(cfg.replace(impl=impl), rngs=nnx.Rngs(4)))
    out[impl] = np.asarray(jax.jit(lambda s, x, g=graph: nnx.merge(g, s)(x))(state, x), np.float64)
  got, want = out[kernel_impl], out["xla"]
  assert not np.isnan(got).any()
  # y is RMS-normalised and projected in bf16: the layer output is O(1) with bf16 ulps of ~4e-3.
  np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(), rtol=3e-2)
  assert np.abs(got - want).max() > 0  # the kernel path ran: the xla path would agree exactly


@pytest.mark.parametrize("mesh_devices", [None, 2])
def test_lowers_for_cuda(mesh_devices):
  """Mosaic GPU lowering of the three expert matmuls for sm_90a on the CPU (2048 copies, 256 wide, 8 experts),
  without and with a mesh (twice there: the device's share and the all-rows fallback); a decode-sized call
  keeps ``ragged_dot``."""
  on_mesh = jax.set_mesh(device_mesh(mesh_devices)) if mesh_devices else contextlib.nullcontext()
  f = jax.jit(functools.partial(moe.routed_experts, act=_silu_gate, dtype=BF16, impl="pallas"))
  for t, want in ((2048 // 4, 6 if mesh_devices else 3), (16, 0)):
    p = _problem(t=t, k=4, e=8, de=2 * BLOCK, i=2 * BLOCK)
    with on_mesh:
      text = f.trace(p["x"], p["experts"], p["weights"], p["w1"], p["w3"], p["w2"]).lower(
          lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == want


@pytest.mark.gpu
def test_model_prefill_with_the_kernel_matches_ragged_dot(monkeypatch):
  """On a Hopper GPU: a 1-layer model (KDA + MoE) prefill of 256 tokens x 8 experts = 2048 copies under
  ``impl="pallas"``, with the kernel vs with ``ragged_dot`` (threshold raised).

  One MoE layer, so both runs route every token identically (the router's input does not depend on the
  expert backend); with a second MoE layer the extra bf16 roundings reach its router and swap experts of
  near-tied tokens, which moves those tokens' logits by their own size.
  """
  cfg = cfg_lib.preset("tiny", impl="pallas", num_hidden_layers=1, layer_types=("kda",),
                       first_k_dense_replace=0, kda_head_dim=64, routed_expert_hidden_size=BLOCK,
                       moe_intermediate_size=2 * BLOCK, num_experts=16, num_experts_per_token=8)
  model = KimiK3Model(cfg, rngs=nnx.Rngs(5))
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, 256), jnp.int32)
  cu = jnp.asarray([0, 256], jnp.int32)
  logits = {}
  for name, min_rows in (("mgpu", moe.MGPU_MIN_ROWS), ("xla", 1 << 40)):
    monkeypatch.setattr(moe, "MGPU_MIN_ROWS", min_rows)
    graph, state = nnx.split(model)
    run = jax.jit(lambda s, t, c, cache, g=graph: nnx.merge(g, s).prefill(t, c, cache)[0])
    cache = init_cache(cfg, 1, 256)
    text = run.lower(state, tokens, cu, cache).as_text()
    logits[name] = (np.asarray(run(state, tokens, cu, cache), np.float64), text.count("custom_call @mosaic_gpu"))
  (got, calls_mgpu), (want, calls_xla) = logits["mgpu"], logits["xla"]
  assert calls_mgpu - calls_xla == 3  # the three expert matmuls
  assert got.shape == want.shape and not np.isnan(got).any()
  # bf16 activations and logits (ulp 2^-8 relative) plus the kernel path's extra roundings of gate, up and y.
  np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)
  assert np.abs(got - want).max() > 0  # the kernel path ran: the xla path would agree exactly

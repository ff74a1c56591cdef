"""The Kimi MoE block (sigmoid router, bias for selection only, latent experts) and its routed experts.

Routed experts run as three grouped matmuls over the token copies sorted by expert (``routed_experts``:
expert parallel on the ambient mesh, all experts in place without one): ``jax.lax.ragged_dot``, the Hopper
kernel ``ragged_dot_mgpu`` for large bf16 prefills under ``impl="pallas"``, or each copy times its gathered
expert for decodes over many experts (``grouped_matmul_backend``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

from k3jax import nn_util
from k3jax.config import K3Config
from k3jax.layers.mlp import MLP, gated_act
from k3jax.layers.norms import RMSNorm
from k3jax.sharding import MODEL, ambient_mesh, shard_kernel
from pallas_kernels import mosaic_interpret, util


# Block sizes of the Hopper grouped matmul (``ragged_dot_mgpu``): the fastest of those timed on an H200 for
# 65536 rows, 3584 -> 3072, 384 experts (benchmarks/RESULTS.md).
MGPU_BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
# Fewest token copies (rows) for which the routed experts use the Hopper kernel. The kernel walks
# ``cdiv(rows, block_m) + G - 1`` row tiles of full width whatever the routing (every group costs at least
# one tile, and tiles past the groups still compute), so a matmul costs ~``(rows + block_m G) De I``
# multiply-adds; XLA lowers ``ragged_dot`` on the GPU to a dense dot over all G experts: ``rows G De I`` and
# a ``[rows, G, N]`` f32 product (hundreds of GiB for a long prefill over hundreds of experts). A decode of
# a few rows over many experts would walk one tile of one useful row per expert, so decodes take the gather
# or the dense path (``grouped_matmul_backend``; timings in benchmarks/RESULTS.md). At 1024 rows (8 full
# tiles) the dense path does ``rows G / (rows + block_m G)`` ~ 7-8x the kernel's multiply-adds for 96-896
# local experts.
MGPU_MIN_ROWS = 1024
_MGPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# Rows per gathered weight block of the ``"gather"`` backend: its temporary is ``GATHER_ROWS`` experts'
# weights (16 x 3584 x 3072 bf16 = 352 MB at K3 widths).
GATHER_ROWS = 16


def grouped_matmul_backend(impl: str, dtype, rows: int, widths: Sequence[int], experts: int) -> str:
  """Which grouped matmul runs the routed experts: ``"mgpu"``, ``"gather"`` or ``"xla"``.

  ``"mgpu"`` (the Hopper Pallas kernel ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``) needs all of:
  ``impl`` is ``"pallas"`` (or ``"interpret"``: the same kernel in Mosaic GPU interpret mode), ``dtype`` is
  bfloat16 or float16 (the kernel multiplies operands of one 16-bit dtype), ``rows >= MGPU_MIN_ROWS`` (see
  there) and every width divides by ``block_k`` and by ``block_n * grid_block_n`` of ``MGPU_BLOCKS`` (each
  width is the contraction of one expert matmul and the output of another).

  Otherwise ``"gather"`` when ``rows < experts`` (a decode over many experts): each row is multiplied by its
  own expert's weights, gathered ``GATHER_ROWS`` rows at a time, so a matmul reads at most ``rows`` experts'
  weights; XLA's ``ragged_dot`` on the GPU is a dense dot over all ``experts`` (it reads every expert's
  weights, and its autotuner asked 18 GiB for a 128-row decode over 880 experts on an H200). Else
  ``"xla"``: ``jax.lax.ragged_dot``.

  Args:
    impl: the model's kernel backend (``K3Config.impl``).
    dtype: the compute dtype of the expert matmuls.
    rows: token copies per device (``T * k``: every device sees all copies).
    widths: the expert widths ``(De, I)``.
    experts: the experts of one device (``E / N`` on a mesh of N).

  Raises:
    ValueError: ``impl`` is not one of ``util.IMPLS``, or ``rows`` or ``experts`` is not an int >= 0.
  """
  if impl not in util.IMPLS:
    raise ValueError(f"impl must be one of {util.IMPLS}, got {impl!r}")
  for name, value in (("rows", rows), ("experts", experts)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{name} must be an int >= 0, got {value!r}")
  b = MGPU_BLOCKS
  fits = all(w % b["block_k"] == 0 and w % (b["block_n"] * b["grid_block_n"]) == 0 for w in widths)
  if impl != "xla" and jnp.dtype(dtype) in _MGPU_DTYPES and rows >= MGPU_MIN_ROWS and fits:
    return "mgpu"
  return "gather" if rows < experts else "xla"


def _grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, row_group: jax.Array,
                    backend: str) -> jax.Array:
  """Rows ``[M, K]`` times their group's ``rhs [G, K, N]``: f32, or ``lhs.dtype`` for ``"mgpu"``.

  ``group_sizes [G]`` counts the rows of each group (in order); ``row_group [M]`` is each row's group,
  clipped to ``[0, G)`` (``"gather"`` reads it). All accumulate in f32. Rows past ``sum(group_sizes)`` are
  zero (``"xla"``), a product with the last group (``"gather"``) or unwritten garbage, possibly NaN
  (``"mgpu"``); either way a row of the result depends on that row of ``lhs`` only.
  """
  if backend == "mgpu":
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, **MGPU_BLOCKS)
  if backend == "gather":
    return jax.lax.map(lambda r: jnp.dot(r[0], rhs[r[1]], preferred_element_type=jnp.float32),
                       (lhs, row_group), batch_size=GATHER_ROWS)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


# Under expert parallelism each device computes the copies routed to its experts: ``rows / shards`` of the
# ``rows = T * k`` copies when routing is balanced. The Hopper kernel and the gather walk every row of their
# (static) operand, so a device first tries a static share of ``EP_ROW_HEADROOM * rows / shards`` rows (rounded up to
# whole row tiles) and falls back, at run time, to all rows when more copies came its way: never a dropped copy.
EP_ROW_HEADROOM = 1.25


def share_rows(rows: int, shards: int, block: int) -> int:
  """Rows of one device's static share (see ``EP_ROW_HEADROOM``): a multiple of ``block``, at most ``rows``."""
  share = math.ceil(rows * EP_ROW_HEADROOM / shards)
  return min(rows, -(-share // block) * block)


def _experts_on(x, experts, weights, w1, w3, w2, *, first, act, dtype, backend, interpret, shards=1):
  """The token copies routed to experts ``[first, first + E_local)`` through them, weighted; ``[T, De]`` f32.

  Copies routed elsewhere sort after the last group, so the grouped matmuls do not compute them; their rows
  (zero, or garbage from the Hopper kernel) are replaced by zeros before the scatter-add mixes rows. With
  the Hopper kernel or the gather on ``shards > 1`` devices, the first ``share_rows`` sorted rows run when
  the local copies fit there (the usual case), all rows otherwise.
  """
  t, k = experts.shape
  num_local = w1.shape[0]
  local = experts.reshape(-1) - first
  mine = (local >= 0) & (local < num_local)
  group = jnp.where(mine, local, num_local)
  order = jnp.argsort(group, stable=True)
  group_sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)

  x, w1, w3, w2 = (a.astype(dtype) for a in (x, w1, w3, w2))  # once, outside the branches below

  def first_rows(rows):
    copy = order[:rows]
    matmul = functools.partial(_grouped_matmul, group_sizes=group_sizes,
                               row_group=jnp.minimum(group[copy], num_local - 1), backend=backend)
    token = copy // k
    xs = x[token]
    with mosaic_interpret.interpret_mode(interpret):
      gate, up = matmul(xs, w1), matmul(xs, w3)
      h = act(gate.astype(jnp.float32), up.astype(jnp.float32)).astype(dtype)
      y = matmul(h, w2).astype(jnp.float32)
    # A select, not a product with the mask: 0 * NaN would carry a garbage row into the sum.
    y = jnp.where(mine[copy][:, None], y * weights.reshape(-1)[copy][:, None], 0.0)
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[token].add(y)

  share = share_rows(t * k, shards, MGPU_BLOCKS["block_m"] if backend == "mgpu" else GATHER_ROWS)
  if backend == "xla" or share == t * k:
    return first_rows(t * k)
  return jax.lax.cond(group_sizes.sum() <= share, lambda: first_rows(share), lambda: first_rows(t * k))


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                   w2: jax.Array, *, act: Callable, dtype, impl: str = "xla") -> jax.Array:
  """Weighted sum of each token's routed experts, expert parallel on the ambient mesh.

  Each device runs its ``E / N`` experts on the token copies routed to them, and one ``psum`` of the
  ``[T, De]`` f32 partial sums combines the devices: neither the expert weights nor the ``[T * k, I]``
  intermediates cross devices. Without a mesh all experts run in place.

  The three grouped matmuls (gate, up, down) run as ``grouped_matmul_backend(impl, dtype, T * k, (De, I),
  E / N)`` says: ``jax.lax.ragged_dot`` (``"xla"``), each row times its gathered expert (``"gather"``, a
  decode over many experts) or the Hopper Pallas kernel ``ragged_dot_mgpu`` (``"mgpu"``, large bf16
  prefills). All accumulate in f32; they differ in what they hand on. ``"xla"`` and ``"gather"``: gate and up
  in f32, the activation in f32, rounded to ``dtype`` once for the down matmul, whose f32 output is weighted
  and summed in f32. ``"mgpu"``: the kernel writes ``dtype``, so gate and up are rounded to ``dtype`` before
  the (f32) activation, and each copy's down output ``y`` is rounded to ``dtype`` before the f32 weighting and
  sum: two more roundings per copy (relative <= 2^-9 each in bf16), not accumulated over the contractions.
  The kernel and the gather walk every row of their operand (the kernel's tiles past the groups compute into
  rows it does not write), so on a mesh each device hands them only a static share of the sorted copies
  (``share_rows``), or all of them when more than that share was routed to its experts.

  Args:
    x: ``[T, De]`` expert inputs (replicated). experts: ``[T, k]`` int32 ids. weights: ``[T, k]`` f32.
    w1, w3: ``[E, De, I]`` gate and up weights. w2: ``[E, I, De]`` down weights (split by experts).
    act: ``act(gate, up)`` on f32 ``[M, I]`` -> f32 (the gated activation).
    dtype: compute dtype of the grouped matmuls (f32 accumulation).
    impl: the model's kernel backend (``K3Config.impl``); ``"interpret"`` runs the Hopper kernel in
      Mosaic GPU interpret mode (on the CPU; one device at a time, see ``pallas_kernels.mosaic_interpret``).

  Returns:
    ``[T, De]`` f32, replicated.
  """
  mesh = ambient_mesh()
  shards = 1 if mesh is None else mesh.shape[MODEL]
  backend = grouped_matmul_backend(impl, dtype, experts.size, w1.shape[1:], w1.shape[0] // shards)
  run = functools.partial(_experts_on, act=act, dtype=dtype, backend=backend, interpret=impl == "interpret")
  if mesh is None:
    return run(x, experts, weights, w1, w3, w2, first=0)

  def local(x, experts, weights, w1, w3, w2):
    first = jax.lax.axis_index(MODEL) * w1.shape[0]
    return jax.lax.psum(run(x, experts, weights, w1, w3, w2, first=first, shards=shards), MODEL)

  stacked = ("experts", None, None)
  return shard_kernel(local, (None, None, None, stacked, stacked, stacked), None, mesh)(
      x, experts, weights, w1, w3, w2)


class Router(nnx.Module):
  """HF ``KimiMoEGate``: f32 sigmoid scores; ``e_score_correction_bias`` only picks the experts."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e = cfg.num_experts
    self.kernel = nn_util.param(rngs, nn_util.fan_in_normal(cfg.hidden_size), (cfg.hidden_size, e),
                                jnp.float32, ("embed", "experts"))
    self.e_score_correction_bias = nn_util.param(rngs, nn_util.small_normal(0.1), (e,), jnp.float32,
                                                 ("experts",))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]`` -> ``(experts [T, k] int32, weights [T, k] f32)``."""
    cfg = self.cfg
    logits = jnp.dot(x.astype(jnp.float32), self.kernel[...], precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + self.e_score_correction_bias[...], cfg.num_experts_per_token)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
      w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


class Experts(nnx.Module):
  """Stacked routed experts ``w1`` (gate), ``w3`` (up) ``[E, De, I]`` and ``w2`` (down) ``[E, I, De]``."""

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e, de, i = cfg.num_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
    self.w1 = nn_util.param(rngs, nn_util.fan_in_normal(de), (e, de, i), cfg.param_dtype,
                            ("experts", "moe_embed", "moe_mlp"))
    self.w3 = nn_util.param(rngs, nn_util.fan_in_normal(de), (e, de, i), cfg.param_dtype,
                            ("experts", "moe_embed", "moe_mlp"))
    self.w2 = nn_util.param(rngs, nn_util.fan_in_normal(i), (e, i, de), cfg.param_dtype,
                            ("experts", "moe_mlp", "moe_embed"))

  def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum of the chosen experts per token.

    Args:
      x: ``[T, De]`` expert inputs. experts: ``[T, k]`` int32 ids. weights: ``[T, k]`` f32.

    Returns:
      ``[T, De]`` f32.
    """
    return routed_experts(x, experts, weights, self.w1[...], self.w3[...], self.w2[...],
                                   act=functools.partial(gated_act, self.cfg), dtype=self.cfg.dtype,
                                   impl=self.cfg.impl)


class MoE(nnx.Module):
  """HF ``KimiSparseMoeBlock`` (``block_sparse_moe``), with K3's optional latent routed path.

  ``y = up(norm(sum_e w_e expert_e(down(x)))) + shared(x)``; the router always scores the full-width x.
  """

  def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    lin = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.gate = Router(cfg, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.num_shared_experts:
      self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts, rngs=rngs)
    if cfg.routed_expert_hidden_size is not None:
      d, dl = cfg.hidden_size, cfg.routed_expert_hidden_size
      self.routed_expert_down_proj = nn_util.Linear((d,), (dl,), ("embed", "moe_embed"), **lin)
      self.routed_expert_up_proj = nn_util.Linear((dl,), (d,), ("moe_embed", "embed"), **lin)
      if cfg.latent_moe_use_norm:
        self.routed_expert_norm = RMSNorm(dl, eps=cfg.rms_norm_eps, name="moe_embed", dtype=cfg.dtype,
                                          param_dtype=cfg.param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [T, D]`` -> ``[T, D]`` in ``cfg.dtype``."""
    cfg = self.cfg
    experts, weights = self.gate(x)
    latent = cfg.routed_expert_hidden_size is not None
    routed_in = self.routed_expert_down_proj(x) if latent else x
    y = self.experts(routed_in, experts, weights)
    if latent:
      y = self.routed_expert_norm(y) if cfg.latent_moe_use_norm else y.astype(cfg.dtype)
      y = self.routed_expert_up_proj(y)
    y = y.astype(jnp.float32)
    if cfg.num_shared_experts:
      y = y + self.shared_experts(x).astype(jnp.float32)
    return y.astype(cfg.dtype)

"""KDA recurrent decode (one token or ``1 + S`` speculative tokens per sequence) as a Mosaic GPU kernel.

Decode is bound by state bandwidth: an f32 state is ``V * K * 4`` bytes per head (64 KiB at K = V = 128),
read and written once per step, while the token's own inputs are ``K``-sized vectors. So one program per
(V-block of ``BV`` rows, head, sequence) streams its ``[BV, K]`` block of the V-first pool slot in with one
TMA, keeps it in f32 registers (WGMMA layout: rows = V, columns = K) for all of the sequence's tokens, and
streams each token's state back out with one TMA. The pool is updated in place: it is passed as a
``jax.new_ref`` (``plgpu.kernel`` has no ``input_output_aliases``); like every impl of ``kda_decode`` it does
not donate the pool itself: inside an enclosing jit that donates the pool the update happens in place.

Per token, with ``S`` V-first ``[BV, K]`` (spec ``kda.md`` §3, §7), all in f32:
``S *= exp(g)[None, :]``, ``u = beta * (v - S k)``, ``S += u k^T``, ``o = scale * S q``; q and k are
L2-normalised inside (eps 1e-6 added to the sum of squares), the gate and ``sigmoid(beta_raw)`` too.
The norms are folded into row vectors (``S k = (S k_raw) / |k_raw|``), so no vector is reduced on its own.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _interpret, _util
from pallas_kernels.kda.config import KdaConfig
from pallas_kernels.kda.kernel_math import L2NORM_EPS, gate

BLOCK_V = 64  # rows of a WGMMA-layout register tile: one warpgroup, 64 f32 registers per thread at K = 128


def _decode_body(q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, slots_ref, accepted_ref,
                 pool_ref, o_ref, q_smem, k_smem, g_smem, v_smem, bias_smem, s_smem, o_smem, barriers, *,
                 steps: int, speculative: bool, scale: float, lower_bound: float | None):
  vb, h, n = lax.axis_index("vb"), lax.axis_index("h"), lax.axis_index("n")
  rows = pl.ds(pl.multiple_of(vb * BLOCK_V, BLOCK_V), BLOCK_V)
  col = plgpu.Layout.WGMMA.reduce(0)  # [K] vectors, broadcast along the V rows
  row = plgpu.Layout.WGMMA.reduce(1)  # [BV] vectors, broadcast along the K columns
  # Small batches are latency bound: start every load that does not depend on the slot before the
  # dependent chain (slot id -> state TMA), and fetch the scalars while the copies fly.
  inputs = ((q_ref.at[n, :, h], q_smem), (k_ref.at[n, :, h], k_smem), (g_ref.at[n, :, h], g_smem),
            (v_ref.at[n, :, h, rows], v_smem), (dt_bias_ref.at[h], bias_smem))
  for i, (src, dst) in enumerate(inputs):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
  read_slot = slots_ref[n, accepted_ref[n] - 1] if speculative else slots_ref[n, 0]
  live = read_slot >= 0
  rate = jnp.exp(a_log_ref[h].astype(jnp.float32))
  betas = [jax.nn.sigmoid(beta_ref[n, t, h].astype(jnp.float32)) for t in range(steps)]
  state_barrier = barriers.at[len(inputs)]

  @pl.when(live)
  def _():
    plgpu.copy_gmem_to_smem(pool_ref.at[read_slot, h, rows], s_smem, state_barrier)
    for i in range(len(inputs)):
      plgpu.barrier_wait(barriers.at[i])
    bias = plgpu.load(bias_smem, layout=col, optimized=False)
    plgpu.barrier_wait(state_barrier)
    shape = s_smem.shape
    s = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA, optimized=True).astype(jnp.float32)
    along_v = lambda x: lax.broadcast_in_dim(x, shape, (1,))  # a [K] vector repeated on every V row
    along_k = lambda x: lax.broadcast_in_dim(x, shape, (0,))  # a [BV] vector repeated on every K column
    for t in range(steps):
      qv = along_v(plgpu.load(q_smem.at[t], layout=col, optimized=False).astype(jnp.float32))
      kv = along_v(plgpu.load(k_smem.at[t], layout=col, optimized=False).astype(jnp.float32))
      x = plgpu.load(g_smem.at[t], layout=col, optimized=False).astype(jnp.float32) + bias
      v = plgpu.load(v_smem.at[t], layout=row, optimized=False).astype(jnp.float32)
      inv_k = lax.rsqrt(jnp.sum(kv * kv, axis=1) + L2NORM_EPS)
      inv_q = lax.rsqrt(jnp.sum(qv * qv, axis=1) + L2NORM_EPS)
      s = s * along_v(jnp.exp(gate(x, rate, lower_bound)))
      u = betas[t] * (v - jnp.sum(s * kv, axis=1) * inv_k)
      s = s + along_k(u * inv_k) * kv
      if s_smem.dtype != jnp.float32:
        s = s.astype(s_smem.dtype).astype(jnp.float32)  # the next token starts from the stored state
      o_smem[t] = (scale * inv_q * jnp.sum(s * qv, axis=1)).astype(o_smem.dtype)
      dst = slots_ref[n, t]
      if t:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous token's store has left s_smem
      s_smem[...] = s.astype(s_smem.dtype)
      plgpu.commit_smem()

      @pl.when(dst >= 0)
      def _():
        plgpu.copy_smem_to_gmem(s_smem, pool_ref.at[dst, h, rows])

  @pl.when(jnp.logical_not(live))
  def _():
    for i in range(len(inputs)):  # no copy may still be landing in SMEM when the program exits
      plgpu.barrier_wait(barriers.at[i])
    for t in range(steps):
      o_smem[t] = plgpu.layout_cast(jnp.zeros((BLOCK_V,), o_smem.dtype), row)

  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, :, h, rows])
  # Only SMEM must outlive the copies (as CUTLASS epilogues do); the GMEM writes complete on their own
  # before the kernel is considered finished, and the program's slot frees up sooner.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool_ref, state_indices, num_accepted, *,
            config: KdaConfig) -> jax.Array:
  """Runs the kernel on ``[N, 1 + S, ...]`` inputs (``num_accepted`` None: one token, read column 0);
  writes the pool ref, returns ``o``."""
  n, steps, h, kdim = q.shape
  vdim = v.shape[-1]
  scale = kdim ** -0.5 if config.scale is None else config.scale
  state_dtype = pool_ref.dtype
  speculative = num_accepted is not None
  body = functools.partial(_decode_body, steps=steps, speculative=speculative, scale=scale,
                           lower_bound=config.lower_bound)
  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((n, steps, h, vdim), q.dtype),
      grid=(vdim // BLOCK_V, h, n),
      grid_names=("vb", "h", "n"),
      scratch_types=(
          plgpu.SMEM((steps, kdim), q.dtype),
          plgpu.SMEM((steps, kdim), k.dtype),
          plgpu.SMEM((steps, kdim), g_raw.dtype),
          plgpu.SMEM((steps, BLOCK_V), v.dtype),
          plgpu.SMEM((kdim,), dt_bias.dtype),
          plgpu.SMEM((BLOCK_V, kdim), state_dtype, transforms=_util.smem_transforms(state_dtype, kdim)),
          plgpu.SMEM((steps, BLOCK_V), q.dtype),
          plgpu.Barrier(num_barriers=6),
      ),
  )
  # The one-token kernel never reads num_accepted: pass the slots in its place rather than build an array.
  accepted = num_accepted.astype(jnp.int32) if speculative else state_indices
  return kernel(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_indices, accepted, pool_ref)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted, *,
            config: KdaConfig, interpret: bool):
  single = q.ndim == 3
  if single:
    q, k, v, g_raw, beta_raw = (x[:, None] for x in (q, k, v, g_raw, beta_raw))
    state_indices = state_indices[:, None]
  with _interpret.interpret_mode(interpret):
    pool_ref = jax.new_ref(state_pool)
    o = _launch(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool_ref, state_indices.astype(jnp.int32),
                num_accepted, config=config)
  return (o[:, 0] if single else o), pool_ref[...]


def kda_decode_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array,
                      A_log: jax.Array, dt_bias: jax.Array, state_pool: jax.Array, state_indices: jax.Array,
                      num_accepted: jax.Array | None, *, config: KdaConfig,
                      interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``kda_decode``: inputs already validated by the public API (same shapes and meaning).

  Args:
    q, k: ``[N, H, K]`` or ``[N, 1 + S, H, K]`` raw; v: ``[..., H, V]``; g_raw: like q; beta_raw:
      ``[..., H]``. A_log: ``[H]`` f32; dt_bias: ``[H, K]`` f32.
    state_pool: ``[P, H, V, K]`` (V-first) in ``config.state_dtype`` (not donated here).
    state_indices: ``[N]`` or ``[N, 1 + S]`` int32; num_accepted: ``[N]`` int32 (speculative form) or None.
    config: ``KdaConfig`` (gate kind, scale, state dtype).
    interpret: run in Mosaic GPU interpret mode (CPU).

  Returns:
    ``o`` (q's shape with V last, q's dtype) and the new pool.

  Raises:
    NotImplementedError: ``V`` not a multiple of 64, or ``K`` not a multiple of 8 (the WGMMA tile).
  """
  vdim, kdim = state_pool.shape[-2:]
  if vdim % BLOCK_V or kdim % 8:
    raise NotImplementedError(f"the decode kernel needs V % {BLOCK_V} == 0 and K % 8 == 0, got V={vdim}, K={kdim}")
  return _decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted,
                 config=config, interpret=interpret)

"""KDA recurrent decode (one token or ``1 + S`` speculative tokens per sequence) as a Mosaic GPU kernel.

One program per (V-block, head, sequence) keeps its block of the V-first pool slot in f32 registers for all of
the sequence's tokens and writes each token's state back in place; ``state_io`` (``KdaTuning.decode_state_io``)
picks how state, inputs and ``o`` move. See README.md, "Decode kernel".
"""

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_interpret, util
from pallas_kernels.kda.config import KdaConfig
from pallas_kernels.kda.kernel_math import L2NORM_EPS, gate

BLOCK_V = 64  # rows of a WGMMA-layout register tile: one warpgroup, 64 f32 registers per thread at K = 128
# Rows of a program on the "directR" paths. A program loads its whole [R, K] block and computes it in
# [DIRECT_PART, K] parts, each thread DIRECT_PART/4 rows x K/32 consecutive columns of a part.
DIRECT_ROWS = {"direct16": 16, "direct64": 64, "direct128": 128}
DIRECT_PART = 16
# ``choose_state_io`` on a batch of ``N * H`` heads, from the H200 timings in benchmarks/RESULTS.md (K = V =
# 128): small blocks while a small grid is latency bound (more programs spread it over more SMs), big ones
# once it is bandwidth bound (fewer, longer streams per SM). Each entry is (most heads, path); beyond the
# last, "direct128" if V allows it.
DIRECT_RULE = {jnp.dtype(jnp.float32): ((1024, "direct16"), (4096, "direct64")),
               jnp.dtype(jnp.bfloat16): ((128, "direct16"), (4096, "direct64"))}


def _token_step(s, q, k, x, v, beta, *, rate, scale: float, lower_bound: float | None, state_dtype):
  """One token on a ``[BV, K]`` f32 state block in registers.

  Args:
    s: ``[BV, K]`` f32 state in a register layout L. q, k: ``[K]`` raw, f32, ``L.reduce(0)`` layout; x:
    ``g_raw + dt_bias``, same. v: ``[BV]`` f32, ``L.reduce(1)`` layout. beta: ``sigmoid(beta_raw)``, f32
    scalar. rate: ``exp(A_log)``.

  Returns:
    The new state (f32, rounded through ``state_dtype``: the next token starts from the stored state) and
    ``o`` (``[BV]`` f32, ``L.reduce(1)`` layout).
  """
  along_v = lambda a: lax.broadcast_in_dim(a, s.shape, (1,))  # a [K] vector repeated on every V row
  along_k = lambda a: lax.broadcast_in_dim(a, s.shape, (0,))  # a [BV] vector repeated on every K column
  qv, kv = along_v(q), along_v(k)
  inv_k = lax.rsqrt(jnp.sum(kv * kv, axis=1) + L2NORM_EPS)
  inv_q = lax.rsqrt(jnp.sum(qv * qv, axis=1) + L2NORM_EPS)
  s = s * along_v(jnp.exp(gate(x, rate, lower_bound)))
  u = beta * (v - jnp.sum(s * kv, axis=1) * inv_k)
  s = s + along_k(u * inv_k) * kv
  if state_dtype != jnp.float32:
    s = s.astype(state_dtype).astype(jnp.float32)
  return s, scale * inv_q * jnp.sum(s * qv, axis=1)


def _program_ids(block: int):
  """``(n, h, V rows)`` of this program (``block`` rows); the read slot is taken by the caller."""
  vb, h, n = lax.axis_index("vb"), lax.axis_index("h"), lax.axis_index("n")
  return n, h, pl.ds(pl.multiple_of(vb * block, block), block)


def _direct_fits(kdim: int, vdim: int, rows: int) -> bool:
  """Whether a "direct" path of ``rows`` rows takes these head sizes (one vector of K columns per lane)."""
  return kdim % 32 == 0 and kdim <= 256 and vdim % rows == 0


def _part_layout(kdim: int):
  """Register layout of a ``[DIRECT_PART, K]`` f32 part: the 4 warps over groups of ``DIRECT_PART / 4`` rows,
  the 32 lanes over ``K / 32`` consecutive columns each (one vector)."""
  tiling = fragmented_array.Tiling(((DIRECT_PART, kdim), (DIRECT_PART // 4, kdim), (kdim // 32,)))
  return plgpu.Layout.TILED(tiling, warp_dims=(-5,), lane_dims=(-2,), vector_dim=-1)


def _read_slot(slots_ref, accepted_ref, n, speculative: bool):
  return slots_ref[n, accepted_ref[n] - 1] if speculative else slots_ref[n, 0]


def _tma_body(q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, slots_ref, accepted_ref,
              pool_ref, o_ref, q_smem, k_smem, g_smem, v_smem, bias_smem, s_smem, o_smem, barriers, *,
              steps: int, speculative: bool, scale: float, lower_bound: float | None):
  n, h, rows = _program_ids(BLOCK_V)
  col = plgpu.Layout.WGMMA.reduce(0)  # [K] vectors, broadcast along the V rows
  row = plgpu.Layout.WGMMA.reduce(1)  # [BV] vectors, broadcast along the K columns
  # Small batches are latency bound: start every load that does not depend on the slot before the
  # dependent chain (slot id -> state TMA), and fetch the scalars while the copies fly.
  inputs = ((q_ref.at[n, :, h], q_smem), (k_ref.at[n, :, h], k_smem), (g_ref.at[n, :, h], g_smem),
            (v_ref.at[n, :, h, rows], v_smem), (dt_bias_ref.at[h], bias_smem))
  for i, (src, dst) in enumerate(inputs):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
  read_slot = _read_slot(slots_ref, accepted_ref, n, speculative)
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
    s = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA, optimized=True).astype(jnp.float32)
    for t in range(steps):
      load = lambda ref, layout: plgpu.load(ref.at[t], layout=layout, optimized=False).astype(jnp.float32)
      s, o = _token_step(s, load(q_smem, col), load(k_smem, col), load(g_smem, col) + bias, load(v_smem, row),
                         betas[t], rate=rate, scale=scale, lower_bound=lower_bound, state_dtype=s_smem.dtype)
      o_smem[t] = o.astype(o_smem.dtype)
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
  util.finish_stores()


def _direct_body(q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, slots_ref, accepted_ref,
                 pool_ref, o_ref, *, steps: int, speculative: bool, scale: float, lower_bound: float | None,
                 block: int):
  """Plain global loads and stores straight between the refs and registers: no SMEM, TMA or barrier.

  The ``block`` rows are computed ``DIRECT_PART`` rows at a time (rows are independent). Every part's state
  load is issued right after the slot id arrives, in the stored dtype, so a bf16 state waits in half the
  registers of its f32 working copy and a program keeps more bytes in flight; then the inputs, so they
  overlap it. Each thread loads and stores the same state elements (one layout), so a token that writes
  the slot it read from is ordered after that read.
  """
  n, h, rows = _program_ids(block)
  part = DIRECT_PART
  parts = [pl.ds(pl.multiple_of(rows.start + j * part, part), part) for j in range(block // part)]
  layout = _part_layout(k_ref.shape[-1])
  col, row = layout.reduce(0), layout.reduce(1)
  load = lambda ref, layout: plgpu.load(ref, layout=layout, optimized=False).astype(jnp.float32)
  read_slot = _read_slot(slots_ref, accepted_ref, n, speculative)

  @pl.when(read_slot >= 0)
  def _():
    stored = [plgpu.load(pool_ref.at[read_slot, h, p], layout=layout, optimized=False) for p in parts]
    tokens = [(load(q_ref.at[n, t, h], col), load(k_ref.at[n, t, h], col), load(g_ref.at[n, t, h], col),
               jax.nn.sigmoid(beta_ref[n, t, h].astype(jnp.float32))) for t in range(steps)]
    bias = load(dt_bias_ref.at[h], col)
    rate = jnp.exp(a_log_ref[h].astype(jnp.float32))
    for p, s in zip(parts, stored):
      s = s.astype(jnp.float32)
      for t, (q, k, g, beta) in enumerate(tokens):
        s, o = _token_step(s, q, k, g + bias, load(v_ref.at[n, t, h, p], row), beta, rate=rate, scale=scale,
                           lower_bound=lower_bound, state_dtype=pool_ref.dtype)
        o_ref.at[n, t, h, p][...] = o.astype(o_ref.dtype)
        dst = slots_ref[n, t]

        @pl.when(dst >= 0)
        def _():
          pool_ref.at[dst, h, p][...] = s.astype(pool_ref.dtype)

  @pl.when(read_slot < 0)
  def _():
    for t, p in itertools.product(range(steps), parts):
      o_ref.at[n, t, h, p][...] = plgpu.layout_cast(jnp.zeros((part,), o_ref.dtype), row)


def _launch(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool_ref, state_indices, num_accepted, *,
            config: KdaConfig, state_io: str) -> jax.Array:
  """Runs the kernel on ``[N, 1 + S, ...]`` inputs (``num_accepted`` None: one token, read column 0);
  writes the pool ref, returns ``o``."""
  n, steps, h, kdim = q.shape
  vdim = v.shape[-1]
  scale = kdim ** -0.5 if config.scale is None else config.scale
  state_dtype = pool_ref.dtype
  speculative = num_accepted is not None
  statics = dict(steps=steps, speculative=speculative, scale=scale, lower_bound=config.lower_bound)
  if state_io in DIRECT_ROWS:
    block = DIRECT_ROWS[state_io]
    body = functools.partial(_direct_body, block=block, **statics)
    scratch = ()
  else:
    block, body = BLOCK_V, functools.partial(_tma_body, **statics)
    scratch = (
        plgpu.SMEM((steps, kdim), q.dtype),
        plgpu.SMEM((steps, kdim), k.dtype),
        plgpu.SMEM((steps, kdim), g_raw.dtype),
        plgpu.SMEM((steps, BLOCK_V), v.dtype),
        plgpu.SMEM((kdim,), dt_bias.dtype),
        plgpu.SMEM((BLOCK_V, kdim), state_dtype, transforms=util.smem_transforms(state_dtype, kdim)),
        plgpu.SMEM((steps, BLOCK_V), q.dtype),
        plgpu.Barrier(num_barriers=6),
    )
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n, steps, h, vdim), q.dtype),
                        grid=(vdim // block, h, n), grid_names=("vb", "h", "n"), scratch_types=scratch,
                        kernel_name="kda_decode",
                        compiler_params=util.compiler_params())
  # The one-token kernel never reads num_accepted: pass the slots in its place rather than build an array.
  accepted = num_accepted.astype(jnp.int32) if speculative else state_indices
  return kernel(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_indices, accepted, pool_ref)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "state_io"))
def _decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted, *,
            config: KdaConfig, interpret: bool, state_io: str):
  single = q.ndim == 3
  if single:
    q, k, v, g_raw, beta_raw = (x[:, None] for x in (q, k, v, g_raw, beta_raw))
    state_indices = state_indices[:, None]
  with mosaic_interpret.interpret_mode(interpret):
    pool_ref = jax.new_ref(state_pool)
    o = _launch(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool_ref, state_indices.astype(jnp.int32),
                num_accepted, config=config, state_io=state_io)
  return (o[:, 0] if single else o), pool_ref[...]


def choose_state_io(heads: int, kdim: int, vdim: int, state_dtype) -> str:
  """The default state / IO path for ``heads = N * H`` (``DIRECT_RULE``); "direct64" where ``V`` does not
  take the rule's block, "tma" where the part layout cannot take ``K``."""
  path = next((io for most, io in DIRECT_RULE[jnp.dtype(state_dtype)] if heads <= most), "direct128")
  return next((io for io in (path, "direct64") if _direct_fits(kdim, vdim, DIRECT_ROWS[io])), "tma")


def kda_decode_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array,
                      A_log: jax.Array, dt_bias: jax.Array, state_pool: jax.Array, state_indices: jax.Array,
                      num_accepted: jax.Array | None, *, config: KdaConfig, interpret: bool,
                      state_io: str) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``kda_decode``: inputs already validated by the public API (same shapes and meaning).

  Args:
    q, k: ``[N, H, K]`` or ``[N, 1 + S, H, K]`` raw; v: ``[..., H, V]``; g_raw: like q; beta_raw:
      ``[..., H]``. A_log: ``[H]`` f32; dt_bias: ``[H, K]`` f32.
    state_pool: ``[P, H, V, K]`` (V-first) in ``config.state_dtype`` (not donated here).
    state_indices: ``[N]`` or ``[N, 1 + S]`` int32; num_accepted: ``[N]`` int32 (speculative form) or None.
    config: ``KdaConfig`` (gate kind, scale, state dtype; its ``tuning`` is not read here).
    interpret: run in Mosaic GPU interpret mode (CPU).
    state_io: one of ``DECODE_STATE_IO``, already resolved (``KdaTuning.decode_state_io``, or
      ``choose_state_io`` where that is None). All give the same results.

  Returns:
    ``o`` (q's shape with V last, q's dtype) and the new pool.

  Raises:
    NotImplementedError: ``V`` not a multiple of 64, ``K`` not a multiple of 8 (the WGMMA tile), or a
      "directR" path with ``K`` not a multiple of 32 up to 256 (one vector of columns per lane) or ``V``
      not a multiple of ``R``.
  """
  vdim, kdim = state_pool.shape[-2:]
  if vdim % BLOCK_V or kdim % 8:
    raise NotImplementedError(f"the decode kernel needs V % {BLOCK_V} == 0 and K % 8 == 0, got V={vdim}, K={kdim}")
  if state_io in DIRECT_ROWS and not _direct_fits(kdim, vdim, DIRECT_ROWS[state_io]):
    raise NotImplementedError(f'state_io="{state_io}" needs K % 32 == 0, K <= 256 and '
                              f'V % {DIRECT_ROWS[state_io]} == 0, got K={kdim}, V={vdim}')
  return _decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted,
                 config=config, interpret=interpret, state_io=state_io)

"""Public KDA entry points: ``kda_prefill`` (chunked, varlen, pool slots, checkpoints), ``kda_decode`` and
``default_tuning`` (the kernels' tuning heuristic).

State pool layout everywhere: ``[P, H, V, K]`` (V-first, as vLLM's Kimi-K3 pool).

Both functions validate shapes and dtypes always, and index *values* (cu_seqlens, slots, checkpoint offsets,
num_accepted, duplicate destination slots) only when those arrays are concrete: called under ``jax.jit``
with traced indices the value checks are skipped and invalid indices give unspecified results. The work
itself runs jitted with the config static; the pool is not donated (wrap the call in your own ``jax.jit``
with ``donate_argnames`` to update it in place).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import util
from pallas_kernels.kda import checks, decode_kernel, prefill_kernel, prefill_state, reference
from pallas_kernels.kda.config import KdaConfig, KdaTuning

# The kernels index with int32.
_INDEX_DTYPES = (jnp.int32,)


def _check_same(name: str, x, ref_name: str, ref) -> None:
  if jnp.dtype(x.dtype) != jnp.dtype(ref.dtype):
    raise ValueError(f"{name} must have the dtype of {ref_name} ({jnp.dtype(ref.dtype).name}), "
                     f"got {jnp.dtype(x.dtype).name}")


def _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, config: KdaConfig,
                  lead_ndim: int) -> tuple[int, int, int, int]:
  """Shapes/dtypes shared by prefill and decode; ``lead_ndim`` token axes precede ``[H, K]``.
  Returns ``(H, K, V, P)``."""
  util.check_shape("q", q, (None,) * (lead_ndim + 2))
  lead, (H, K) = tuple(q.shape[:lead_ndim]), tuple(q.shape[lead_ndim:])
  util.check_dtype("q", q, util.FLOAT_DTYPES)
  util.check_shape("k", k, lead + (H, K))
  _check_same("k", k, "q", q)
  util.check_shape("v", v, lead + (H, None))
  _check_same("v", v, "q", q)
  V = v.shape[-1]
  util.check_shape("g_raw", g_raw, lead + (H, K))
  util.check_dtype("g_raw", g_raw, util.FLOAT_DTYPES)
  util.check_shape("beta_raw", beta_raw, lead + (H,))
  util.check_dtype("beta_raw", beta_raw, util.FLOAT_DTYPES)
  util.check_shape("A_log", A_log, (H,))
  util.check_dtype("A_log", A_log, (jnp.float32,))
  util.check_shape("dt_bias", dt_bias, (H, K))
  util.check_dtype("dt_bias", dt_bias, (jnp.float32,))
  util.check_shape("state_pool", state_pool, (None, H, V, K))
  if jnp.dtype(state_pool.dtype) != config.state_dtype:
    raise ValueError(f"state_pool must have config.state_dtype ({config.state_dtype.name}), "
                     f"got {jnp.dtype(state_pool.dtype).name}")
  return H, K, V, state_pool.shape[0]


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill_xla(q, k, v, g_raw, beta_raw, A_log, dt_bias, cu_seqlens, state_pool, state_indices,
                 has_initial_state, checkpoint_indptr, checkpoint_offsets, checkpoint_slots, *, config):
  return reference.kda_prefill_reference(
      q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_pool=state_pool,
      state_indices=state_indices, has_initial_state=has_initial_state, checkpoint_indptr=checkpoint_indptr,
      checkpoint_offsets=checkpoint_offsets, checkpoint_slots=checkpoint_slots, lower_bound=config.lower_bound,
      scale=config.scale, chunk_size=config.chunk_size)


@functools.partial(jax.jit, static_argnames=("config",))
def _decode_xla(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted, *, config):
  return reference.kda_decode_reference(
      q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, state_pool=state_pool,
      state_indices=state_indices, num_accepted=num_accepted, lower_bound=config.lower_bound,
      scale=config.scale)


def default_tuning(*, num_seqs: int, num_heads: int, key_dim: int, value_dim: int, state_dtype,
                   num_tokens: int | None = None) -> KdaTuning:
  """The tuning the kernels use where ``KdaConfig.tuning`` (or a field of it) is None, for one call's shapes.

  Args:
    num_seqs: sequences ``N`` of the call (rows of ``q``); num_heads: ``H``; key_dim: ``K``; value_dim: ``V``.
    state_dtype: dtype of the state pool (f32 or bf16).
    num_tokens: a prefill's tokens ``T`` (None for decode: no segments).

  Returns:
    A ``KdaTuning`` with every field set. ``decode_state_io``: small register blocks while a small batch of
    ``N * H`` heads is latency bound (more programs spread it over more SMs), bigger ones once it is
    bandwidth bound; "tma" where ``K`` does not fit the direct paths. ``prefill_v_blocks``: 2 once the
    one-block programs of the state pass are more than one wave of SMs (``prefill_state.choose_v_blocks``).
    ``prefill_segments``: enough runs per sequence to fill the SMs where one pass's programs leave most of them
    idle and the sequences are long (``prefill_state.choose_segments``), else 1.

  Raises:
    ValueError: a size that is not an int (``num_seqs`` >= 0, the others >= 1) or a state dtype other than
      f32 / bf16.
  """
  sizes = (("num_seqs", num_seqs, 0), ("num_heads", num_heads, 1), ("key_dim", key_dim, 1), ("value_dim", value_dim, 1))
  for name, size, least in sizes + ((("num_tokens", num_tokens, 0),) if num_tokens is not None else ()):
    if not isinstance(size, int) or isinstance(size, bool) or size < least:
      raise ValueError(f"{name} must be an int >= {least}, got {size!r}")
  state_dtype = util.canonical_dtype("state_dtype", state_dtype, (jnp.float32, jnp.bfloat16))
  return KdaTuning(decode_state_io=decode_kernel.choose_state_io(num_seqs * num_heads, key_dim, value_dim,
                                                                 state_dtype),
                   prefill_v_blocks=prefill_state.choose_v_blocks(num_seqs, num_heads, value_dim),
                   prefill_segments=1 if num_tokens is None else
                   prefill_state.choose_segments(num_seqs, num_heads, value_dim, num_tokens))


def _resolve_tuning(tuning: KdaTuning | None, default: KdaTuning) -> KdaTuning:
  """``tuning`` with its None fields taken from ``default``."""
  if tuning is None:
    return default
  return dataclasses.replace(tuning, **{f.name: getattr(default, f.name) for f in dataclasses.fields(tuning)
                                        if getattr(tuning, f.name) is None})


def kda_prefill(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, *,
                A_log: jax.Array, dt_bias: jax.Array, cu_seqlens: jax.Array, state_pool: jax.Array,
                state_indices: jax.Array, has_initial_state: jax.Array,
                checkpoint_indptr: jax.Array | None = None, checkpoint_offsets: jax.Array | None = None,
                checkpoint_slots: jax.Array | None = None,
                config: KdaConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """KDA chunked prefill over packed variable-length sequences.

  Args:
    q, k: ``[T, H, K]`` raw (L2 normalisation happens inside), f32/bf16/f16.
    v: ``[T, H, V]``, same dtype as q.
    g_raw: ``[T, H, K]`` raw gate input (before ``dt_bias`` and the activation).
    beta_raw: ``[T, H]`` raw β (sigmoid inside).
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32.
    cu_seqlens: ``[N+1]`` int32, non-decreasing, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``.
    state_pool: ``[P, H, V, K]`` in ``config.state_dtype`` (V-first layout).
    state_indices: ``[N]`` int32 pool slot of each sequence; its initial state is read (zero when
      ``has_initial_state[n]`` is false) and its final state written. -1: start from zero, write nothing.
      A length-0 sequence with an initial state leaves its slot bitwise unchanged. No slot may be written
      twice (final states and checkpoints together).
    has_initial_state: ``[N]`` bool.
    checkpoint_indptr: ``[N+1]`` int32 CSR row pointer into the checkpoint arrays (or None: no checkpoints).
    checkpoint_offsets: ``[M]`` int32, tokens from the sequence start, multiples of ``chunk_size``,
      in ``(0, L_n]``; the state after that many tokens is written to ``checkpoint_slots``. Any order within a
      sequence; sorted by offset costs the kernel one comparison a chunk, unsorted a scan of the sequence's list
      at each chunk that ends on a checkpoint.
    checkpoint_slots: ``[M]`` int32 destination pool slots (-1: skip).
    config: ``KdaConfig``; the kernel impls take ``config.tuning.prefill_v_blocks`` (None fields:
      ``default_tuning`` of these shapes).

  Returns:
    ``o [T, H, V]`` in q's dtype, and the new ``state_pool`` (same shape/dtype; only the slots named by
    ``state_indices`` / ``checkpoint_slots`` change; states are f32 inside and rounded once per write).

  Raises:
    ValueError: bad shapes, dtypes or (for concrete index arrays) index values.
    NotImplementedError: ``impl="pallas"/"interpret"`` with head sizes the kernel does not take (K other
      than 64 or 128, V not a multiple of its value blocks: 64, or 128 with ``prefill_v_blocks=2``).
  """
  config = KdaConfig() if config is None else config
  H, K, V, P = _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, config, lead_ndim=1)
  if not checks.check_prefill_indices(q.shape[0], P, "state_pool", cu_seqlens=cu_seqlens,
                                      state_indices=state_indices, has_initial_state=has_initial_state,
                                      checkpoint_indptr=checkpoint_indptr, checkpoint_offsets=checkpoint_offsets,
                                      checkpoint_slots=checkpoint_slots, int_dtypes=_INDEX_DTYPES, min_seqs=1,
                                      chunk_size=config.chunk_size):
    checkpoint_indptr = jnp.zeros((cu_seqlens.shape[0],), jnp.int32)
    checkpoint_offsets = jnp.zeros((0,), jnp.int32)
    checkpoint_slots = jnp.zeros((0,), jnp.int32)

  args = (q, k, v, g_raw, beta_raw, A_log, dt_bias, cu_seqlens, state_pool, state_indices, has_initial_state,
          checkpoint_indptr, checkpoint_offsets, checkpoint_slots)
  if config.impl == "xla":
    return _prefill_xla(*args, config=config)
  tuning = _resolve_tuning(config.tuning, default_tuning(num_seqs=state_indices.shape[0], num_heads=H,
                                                         key_dim=K, value_dim=V, state_dtype=config.state_dtype,
                                                         num_tokens=q.shape[0]))
  v_blocks = tuning.prefill_v_blocks
  if tuning.prefill_segments > 1 and (config.tuning is None or config.tuning.prefill_v_blocks is None):
    # The state pass runs N * segments sequences: the value-block rule counts those.
    v_blocks = prefill_state.choose_v_blocks(state_indices.shape[0] * tuning.prefill_segments, H, V)
  return prefill_kernel.kda_prefill_mosaic(*args, config=config, interpret=config.impl == "interpret",
                                           v_blocks=v_blocks, segments=tuning.prefill_segments)


def kda_decode(q: jax.Array, k: jax.Array, v: jax.Array, g_raw: jax.Array, beta_raw: jax.Array, *,
               A_log: jax.Array, dt_bias: jax.Array, state_pool: jax.Array, state_indices: jax.Array,
               num_accepted: jax.Array | None = None,
               config: KdaConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """KDA recurrent decode on pool slots, one token per sequence (or 1 + S speculative tokens).

  Args:
    q, k: ``[N, H, K]`` (one token) or ``[N, 1 + S, H, K]`` (speculative verify), raw.
    v: ``[N, H, V]`` / ``[N, 1 + S, H, V]``. g_raw: like q. beta_raw: ``[N, H]`` / ``[N, 1 + S, H]``.
    A_log: ``[H]`` f32. dt_bias: ``[H, K]`` f32.
    state_pool: ``[P, H, V, K]`` in ``config.state_dtype``.
    state_indices: ``[N]`` int32 (read and written in place), or ``[N, 1 + S]`` for the speculative form:
      the initial state is read from column ``num_accepted[n] - 1`` and the state after token t is
      written to column t (a -1 column is not written). A row whose read slot is -1 outputs 0 and reads and
      writes nothing. No slot may be written twice.
    num_accepted: ``[N]`` int32 in ``[1, 1 + S]``, required with the speculative form only.
    config: ``KdaConfig``; the kernel impls take ``config.tuning.decode_state_io`` (None fields:
      ``default_tuning`` of these shapes).

  Returns:
    ``o`` (``[N, H, V]`` or ``[N, 1 + S, H, V]``) in q's dtype and the new ``state_pool`` (f32 arithmetic,
    each token's state rounded to ``config.state_dtype``).

  Raises:
    ValueError: bad shapes, dtypes or (for concrete index arrays) index values.
    NotImplementedError: ``impl="pallas"/"interpret"`` with head sizes the kernel does not take (V not a
      multiple of 64, K not a multiple of 8), or a ``decode_state_io`` of "directR" with K not a multiple of
      32 up to 256 or V not a multiple of R.
  """
  config = KdaConfig() if config is None else config
  if q.ndim not in (3, 4):
    raise ValueError(f"q must have shape (N, H, K) or (N, 1 + S, H, K), got {tuple(q.shape)}")
  lead_ndim = q.ndim - 2
  H, K, V, P = _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, config, lead_ndim)
  checks.check_decode_indices("q", q.shape, lead_ndim == 2, P, "state_pool", state_indices=state_indices,
                              num_accepted=num_accepted, int_dtypes=_INDEX_DTYPES)

  args = (q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted)
  if config.impl == "xla":
    return _decode_xla(*args, config=config)
  tuning = _resolve_tuning(config.tuning, default_tuning(num_seqs=q.shape[0], num_heads=H, key_dim=K,
                                                         value_dim=V, state_dtype=config.state_dtype))
  return decode_kernel.kda_decode_mosaic(*args, config=config, interpret=config.impl == "interpret",
                                         state_io=tuning.decode_state_io)

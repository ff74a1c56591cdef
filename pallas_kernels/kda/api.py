"""Public KDA entry points: ``kda_prefill`` (chunked, varlen, pool slots, checkpoints) and ``kda_decode``.

State pool layout everywhere: ``[P, H, V, K]`` (V-first, as vLLM's Kimi-K3 pool).

Both functions validate shapes and dtypes always, and index *values* (cu_seqlens, slots, checkpoint offsets,
num_accepted, duplicate destination slots) only when those arrays are concrete: called under ``jax.jit``
with traced indices the value checks are skipped and invalid indices give unspecified results. The work
itself runs jitted with the config static; the pool is not donated (wrap the call in your own ``jax.jit``
with ``donate_argnames`` to update it in place).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _util
from pallas_kernels.kda import decode_kernel, prefill_kernel, reference
from pallas_kernels.kda.config import KdaConfig


def _check_same(name: str, x, ref_name: str, ref) -> None:
  if jnp.dtype(x.dtype) != jnp.dtype(ref.dtype):
    raise ValueError(f"{name} must have the dtype of {ref_name} ({jnp.dtype(ref.dtype).name}), "
                     f"got {jnp.dtype(x.dtype).name}")


def _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, config: KdaConfig,
                  lead_ndim: int) -> tuple[int, int, int, int]:
  """Shapes/dtypes shared by prefill and decode; ``lead_ndim`` token axes precede ``[H, K]``.
  Returns ``(H, K, V, P)``."""
  _util.check_shape("q", q, (None,) * (lead_ndim + 2))
  lead, (H, K) = tuple(q.shape[:lead_ndim]), tuple(q.shape[lead_ndim:])
  _util.check_dtype("q", q, _util.FLOAT_DTYPES)
  _util.check_shape("k", k, lead + (H, K))
  _check_same("k", k, "q", q)
  _util.check_shape("v", v, lead + (H, None))
  _check_same("v", v, "q", q)
  V = v.shape[-1]
  _util.check_shape("g_raw", g_raw, lead + (H, K))
  _util.check_dtype("g_raw", g_raw, _util.FLOAT_DTYPES)
  _util.check_shape("beta_raw", beta_raw, lead + (H,))
  _util.check_dtype("beta_raw", beta_raw, _util.FLOAT_DTYPES)
  _util.check_shape("A_log", A_log, (H,))
  _util.check_dtype("A_log", A_log, (jnp.float32,))
  _util.check_shape("dt_bias", dt_bias, (H, K))
  _util.check_dtype("dt_bias", dt_bias, (jnp.float32,))
  _util.check_shape("state_pool", state_pool, (None, H, V, K))
  if jnp.dtype(state_pool.dtype) != config.state_dtype:
    raise ValueError(f"state_pool must have config.state_dtype ({config.state_dtype.name}), "
                     f"got {jnp.dtype(state_pool.dtype).name}")
  return H, K, V, state_pool.shape[0]


def _check_int(name: str, x, shape: tuple) -> None:
  _util.check_shape(name, x, shape)
  _util.check_dtype(name, x, (jnp.int32,))


def _check_slot_range(name: str, slots: np.ndarray | None, P: int) -> None:
  if slots is not None and slots.size and (slots.min() < -1 or slots.max() >= P):
    raise ValueError(f"{name} must be pool slots in [-1, {P}) (P = state_pool.shape[0]), "
                     f"got values in [{slots.min()}, {slots.max()}]")


def _check_unique_writes(slots: list[np.ndarray]) -> None:
  """Two writes to one slot would leave it to the scatter order which one wins: reject them."""
  written = np.concatenate([s.reshape(-1) for s in slots])
  written = written[written >= 0]
  uniq, counts = np.unique(written, return_counts=True)
  if (counts > 1).any():
    raise ValueError(f"a destination pool slot is written twice (final, checkpoint or per-token states): "
                     f"slots {uniq[counts > 1].tolist()}")


def _check_cu_seqlens(cu: np.ndarray | None, T: int) -> None:
  if cu is None:
    return
  if cu[0] != 0 or cu[-1] != T or (np.diff(cu) < 0).any():
    raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T = {T}, got {cu.tolist()}")


def _check_checkpoints(indptr: np.ndarray | None, offsets: np.ndarray | None, cu: np.ndarray | None,
                       M: int, chunk_size: int) -> None:
  if indptr is None:
    return
  if indptr[0] != 0 or indptr[-1] != M or (np.diff(indptr) < 0).any():
    raise ValueError(f"checkpoint_indptr must be non-decreasing from 0 to M = {M} "
                     f"(len(checkpoint_offsets)), got {indptr.tolist()}")
  if offsets is None or cu is None:
    return
  lens = np.repeat(np.diff(cu), np.diff(indptr))
  bad = (offsets % chunk_size != 0) | (offsets <= 0) | (offsets > lens)
  if bad.any():
    m = int(np.argmax(bad))
    raise ValueError(f"checkpoint_offsets must be multiples of chunk_size ({chunk_size}) in (0, L_n], got "
                     f"offset {offsets[m]} for a sequence of length {lens[m]} (checkpoint {m})")


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
      in ``(0, L_n]``; the state after that many tokens is written to ``checkpoint_slots``.
    checkpoint_slots: ``[M]`` int32 destination pool slots (-1: skip).
    config: ``KdaConfig``.

  Returns:
    ``o [T, H, V]`` in q's dtype, and the new ``state_pool`` (same shape/dtype; only the slots named by
    ``state_indices`` / ``checkpoint_slots`` change; states are f32 inside and rounded once per write).

  Raises:
    ValueError: bad shapes, dtypes or (for concrete index arrays) index values.
    NotImplementedError: ``impl="pallas"/"interpret"`` before the kernel lands.
  """
  config = KdaConfig() if config is None else config
  H, K, V, P = _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, config, lead_ndim=1)
  T = q.shape[0]
  _util.check_shape("cu_seqlens", cu_seqlens, (None,))
  if cu_seqlens.shape[0] < 2:
    raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= 1, got {tuple(cu_seqlens.shape)}")
  _util.check_dtype("cu_seqlens", cu_seqlens, (jnp.int32,))
  N = cu_seqlens.shape[0] - 1
  _check_int("state_indices", state_indices, (N,))
  _util.check_shape("has_initial_state", has_initial_state, (N,))
  _util.check_dtype("has_initial_state", has_initial_state, (jnp.bool_,))
  given = [x is not None for x in (checkpoint_indptr, checkpoint_offsets, checkpoint_slots)]
  if any(given) and not all(given):
    raise ValueError("checkpoint_indptr, checkpoint_offsets and checkpoint_slots must be given together, got "
                     f"indptr={given[0]}, offsets={given[1]}, slots={given[2]}")
  if not all(given):
    checkpoint_indptr = jnp.zeros((N + 1,), jnp.int32)
    checkpoint_offsets = jnp.zeros((0,), jnp.int32)
    checkpoint_slots = jnp.zeros((0,), jnp.int32)
  _check_int("checkpoint_indptr", checkpoint_indptr, (N + 1,))
  _check_int("checkpoint_offsets", checkpoint_offsets, (None,))
  M = checkpoint_offsets.shape[0]
  _check_int("checkpoint_slots", checkpoint_slots, (M,))

  cu = _util.concrete(cu_seqlens)
  slots, ck_slots = _util.concrete(state_indices), _util.concrete(checkpoint_slots)
  _check_cu_seqlens(cu, T)
  _check_slot_range("state_indices", slots, P)
  _check_checkpoints(_util.concrete(checkpoint_indptr), _util.concrete(checkpoint_offsets), cu, M,
                     config.chunk_size)
  _check_slot_range("checkpoint_slots", ck_slots, P)
  if slots is not None and ck_slots is not None:
    _check_unique_writes([slots, ck_slots])

  args = (q, k, v, g_raw, beta_raw, A_log, dt_bias, cu_seqlens, state_pool, state_indices, has_initial_state,
          checkpoint_indptr, checkpoint_offsets, checkpoint_slots)
  if config.impl == "xla":
    return _prefill_xla(*args, config=config)
  return prefill_kernel.kda_prefill_mosaic(*args, config=config, interpret=config.impl == "interpret")


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
    config: ``KdaConfig``.

  Returns:
    ``o`` (``[N, H, V]`` or ``[N, 1 + S, H, V]``) in q's dtype and the new ``state_pool`` (f32 arithmetic,
    each token's state rounded to ``config.state_dtype``).

  Raises:
    ValueError: bad shapes, dtypes or (for concrete index arrays) index values.
    NotImplementedError: ``impl="pallas"/"interpret"`` before the kernel lands.
  """
  config = KdaConfig() if config is None else config
  if q.ndim not in (3, 4):
    raise ValueError(f"q must have shape (N, H, K) or (N, 1 + S, H, K), got {tuple(q.shape)}")
  lead_ndim = q.ndim - 2
  H, K, V, P = _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, config, lead_ndim)
  lead = tuple(q.shape[:lead_ndim])
  _check_int("state_indices", state_indices, lead)
  if lead_ndim == 1 and num_accepted is not None:
    raise ValueError("num_accepted is only for the speculative form (q of shape (N, 1 + S, H, K)), got "
                     f"q of shape {tuple(q.shape)}")
  if lead_ndim == 2:
    if num_accepted is None:
      raise ValueError(f"num_accepted ([N] int32) is required with speculative q of shape {tuple(q.shape)}")
    _check_int("num_accepted", num_accepted, lead[:1])

  slots = _util.concrete(state_indices)
  _check_slot_range("state_indices", slots, P)
  accepted = None if num_accepted is None else _util.concrete(num_accepted)
  if accepted is not None and accepted.size and (accepted.min() < 1 or accepted.max() > lead[1]):
    raise ValueError(f"num_accepted must be in [1, 1 + S] = [1, {lead[1]}], "
                     f"got values in [{accepted.min()}, {accepted.max()}]")
  if slots is not None and (lead_ndim == 1 or accepted is not None):
    if lead_ndim == 1:
      written = slots
    else:
      # Rows whose read slot is -1 are padding and write nothing.
      written = slots[slots[np.arange(lead[0]), accepted - 1] >= 0]
    _check_unique_writes([written])

  args = (q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, state_indices, num_accepted)
  if config.impl == "xla":
    return _decode_xla(*args, config=config)
  return decode_kernel.kda_decode_mosaic(*args, config=config, interpret=config.impl == "interpret")

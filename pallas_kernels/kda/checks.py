"""Index checks shared by the KDA ops and the short convolution (``pallas_kernels.short_conv``): varlen prefill and
pool-slot decode arguments.

Shapes and dtypes are always checked; index *values* only when the arrays are concrete (``util.concrete``), so
the checks cost nothing under ``jax.jit``. Every failure is a ``ValueError`` naming the argument, what was
expected and what was given.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import util


def _dtype_names(dtypes: tuple) -> str:
  return "/".join(jnp.dtype(d).name for d in dtypes)


def check_index(name: str, x: jax.Array, shape: tuple, dtypes: tuple) -> None:
  """Shape (``None`` entries: any size) and integer dtype of an index array."""
  util.check_shape(name, x, shape)
  util.check_dtype(name, x, dtypes)


def check_pointer(name: str, ptr: np.ndarray | None, end: int, end_text: str) -> None:
  """A CSR row pointer (``cu_seqlens``, ``checkpoint_indptr``): non-decreasing from 0 to ``end``.

  ``end_text`` says in the message what ``end`` is, e.g. ``"T = 6"``.
  """
  if ptr is not None and (ptr[0] != 0 or ptr[-1] != end or (np.diff(ptr) < 0).any()):
    raise ValueError(f"{name} must be non-decreasing from 0 to {end_text}, got {ptr.tolist()}")


def check_slot_range(name: str, slots: np.ndarray | None, num_slots: int, pool_name: str) -> None:
  """Pool slots in ``[-1, num_slots)``; -1 means no slot."""
  if slots is not None and slots.size and (slots.min() < -1 or slots.max() >= num_slots):
    raise ValueError(f"{name} must be pool slots in [-1, {num_slots}) (-1: none, {num_slots} = "
                     f"{pool_name}.shape[0]), got values in [{slots.min()}, {slots.max()}]")


def check_pool_size(num_slots: int, pool_name: str) -> None:
  """A pool has at least one slot. A zero-slot pool is rejected rather than special-cased: the ops address
  slots with clipped gathers and in-kernel reads that need a row to exist, and a serving pool is never
  empty, so ``P = 0`` is a configuration error."""
  if num_slots < 1:
    raise ValueError(f"{pool_name} must have at least one slot (shape[0] = P >= 1), got P = {num_slots}")


def check_distinct_writes(written: list[tuple[str, np.ndarray | None]]) -> None:
  """Every destination slot (-1 excepted) is written once: two writes would leave the winner to scatter order.

  Args:
    written: ``(argument name, concrete slots or None)`` pairs; skipped when any of them is not concrete.
  """
  if any(slots is None for _, slots in written):
    return
  flat = np.concatenate([slots.reshape(-1) for _, slots in written])
  uniq, counts = np.unique(flat[flat >= 0], return_counts=True)
  if (counts > 1).any():
    names = " and ".join(name for name, _ in written)
    raise ValueError(f"destination slots in {names} must be distinct (-1 excepted), got slots "
                     f"{uniq[counts > 1].tolist()} written more than once")


def _check_checkpoint_offsets(offsets: np.ndarray, lens: np.ndarray, chunk_size: int | None) -> None:
  """Checkpoint ``i`` of a sequence of length ``lens[i]`` lies in ``(0, lens[i]]`` (on a chunk boundary)."""
  step = 1 if chunk_size is None else chunk_size
  bad = (offsets % step != 0) | (offsets <= 0) | (offsets > lens)
  if bad.any():
    i = int(np.argmax(bad))
    multiples = "" if chunk_size is None else f"multiples of chunk_size ({chunk_size}) "
    raise ValueError(f"checkpoint_offsets must be {multiples}in (0, L_n], got offset {offsets[i]} for a "
                     f"sequence of length {lens[i]} (checkpoint {i})")


def check_prefill_indices(num_tokens: int, num_slots: int, pool_name: str, *, cu_seqlens: jax.Array,
                          state_indices: jax.Array, has_initial_state: jax.Array,
                          checkpoint_indptr: jax.Array | None, checkpoint_offsets: jax.Array | None,
                          checkpoint_slots: jax.Array | None, int_dtypes: tuple, min_seqs: int = 0,
                          chunk_size: int | None = None) -> bool:
  """The varlen prefill index arguments of ``kda_prefill`` and ``short_conv_prefill``.

  Args:
    num_tokens: T, the packed token count.
    num_slots: P >= 1, the pool's slot count; ``pool_name`` names the pool argument in messages.
    cu_seqlens: ``[N + 1]`` with ``N >= min_seqs``, non-decreasing from 0 to T.
    state_indices: ``[N]`` slots in ``[-1, P)``. has_initial_state: ``[N]`` bool.
    checkpoint_indptr, checkpoint_offsets, checkpoint_slots: ``[N + 1]``, ``[M]``, ``[M]``, all given or all
      None; offsets in ``(0, L_n]`` of their sequence (and multiples of ``chunk_size`` when it is given).
    int_dtypes: the integer dtypes allowed for the index arrays.

  Returns:
    Whether the checkpoint arrays were given.
  """
  util.check_shape("cu_seqlens", cu_seqlens, (None,))
  if cu_seqlens.shape[0] < min_seqs + 1:
    raise ValueError(f"cu_seqlens must have shape (N + 1,) with N >= {min_seqs}, got {tuple(cu_seqlens.shape)}")
  util.check_dtype("cu_seqlens", cu_seqlens, int_dtypes)
  n = cu_seqlens.shape[0] - 1
  check_pool_size(num_slots, pool_name)
  check_index("state_indices", state_indices, (n,), int_dtypes)
  check_index("has_initial_state", has_initial_state, (n,), (jnp.bool_,))
  given = [c is not None for c in (checkpoint_indptr, checkpoint_offsets, checkpoint_slots)]
  if any(given) and not all(given):
    raise ValueError("checkpoint_indptr, checkpoint_offsets and checkpoint_slots must be given together, got "
                     f"indptr={given[0]}, offsets={given[1]}, slots={given[2]}")

  if all(given):
    check_index("checkpoint_indptr", checkpoint_indptr, (n + 1,), int_dtypes)
    check_index("checkpoint_offsets", checkpoint_offsets, (None,), int_dtypes)
    check_index("checkpoint_slots", checkpoint_slots, checkpoint_offsets.shape, int_dtypes)

  cu, slots = util.concrete(cu_seqlens), util.concrete(state_indices)
  check_pointer("cu_seqlens", cu, num_tokens, f"T = {num_tokens}")
  check_slot_range("state_indices", slots, num_slots, pool_name)
  written = [("state_indices", slots)]
  if all(given):
    indptr, offsets = util.concrete(checkpoint_indptr), util.concrete(checkpoint_offsets)
    m = checkpoint_offsets.shape[0]
    check_pointer("checkpoint_indptr", indptr, m, f"M = {m} (len(checkpoint_offsets))")
    if indptr is not None and offsets is not None and cu is not None:
      _check_checkpoint_offsets(offsets, np.repeat(np.diff(cu), np.diff(indptr)), chunk_size)
    ck_slots = util.concrete(checkpoint_slots)
    check_slot_range("checkpoint_slots", ck_slots, num_slots, pool_name)
    written.append(("checkpoint_slots", ck_slots))
  check_distinct_writes(written)
  return all(given)


def check_decode_indices(tokens_name: str, tokens_shape: tuple[int, ...], speculative: bool, num_slots: int,
                         pool_name: str, *, state_indices: jax.Array, num_accepted: jax.Array | None,
                         int_dtypes: tuple) -> None:
  """The pool-slot arguments of ``kda_decode`` and ``short_conv_update``.

  Args:
    tokens_name, tokens_shape: the token argument (``q`` / ``x``) and its shape, ``[N, ...]`` for one token per
      sequence or ``[N, 1 + S, ...]`` when ``speculative``.
    num_slots: P >= 1; ``pool_name`` names the pool argument in messages.
    state_indices: ``[N]`` or ``[N, 1 + S]`` slots in ``[-1, P)``; the slots written (every column of a row
      whose read slot, column ``num_accepted[n] - 1``, is not -1) must be distinct.
    num_accepted: ``[N]`` in ``[1, 1 + S]``, given with (and only with) the speculative form.
    int_dtypes: the integer dtypes allowed for the index arrays.
  """
  lead = tuple(tokens_shape[:1 + speculative])
  check_pool_size(num_slots, pool_name)
  check_index("state_indices", state_indices, lead, int_dtypes)
  if speculative:
    if num_accepted is None:
      raise ValueError(f"num_accepted ([N] {_dtype_names(int_dtypes)}) is required with the speculative form, "
                       f"got {tokens_name} of shape {tuple(tokens_shape)}")
    check_index("num_accepted", num_accepted, lead[:1], int_dtypes)
  elif num_accepted is not None:
    raise ValueError(f"num_accepted is only for the speculative form ({tokens_name} of shape [N, 1 + S, ...]), "
                     f"got {tokens_name} of shape {tuple(tokens_shape)}")

  slots = util.concrete(state_indices)
  check_slot_range("state_indices", slots, num_slots, pool_name)
  if not speculative:
    check_distinct_writes([("state_indices", slots)])
    return
  accepted = util.concrete(num_accepted)
  if accepted is not None and accepted.size and (accepted.min() < 1 or accepted.max() > lead[1]):
    raise ValueError(f"num_accepted must be in [1, 1 + S] = [1, {lead[1]}], "
                     f"got values in [{accepted.min()}, {accepted.max()}]")
  if slots is not None and accepted is not None:
    # Rows whose read slot is -1 are padding and write nothing.
    check_distinct_writes([("state_indices", slots[slots[np.arange(lead[0]), accepted - 1] >= 0])])

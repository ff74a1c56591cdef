"""Public short convolution entry points: ``short_conv_prefill`` (varlen, pool slots, checkpoints) and
``short_conv_update`` (one token or a speculative verify), the causal depthwise conv (width W, SiLU) of the
packed q|k|v projection in front of KDA, with a conv state pool.

Both ops have a Mosaic GPU kernel (``kernel``) next to the pure-JAX form (``reference``, ``impl="xla"``): as
several XLA kernels (gather, conv, scatter) they run far below copy bandwidth on the GPU (README.md).

Conv state pool layout: ``conv_pool [P, W - 1, D]``: slot ``s`` holds the last ``W - 1`` *pre-conv* input
rows of its sequence, oldest first (row ``W - 2`` is the most recent token). Its dtype is chosen by the
caller and kept: rows are rounded to it once when written, read back as f32.

Math, per channel ``c``, with ``h`` the history = ``W - 1`` state rows followed by the sequence's rows:
``y[t, c] = act(sum_i weight[c, i] * h[t + i, c])``, i = 0..W-1 (i = W-1 is the current token), all in f32.

Both functions validate shapes and dtypes always, and index *values* only when those arrays are concrete
(``kda.checks``): under ``jax.jit`` with traced indices invalid indices give unspecified results.
"""

import jax

from pallas_kernels import util
from pallas_kernels.kda import checks
from pallas_kernels.short_conv import kernel, reference
from pallas_kernels.short_conv.config import ShortConvConfig


def _check_common(x, weight, conv_pool, x_shapes: dict[int, str]) -> int:
  """Shared checks of ``x`` (rank -> shape name), ``weight`` and ``conv_pool``; returns W."""
  if x.ndim not in x_shapes:
    raise ValueError(f"x must have shape {' or '.join(x_shapes.values())}, got {tuple(x.shape)}")
  util.check_dtype("x", x, util.FLOAT_DTYPES)
  d = x.shape[-1]
  if weight.ndim != 2 or weight.shape[0] != d or weight.shape[1] < 2:
    raise ValueError(f"weight must have shape ({d}, W) with W >= 2, got {tuple(weight.shape)}")
  util.check_dtype("weight", weight, util.FLOAT_DTYPES)
  width = weight.shape[1]
  if conv_pool.ndim != 3:
    raise ValueError(f"conv_pool must have shape (P, {width - 1}, {d}), got {tuple(conv_pool.shape)}")
  util.check_shape("conv_pool", conv_pool, (None, width - 1, d))
  util.check_dtype("conv_pool", conv_pool, util.FLOAT_DTYPES)
  return width


_prefill_xla = jax.jit(reference.short_conv_prefill_reference, static_argnames=("activation",))
_update_xla = jax.jit(reference.short_conv_update_reference, static_argnames=("activation",))


def short_conv_prefill(x: jax.Array, weight: jax.Array, *, cu_seqlens: jax.Array, conv_pool: jax.Array,
                       state_indices: jax.Array, has_initial_state: jax.Array,
                       checkpoint_indptr: jax.Array | None = None,
                       checkpoint_offsets: jax.Array | None = None,
                       checkpoint_slots: jax.Array | None = None,
                       config: ShortConvConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise conv over packed variable-length sequences, reading and writing the conv pool.

  Positions before a sequence start come from its slot (the last ``W - 1`` pre-conv rows of the prefix),
  or are zero when ``has_initial_state[n]`` is false or the slot is -1. Sequences shorter than ``W - 1``
  keep the newest old rows in front of their own in the written state.

  Args:
    x: ``[T, D]`` pre-conv rows (D = channels of the packed q|k|v projection), f32/bf16/f16.
    weight: ``[D, W]`` per-channel taps, oldest first (``weight[:, W - 1]`` multiplies the current token).
    cu_seqlens: ``[N + 1]`` int32/int64, ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[N] == T``.
    conv_pool: ``[P, W - 1, D]`` conv state pool (layout in the module docstring), any float dtype (kept).
    state_indices: ``[N]`` int slot of each sequence, read (if ``has_initial_state``) and written with the
      last ``W - 1`` pre-conv rows after the sequence; -1: zero history, write nothing. A length-0
      sequence with an initial state leaves its slot bitwise unchanged; one without writes zeros (the state
      after zero tokens from a zero history, as ``kda_prefill``).
    has_initial_state: ``[N]`` bool.
    checkpoint_indptr: ``[N + 1]`` int CSR row pointer (None: no checkpoints; the three go together).
    checkpoint_offsets: ``[M]`` int, tokens from the start of sequence n, in ``(0, L_n]``: the ``W - 1``
      pre-conv rows before that offset (the conv state after ``offset`` tokens) are written.
    checkpoint_slots: ``[M]`` int destination slots (-1: skip).
    config: ``ShortConvConfig`` (activation, impl, kernel tuning); None: ``ShortConvConfig()``. The kernel
      impls need ``D % 128 == 0``; they update the pool in place when an enclosing jit donates it, so
      destination slots (final states and checkpoints) must not be another sequence's initial-state slot,
      as for ``kda_prefill``: the distinct-writes check (state_indices and checkpoint_slots together)
      guarantees that whenever the indices are concrete.

  Returns:
    ``y [T, D]`` in x's dtype, and the new ``conv_pool`` (same shape and dtype; only the written slots
    change).

  Raises:
    ValueError: on a bad shape, dtype or value (values are checked when they are concrete), or when one slot
      would be written twice.
    NotImplementedError: a kernel impl with ``D`` not a multiple of 128.
  """
  config = ShortConvConfig() if config is None else config
  _check_common(x, weight, conv_pool, {2: "[T, D]"})
  checks.check_prefill_indices(x.shape[0], conv_pool.shape[0], "conv_pool", cu_seqlens=cu_seqlens,
                               state_indices=state_indices, has_initial_state=has_initial_state,
                               checkpoint_indptr=checkpoint_indptr, checkpoint_offsets=checkpoint_offsets,
                               checkpoint_slots=checkpoint_slots, int_dtypes=util.INT_DTYPES)
  if config.impl == "xla":
    return _prefill_xla(x, weight, cu_seqlens=cu_seqlens, conv_pool=conv_pool, state_indices=state_indices,
                        has_initial_state=has_initial_state, checkpoint_indptr=checkpoint_indptr,
                        checkpoint_offsets=checkpoint_offsets, checkpoint_slots=checkpoint_slots,
                        activation=config.activation)
  return kernel.short_conv_prefill_mosaic(x, weight, cu_seqlens, conv_pool, state_indices, has_initial_state,
                                          checkpoint_indptr, checkpoint_offsets, checkpoint_slots, config=config,
                                          interpret=config.impl == "interpret")


def short_conv_update(x: jax.Array, weight: jax.Array, *, conv_pool: jax.Array, state_indices: jax.Array,
                      num_accepted: jax.Array | None = None,
                      config: ShortConvConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """Decode step(s) of the causal depthwise conv on conv pool slots.

  Two forms, as ``kda_decode``:
  * one token: ``x [N, D]``, ``state_indices [N]``: the window is read from the slot and the window after
    the token written back to it;
  * speculative verify: ``x [N, 1 + S, D]``, ``state_indices [N, 1 + S]``, ``num_accepted [N]`` in
    ``[1, 1 + S]``: the window is read from column ``num_accepted[n] - 1`` and the window after token t
    is written to column t (-1 entries there: not written), so a verifier can roll back.
  A row whose read slot is -1 outputs 0 and reads and writes nothing.

  Args:
    x: ``[N, D]`` or ``[N, 1 + S, D]`` pre-conv rows, f32/bf16/f16.
    weight: ``[D, W]`` taps, oldest first.
    conv_pool: ``[P, W - 1, D]`` (layout in the module docstring), any float dtype (kept).
    state_indices: ``[N]`` or ``[N, 1 + S]`` int, in ``[-1, P)``.
    num_accepted: ``[N]`` int, required with (and only with) the speculative form.
    config: ``ShortConvConfig`` (activation, impl, kernel tuning); None: ``ShortConvConfig()``. The kernel
      impls need ``D % 128 == 0``; they update the pool in place when an enclosing jit donates it.

  Returns:
    ``y`` (x's shape and dtype) and the new ``conv_pool`` (same shape and dtype).

  Raises:
    ValueError: on a bad shape, dtype or value (values are checked when they are concrete), or when one slot
      would be written twice.
    NotImplementedError: a kernel impl with ``D`` not a multiple of 128.
  """
  config = ShortConvConfig() if config is None else config
  _check_common(x, weight, conv_pool, {2: "[N, D]", 3: "[N, 1 + S, D]"})
  checks.check_decode_indices("x", x.shape, x.ndim == 3, conv_pool.shape[0], "conv_pool",
                              state_indices=state_indices, num_accepted=num_accepted, int_dtypes=util.INT_DTYPES)
  if config.impl == "xla":
    return _update_xla(x, weight, conv_pool=conv_pool, state_indices=state_indices, num_accepted=num_accepted,
                       activation=config.activation)
  return kernel.short_conv_update_mosaic(x, weight, conv_pool, state_indices, num_accepted, config=config,
                                         interpret=config.impl == "interpret")

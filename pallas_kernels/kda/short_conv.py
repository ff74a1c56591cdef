"""Short causal depthwise convolution (width W, SiLU) of the packed q|k|v projection, with a conv state pool.

Both ops have a Mosaic GPU kernel (``short_conv_kernel``) next to the pure-JAX form (``impl="xla"``): as several
XLA kernels (gather, conv, scatter) decode ran at 2-9% of copy bandwidth on an H200, and prefill at 40% (27% of
the time of the KDA prefill it feeds).

Conv state pool layout: ``conv_pool [P, W - 1, D]``: slot ``s`` holds the last ``W - 1`` *pre-conv* input
rows of its sequence, oldest first (row ``W - 2`` is the most recent token). Its dtype is chosen by the
caller and kept: rows are rounded to it once when written, read back as f32.

Math, per channel ``c``, with ``h`` the history = ``W - 1`` state rows followed by the sequence's rows:
``y[t, c] = act(sum_i weight[c, i] * h[t + i, c])``, i = 0..W-1 (i = W-1 is the current token), all in f32.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import util
from pallas_kernels.kda import checks, short_conv_kernel

ACTIVATIONS = ("silu", None)


def _conv(windows: jax.Array, weight: jax.Array, activation: str | None) -> jax.Array:
  """``windows [..., W, D]`` f32 (oldest first), ``weight [D, W]`` -> ``[..., D]`` f32."""
  # Products and a sum over the W taps, one elementwise fusion: as an einsum XLA makes this a dot with D
  # batch dimensions of 1 x W x 1 each, which ran the H200 decode at a small fraction of copy bandwidth.
  y = jnp.sum(windows * weight.T.astype(jnp.float32), axis=-2)
  return jax.nn.silu(y) if activation == "silu" else y


def _check_common(x, weight, conv_pool, activation, x_shapes: dict[int, str]) -> int:
  """Shared checks of ``x`` (rank -> shape name), ``weight``, ``conv_pool``, ``activation``; returns W."""
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
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
  return width


def _scatter_rows(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
  """``pool[slots[i]] = rows[i]`` for ``slots[i] >= 0``; negative slots write nothing."""
  # Index P is out of bounds and dropped; -1 itself would wrap around to the last slot.
  idx = jnp.where(slots >= 0, slots, pool.shape[0]).astype(jnp.int32)
  return pool.at[idx].set(rows.astype(pool.dtype), mode="drop")


def short_conv_prefill(x: jax.Array, weight: jax.Array, *, cu_seqlens: jax.Array, conv_pool: jax.Array,
                       state_indices: jax.Array, has_initial_state: jax.Array,
                       checkpoint_indptr: jax.Array | None = None,
                       checkpoint_offsets: jax.Array | None = None,
                       checkpoint_slots: jax.Array | None = None,
                       activation: str | None = "silu", impl: str | None = None) -> tuple[jax.Array, jax.Array]:
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
    activation: ``"silu"`` or None.
    impl: ``"pallas"`` (the Mosaic GPU kernel, Hopper only), ``"interpret"`` (the same kernel in Mosaic GPU
      interpret mode, CPU), ``"xla"`` (pure JAX) or None: ``"pallas"`` on a Hopper GPU, else ``"xla"``.
      The kernel needs ``D % 128 == 0``; it updates the pool in place when an enclosing jit donates it, so
      its destination slots (final states and checkpoints) must not be another sequence's initial-state
      slot, as for ``kda_prefill``: the distinct-writes check (state_indices and checkpoint_slots together)
      guarantees that whenever the indices are concrete.

  Returns:
    ``y [T, D]`` in x's dtype, and the new ``conv_pool`` (same shape and dtype; only the written slots
    change).

  Raises:
    ValueError: on a bad shape, dtype, value (values are checked when they are concrete) or impl, or when
      one slot would be written twice.
    NotImplementedError: a kernel impl with ``D`` not a multiple of 128.
  """
  impl = util.canonical_impl(impl)
  _check_common(x, weight, conv_pool, activation, {2: "[T, D]"})
  checks.check_prefill_indices(x.shape[0], conv_pool.shape[0], "conv_pool", cu_seqlens=cu_seqlens,
                               state_indices=state_indices, has_initial_state=has_initial_state,
                               checkpoint_indptr=checkpoint_indptr, checkpoint_offsets=checkpoint_offsets,
                               checkpoint_slots=checkpoint_slots, int_dtypes=util.INT_DTYPES)
  if impl != "xla":
    return short_conv_kernel.short_conv_prefill_mosaic(
        x, weight, cu_seqlens, conv_pool, state_indices, has_initial_state, checkpoint_indptr, checkpoint_offsets,
        checkpoint_slots, activation=activation, interpret=impl == "interpret")
  return _prefill(x, weight, cu_seqlens, conv_pool, state_indices, has_initial_state, checkpoint_indptr,
                  checkpoint_offsets, checkpoint_slots, activation=activation)


@functools.partial(jax.jit, static_argnames=("activation",))
def _prefill(x, weight, cu_seqlens, conv_pool, state_indices, has_initial_state, checkpoint_indptr,
             checkpoint_offsets, checkpoint_slots, *, activation):
  """Jitted body of ``short_conv_prefill`` (inputs validated)."""
  num_tokens, n, width = x.shape[0], state_indices.shape[0], weight.shape[1]
  hist_len = width - 1
  starts = cu_seqlens[:-1].astype(jnp.int32)
  lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).astype(jnp.int32)
  read = has_initial_state & (state_indices >= 0)
  init = jnp.where(read[:, None, None], conv_pool[jnp.clip(state_indices, 0)].astype(jnp.float32), 0.0)
  xf = x.astype(jnp.float32)

  def history(seq: jax.Array, pos: jax.Array) -> jax.Array:
    """Pre-conv row at position ``pos`` (may be negative: the state) of sequence ``seq``; f32 [..., D]."""
    from_x = xf[jnp.clip(starts[seq] + pos, 0, max(num_tokens - 1, 0))] if num_tokens else 0.0
    from_state = init[seq, jnp.clip(pos + hist_len, 0, hist_len - 1)]
    return jnp.where((pos >= 0)[..., None], from_x, from_state)

  def state_before(seq: jax.Array, offset: jax.Array) -> jax.Array:
    """The ``W - 1`` rows before ``offset`` tokens of ``seq``: the conv state after them, [..., W-1, D]."""
    return history(seq[..., None], offset[..., None] + jnp.arange(-hist_len, 0))

  tok = jnp.arange(num_tokens)
  tok_seq = jnp.searchsorted(cu_seqlens[1:], tok, side="right").astype(jnp.int32)
  tok_pos = tok - starts[tok_seq]
  windows = history(tok_seq[:, None], tok_pos[:, None] + jnp.arange(-hist_len, 1))
  y = _conv(windows, weight, activation).astype(x.dtype)

  # A length-0 sequence ends in its history: its own slot is left as it is, a zero history is written.
  new_pool = _scatter_rows(conv_pool, jnp.where((lengths > 0) | ~has_initial_state, state_indices, -1),
                           state_before(jnp.arange(n), lengths))
  if checkpoint_indptr is not None and checkpoint_offsets.shape[0]:
    ck_seq = jnp.searchsorted(checkpoint_indptr[1:], jnp.arange(checkpoint_offsets.shape[0]),
                              side="right").astype(jnp.int32)
    new_pool = _scatter_rows(new_pool, checkpoint_slots,
                             state_before(ck_seq, checkpoint_offsets.astype(jnp.int32)))
  return y, new_pool


def short_conv_update(x: jax.Array, weight: jax.Array, *, conv_pool: jax.Array, state_indices: jax.Array,
                      num_accepted: jax.Array | None = None, activation: str | None = "silu",
                      impl: str | None = None) -> tuple[jax.Array, jax.Array]:
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
    activation: ``"silu"`` or None.
    impl: ``"pallas"`` (the Mosaic GPU kernel, Hopper only), ``"interpret"`` (the same kernel in Mosaic GPU
      interpret mode, CPU), ``"xla"`` (pure JAX) or None: ``"pallas"`` on a Hopper GPU, else ``"xla"``.
      The kernel needs ``D % 128 == 0``; it updates the pool in place when an enclosing jit donates it.

  Returns:
    ``y`` (x's shape and dtype) and the new ``conv_pool`` (same shape and dtype).

  Raises:
    ValueError: on a bad shape, dtype, value (values are checked when they are concrete) or impl, or when
      one slot would be written twice.
    NotImplementedError: a kernel impl with ``D`` not a multiple of 128.
  """
  speculative = x.ndim == 3
  impl = util.canonical_impl(impl)
  _check_common(x, weight, conv_pool, activation, {2: "[N, D]", 3: "[N, 1 + S, D]"})
  checks.check_decode_indices("x", x.shape, speculative, conv_pool.shape[0], "conv_pool",
                              state_indices=state_indices, num_accepted=num_accepted, int_dtypes=util.INT_DTYPES)
  if impl != "xla":
    return short_conv_kernel.short_conv_update_mosaic(x, weight, conv_pool, state_indices, num_accepted,
                                                      activation=activation, interpret=impl == "interpret")
  if not speculative:
    x, state_indices = x[:, None], state_indices[:, None]
    num_accepted = jnp.ones((x.shape[0],), jnp.int32)
  y, new_pool = _update(x, weight, conv_pool, state_indices, num_accepted, activation=activation)
  return (y if speculative else y[:, 0]), new_pool


@functools.partial(jax.jit, static_argnames=("activation",))
def _update(x, weight, conv_pool, state_indices, num_accepted, *, activation):
  """Jitted body of ``short_conv_update`` in the speculative form (inputs validated)."""
  n, width = x.shape[0], weight.shape[1]
  hist_len, steps = width - 1, x.shape[1]
  read_slot = jnp.take_along_axis(state_indices, (num_accepted - 1)[:, None].astype(jnp.int32), axis=1)[:, 0]
  live = read_slot >= 0
  init = conv_pool[jnp.clip(read_slot, 0)].astype(jnp.float32)
  hist = jnp.concatenate([init, x.astype(jnp.float32)], axis=1)  # [N, W - 1 + 1 + S, D]
  windows = jnp.stack([hist[:, t:t + width] for t in range(steps)], axis=1)  # [N, 1 + S, W, D]
  y = jnp.where(live[:, None, None], _conv(windows, weight, activation), 0.0).astype(x.dtype)
  states = windows[:, :, 1:]  # the window after token t, minus the oldest row: [N, 1 + S, W - 1, D]
  write = jnp.where(live[:, None], state_indices, -1)
  # Explicit D: a -1 in the reshape of an empty batch (N = 0) divides by zero.
  new_pool = _scatter_rows(conv_pool, write.reshape(-1), states.reshape(n * steps, hist_len, x.shape[-1]))
  return y, new_pool

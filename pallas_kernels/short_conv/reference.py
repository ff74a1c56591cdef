"""The short convolution in pure JAX: the ``impl="xla"`` path of ``short_conv_prefill`` / ``short_conv_update``.

Jit-able with traced index arrays (all shapes static). Inputs are assumed valid (``api`` checks them); invalid
indices under tracing give unspecified results. Pool layout and math: ``api``'s module docstring.
"""

import jax
import jax.numpy as jnp


def _conv(windows: jax.Array, weight: jax.Array, activation: str | None) -> jax.Array:
  """``windows [..., W, D]`` f32 (oldest first), ``weight [D, W]`` -> ``[..., D]`` f32."""
  # Products and a sum over the W taps, one elementwise fusion: as an einsum XLA makes this a dot with D
  # batch dimensions of 1 x W x 1 each, which runs far below copy bandwidth on the GPU.
  y = jnp.sum(windows * weight.T.astype(jnp.float32), axis=-2)
  return jax.nn.silu(y) if activation == "silu" else y


def _scatter_rows(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
  """``pool[slots[i]] = rows[i]`` for ``slots[i] >= 0``; negative slots write nothing."""
  # Index P is out of bounds and dropped; -1 itself would wrap around to the last slot.
  idx = jnp.where(slots >= 0, slots, pool.shape[0]).astype(jnp.int32)
  return pool.at[idx].set(rows.astype(pool.dtype), mode="drop")


def short_conv_prefill_reference(x: jax.Array, weight: jax.Array, *, cu_seqlens: jax.Array, conv_pool: jax.Array,
                                 state_indices: jax.Array, has_initial_state: jax.Array,
                                 checkpoint_indptr: jax.Array | None = None,
                                 checkpoint_offsets: jax.Array | None = None,
                                 checkpoint_slots: jax.Array | None = None,
                                 activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
  """``short_conv_prefill(impl="xla")``: the causal depthwise conv over packed sequences, with the conv pool.

  Args:
    x: ``[T, D]`` pre-conv rows, f32/bf16/f16. weight: ``[D, W]`` taps, oldest first.
    cu_seqlens: ``[N + 1]`` int. conv_pool: ``[P, W - 1, D]``, any float dtype (kept).
    state_indices: ``[N]`` int slots (-1: zero history, write nothing). has_initial_state: ``[N]`` bool.
    checkpoint_indptr, checkpoint_offsets, checkpoint_slots: ``[N + 1]``, ``[M]``, ``[M]`` int, or all None.
    activation: ``"silu"`` or None.

  Returns:
    ``y [T, D]`` in x's dtype and the new pool (same shape and dtype), as ``short_conv_prefill``.
  """
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


def short_conv_update_reference(x: jax.Array, weight: jax.Array, *, conv_pool: jax.Array, state_indices: jax.Array,
                                num_accepted: jax.Array | None = None,
                                activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
  """``short_conv_update(impl="xla")``: decode step(s) of the causal depthwise conv on conv pool slots.

  Args:
    x: ``[N, D]`` (one token) or ``[N, 1 + S, D]`` (speculative verify) pre-conv rows, f32/bf16/f16.
    weight: ``[D, W]`` taps, oldest first. conv_pool: ``[P, W - 1, D]``, any float dtype (kept).
    state_indices: ``[N]`` or ``[N, 1 + S]`` int slots. num_accepted: ``[N]`` int (speculative form) or None.
    activation: ``"silu"`` or None.

  Returns:
    ``y`` (x's shape and dtype) and the new pool (same shape and dtype), as ``short_conv_update``.
  """
  speculative = x.ndim == 3
  if not speculative:
    x, state_indices = x[:, None], state_indices[:, None]
    num_accepted = jnp.ones((x.shape[0],), jnp.int32)
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
  return (y if speculative else y[:, 0]), new_pool

"""The short causal depthwise convolution as Mosaic GPU kernels: decode steps (``short_conv_update``) and varlen
prefill (``short_conv_prefill``).

Streaming kernels, one warpgroup per program, rows loaded straight from GMEM into f32 registers and stored straight
back; the pool is updated in place. README.md has the design: the programs of each kernel, why their pool reads
never race the writes, and how the taps reach the registers.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_interpret, util
from pallas_kernels.short_conv.config import BLOCKS, UNROLL, ShortConvConfig, resolve_tuning

MAX_VEC = 8  # channels per thread and access: 16 bytes of bf16


def _vec(channels: int) -> int:
  """Channels per thread and access for a block of ``channels`` (a multiple of 128): the widest that fits."""
  return next(v for v in (MAX_VEC, 4, 2, 1) if channels % (128 * v) == 0)


def _for_channel_blocks(d: int, block: int, channels: Callable) -> None:
  """Run ``channels(size, start)`` for this program's channel block (grid axis ``"d"``).

  ``D`` need not be a multiple of the block (``D = 3 * 11 * 128`` at 11 heads per device): the last program takes
  the remaining channels, with accesses as wide as they allow. Blocks never overlap: a channel read by one
  program and written by another would race.
  """
  db = lax.axis_index("d")
  full, tail = divmod(d, block)
  if not tail:
    channels(block, pl.multiple_of(db * block, block))
    return
  pl.when(db < full)(lambda: channels(block, pl.multiple_of(db * block, block)))
  pl.when(db == full)(lambda: channels(tail, full * block))


def _row_loader(size: int) -> tuple[Callable, Callable]:
  """``(load, zeros)`` for rows of ``size`` channels in the channels-per-thread layout: a GMEM/SMEM row ref ->
  array, and a dtype -> zero row."""
  per_thread = plgpu.Layout.WG_STRIDED((size,), vec_size=_vec(size))
  load = lambda ref: plgpu.load(ref, layout=per_thread, optimized=False)
  zeros = lambda dtype: plgpu.layout_cast(jnp.zeros((size,), dtype), per_thread)
  return load, zeros


def _load_taps(w_ref, w_smem, chans: pl.Slice, load: Callable) -> list:
  """The ``W`` taps of channels ``chans`` as f32 rows in the layout of ``load``."""
  taps_smem = w_smem.at[:, pl.ds(0, chans.size)]
  for i in range(w_ref.shape[1]):
    taps_smem[i] = plgpu.load(w_ref.at[chans, i], layout=plgpu.Layout.WG_STRIDED((chans.size,), vec_size=1),
                              optimized=False).astype(jnp.float32)
  return [load(taps_smem.at[i]) for i in range(w_ref.shape[1])]


def _conv_row(taps: list, window: list, activation: str | None):
  """One output row: ``act(sum_i taps[i] * window[i])`` over f32 rows, oldest first."""
  acc = taps[0] * window[0]
  for tap, h in zip(taps[1:], window[1:]):
    acc = acc + tap * h
  return acc / (1.0 + jnp.exp(-acc)) if activation == "silu" else acc


def _to_pool(row, dtype):
  """An input row as stored in the pool: rounded once to the pool dtype (via f32, as XLA)."""
  return row if row.dtype == dtype else row.astype(jnp.float32).astype(dtype)


def _conv_body(x_ref, w_ref, slots_ref, accepted_ref, pool_ref, y_ref, w_smem, *, steps: int, rows: int,
               block: int, speculative: bool, activation: str | None):
  n_total, width, d = x_ref.shape[0], w_ref.shape[1], x_ref.shape[2]
  hist_len = width - 1
  first = lax.axis_index("g") * rows
  f32 = jnp.float32
  # Issue the slot reads first: they and the taps' loads are the only dependent round trips before the
  # rows' own loads. Rows past the end (a partial last group) read the last row's slot and do nothing.
  ns = [jnp.minimum(first + r, n_total - 1) for r in range(rows)]
  reads = [slots_ref[n, accepted_ref[n] - 1] if speculative else slots_ref[n, 0] for n in ns]

  def channels(size: int, start):
    """The program's work on channels ``[start, start + size)``."""
    chans = pl.ds(start, size)
    load, zeros = _row_loader(size)
    taps = _load_taps(w_ref, w_smem, chans, load)

    def one_row(n, read):
      @pl.when(read >= 0)
      def _():
        raw = [load(pool_ref.at[read, j, chans]) for j in range(hist_len)]
        xs = [load(x_ref.at[n, t, chans]) for t in range(steps)]
        hist = [r.astype(f32) for r in raw + xs]
        # Windows hold pool-dtype rows: old rows move bitwise, new rows are rounded once.
        stored = raw + [_to_pool(x, pool_ref.dtype) for x in xs]
        for t in range(steps):
          y_ref[n, t, chans] = _conv_row(taps, hist[t:t + width], activation).astype(y_ref.dtype)
          dst = slots_ref[n, t]

          @pl.when(dst >= 0)
          def _():
            for j in range(hist_len):
              pool_ref[dst, j, chans] = stored[t + 1 + j]

      @pl.when(read < 0)
      def _():
        for t in range(steps):
          y_ref[n, t, chans] = zeros(y_ref.dtype)

    for r in range(rows):
      if n_total % rows:
        pl.when(first + r < n_total)(functools.partial(one_row, ns[r], reads[r]))
      else:
        one_row(ns[r], reads[r])

  _for_channel_blocks(d, block, channels)


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "block", "rows"))
def _update(x, weight, conv_pool, state_indices, num_accepted, *, activation, interpret, block, rows):
  single = x.ndim == 2
  if single:
    x, state_indices = x[:, None], state_indices[:, None]
  n, steps, d = x.shape
  speculative = num_accepted is not None
  body = functools.partial(_conv_body, steps=steps, rows=rows, block=block, speculative=speculative,
                           activation=activation)
  slots = state_indices.astype(jnp.int32)
  # The one-token kernel never reads num_accepted: pass the slots in its place rather than build an array.
  accepted = num_accepted.astype(jnp.int32) if speculative else slots
  with mosaic_interpret.interpret_mode(interpret):
    pool_ref = jax.new_ref(conv_pool)
    y = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(util.cdiv(d, block), util.cdiv(n, rows)),
        grid_names=("d", "g"),
        kernel_name="short_conv_update",
        scratch_types=(plgpu.SMEM((weight.shape[1], block), jnp.float32),),
        compiler_params=util.compiler_params(),
    )(x, weight, slots, accepted, pool_ref)
  return (y[:, 0] if single else y), pool_ref[...]


def _check_channels(d: int) -> None:
  if d % BLOCKS[-1]:
    raise NotImplementedError(f"the short conv kernel needs D % {BLOCKS[-1]} == 0, got D={d}")


def short_conv_update_mosaic(x: jax.Array, weight: jax.Array, conv_pool: jax.Array, state_indices: jax.Array,
                             num_accepted: jax.Array | None, *, config: ShortConvConfig,
                             interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``short_conv_update``: inputs already validated by it (same shapes and meaning).

  Args:
    x: ``[N, D]`` or ``[N, 1 + S, D]`` pre-conv rows, f32/bf16/f16.
    weight: ``[D, W]`` taps, oldest first, f32/bf16/f16.
    conv_pool: ``[P, W - 1, D]`` conv state pool, any float dtype (kept; not donated here).
    state_indices: ``[N]`` or ``[N, 1 + S]`` int slots; num_accepted: ``[N]`` int (speculative form) or None.
    config: ``config.activation`` and the grid ``config.tuning`` (``block`` and ``rows``; None fields from
      ``resolve_tuning``).
    interpret: run in Mosaic GPU interpret mode (CPU).

  Returns:
    ``y`` (x's shape and dtype) and the new pool.

  Raises:
    NotImplementedError: ``D`` not a multiple of 128 (one channel per thread of the narrowest block).
  """
  n, d = x.shape[0], x.shape[-1]
  _check_channels(d)
  if n == 0:  # no program to run (a grid dimension of 0 does not lower)
    return x, conv_pool
  tuning = resolve_tuning(config.tuning, num_rows=n, channels=d)
  return _update(x, weight, conv_pool, state_indices, num_accepted, activation=config.activation,
                 interpret=interpret, block=tuning.block, rows=tuning.rows)


def _prefill_body(x_ref, w_ref, head_ref, cu_ref, slots_ref, read_ref, ck_ptr_ref, ck_off_ref, ck_slot_ref,
                  pool_ref, y_ref, w_smem, *, block: int, token_block: int, checkpoints: bool,
                  activation: str | None):
  num_tokens, d = x_ref.shape
  width = w_ref.shape[1]
  hist_len = width - 1
  num_blocks = util.cdiv(num_tokens, token_block)
  g = lax.axis_index("g")
  f32 = jnp.float32
  clamp = lambda t: jnp.clip(t, 0, num_tokens - 1)  # rows at clamped positions are loaded but never used

  def channels(size: int, start):
    """The program's work on channels ``[start, start + size)``."""
    chans = pl.ds(start, size)
    load, zeros = _row_loader(size)
    taps = _load_taps(w_ref, w_smem, chans, load)
    row = lambda t: load(x_ref.at[t, chans])

    def store_y(t, window):
      y_ref[t, chans] = _conv_row(taps, window, activation).astype(y_ref.dtype)

    @pl.when(g < num_blocks)
    def _token_program():
      t0 = g * token_block

      def group(i, window):
        base = t0 + i * UNROLL
        hist = list(window) + [row(clamp(base + u)).astype(f32) for u in range(UNROLL)]
        for u in range(UNROLL):
          # head[t] != 0: one of its sequence's first W - 1 tokens (the sequence program's) or past the end.
          pl.when(head_ref[base + u] == 0)(functools.partial(store_y, base + u, hist[u:u + width]))
        return tuple(hist[UNROLL:])

      before = tuple(row(clamp(t0 - hist_len + j)).astype(f32) for j in range(hist_len))
      lax.fori_loop(0, token_block // UNROLL, group, before)

    @pl.when(g >= num_blocks)
    def _sequence_program():
      n = g - num_blocks
      begin, length, slot = cu_ref[n], cu_ref[n + 1] - cu_ref[n], slots_ref[n]

      def with_history(old: list) -> None:
        """``old``: the ``W - 1`` history rows in the pool dtype (read before any pool write below)."""
        hist = [h.astype(f32) for h in old] + [row(clamp(begin + j)).astype(f32) for j in range(hist_len)]
        for j in range(hist_len):
          pl.when(j < length)(functools.partial(store_y, begin + j, hist[j:j + width]))

        def write_state(dst, offset):
          """The ``W - 1`` rows before ``offset`` tokens of the sequence into slot ``dst``."""
          for j in range(hist_len):
            pos = offset + j - hist_len  # position in the sequence; negative: history row pos + W - 1
            pl.when(pos >= 0)(lambda j=j, pos=pos: pool_ref.__setitem__(
                (dst, j, chans), _to_pool(row(clamp(begin + pos)), pool_ref.dtype)))
            for k in range(j, hist_len):  # offset >= 0, so a history row k >= j (k == j: offset 0)
              pl.when(pos + hist_len == k)(lambda j=j, k=k: pool_ref.__setitem__((dst, j, chans), old[k]))

        # A length-0 sequence ends in its history: its own slot stays as it is, a zero history is written.
        pl.when((slot >= 0) & ((length > 0) | (read_ref[n] == 0)))(lambda: write_state(slot, length))
        if checkpoints:
          def checkpoint(i, carry):
            dst = ck_slot_ref[i]
            pl.when(dst >= 0)(lambda: write_state(dst, ck_off_ref[i]))
            return carry

          lax.fori_loop(ck_ptr_ref[n], ck_ptr_ref[n + 1], checkpoint, 0)

      read = read_ref[n] != 0
      pl.when(read)(lambda: with_history([load(pool_ref.at[slot, j, chans]) for j in range(hist_len)]))
      pl.when(jnp.logical_not(read))(lambda: with_history([zeros(pool_ref.dtype)] * hist_len))

  _for_channel_blocks(d, block, channels)


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "block", "token_block"))
def _prefill(x, weight, cu_seqlens, conv_pool, state_indices, has_initial_state, checkpoint_indptr,
             checkpoint_offsets, checkpoint_slots, *, activation, interpret, block, token_block):
  num_tokens, d = x.shape
  n, hist_len = state_indices.shape[0], weight.shape[1] - 1
  num_blocks = util.cdiv(num_tokens, token_block)
  padded = num_blocks * token_block
  cu = cu_seqlens.astype(jnp.int32)
  starts, lengths = cu[:-1], cu[1:] - cu[:-1]
  # Index arithmetic on [T]- and [N]-sized int arrays: which tokens the token programs leave to the sequence
  # programs (the first W - 1 of each sequence, and the padding past T).
  head = jnp.zeros((padded,), jnp.int32).at[num_tokens:].set(1)
  for j in range(hist_len):
    head = head.at[jnp.where(j < lengths, starts + j, padded)].set(1, mode="drop")
  slots = state_indices.astype(jnp.int32)
  read = (has_initial_state & (slots >= 0)).astype(jnp.int32)
  checkpoints = checkpoint_indptr is not None and checkpoint_offsets.shape[0] > 0
  if checkpoints:
    ck = [a.astype(jnp.int32) for a in (checkpoint_indptr, checkpoint_offsets, checkpoint_slots)]
  else:  # never read (the kernel is built without the checkpoint loop); GMEM refs need a non-empty shape
    ck = [jnp.zeros((1,), jnp.int32)] * 3
  body = functools.partial(_prefill_body, block=block, token_block=token_block, checkpoints=checkpoints,
                           activation=activation)
  with mosaic_interpret.interpret_mode(interpret):
    pool_ref = jax.new_ref(conv_pool)
    y = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(util.cdiv(d, block), num_blocks + n),
        grid_names=("d", "g"),
        kernel_name="short_conv_prefill",
        scratch_types=(plgpu.SMEM((weight.shape[1], block), jnp.float32),),
        compiler_params=util.compiler_params(),
    )(x, weight, head, cu, slots, read, *ck, pool_ref)
  return y, pool_ref[...]


def short_conv_prefill_mosaic(x: jax.Array, weight: jax.Array, cu_seqlens: jax.Array, conv_pool: jax.Array,
                              state_indices: jax.Array, has_initial_state: jax.Array,
                              checkpoint_indptr: jax.Array | None, checkpoint_offsets: jax.Array | None,
                              checkpoint_slots: jax.Array | None, *, config: ShortConvConfig,
                              interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``short_conv_prefill``: inputs already validated by it (same shapes and meaning).

  Args:
    x: ``[T, D]`` pre-conv rows, f32/bf16/f16. weight: ``[D, W]`` taps, oldest first.
    cu_seqlens: ``[N + 1]`` int. conv_pool: ``[P, W - 1, D]``, any float dtype (kept; not donated here).
    state_indices: ``[N]`` int slots (-1: zero history, write nothing). has_initial_state: ``[N]`` bool.
    checkpoint_indptr, checkpoint_offsets, checkpoint_slots: ``[N + 1]``, ``[M]``, ``[M]`` int, or all None.
    config: ``config.activation`` and the grid ``config.tuning`` (``block`` and ``token_block``; None fields
      from ``resolve_tuning``).
    interpret: run in Mosaic GPU interpret mode (CPU).

  Returns:
    ``y [T, D]`` in x's dtype and the new pool. Destination slots (final states and checkpoints) must not be
    another sequence's initial-state slot (each sequence's program writes its slots while others read theirs).

  Raises:
    NotImplementedError: ``D`` not a multiple of 128.
  """
  num_tokens, d = x.shape
  _check_channels(d)
  if num_tokens == 0:
    # Every sequence is empty, but those without an initial state still write their zero state: run the
    # kernel on one unused zero row (a program's loads need a row to read).
    y, pool = short_conv_prefill_mosaic(jnp.zeros((1, d), x.dtype), weight, cu_seqlens, conv_pool, state_indices,
                                        has_initial_state, checkpoint_indptr, checkpoint_offsets, checkpoint_slots,
                                        config=config, interpret=interpret)
    return y[:0], pool
  tuning = resolve_tuning(config.tuning, num_rows=num_tokens, channels=d)
  return _prefill(x, weight, cu_seqlens, conv_pool, state_indices, has_initial_state, checkpoint_indptr,
                  checkpoint_offsets, checkpoint_slots, activation=config.activation, interpret=interpret,
                  block=tuning.block, token_block=tuning.token_block)

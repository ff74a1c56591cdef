"""Decode step(s) of the short causal depthwise convolution (``short_conv_update``) as a Mosaic GPU kernel.

The op is a copy with a little arithmetic: per row it reads ``W - 1`` pool rows and ``1 + S`` input rows
and writes ``1 + S`` outputs and up to ``1 + S`` new windows of ``W - 1`` rows, every row ``D`` channels.
So the kernel only has to stream: one program per (block of ``BD`` channels, group of ``R`` rows), one
warpgroup, each thread holding ``BD / 128`` consecutive channels (16-byte accesses for bf16 at
``BD = 1024``) loaded straight from GMEM into f32 registers, and every result stored straight back. When
``BD`` does not divide ``D`` the last block is the ``D mod BD`` remaining channels.
The pool is updated in place: it is passed as a ``jax.new_ref`` (``plgpu.kernel`` has no
``input_output_aliases``); like ``kda_decode`` the pool itself is not donated, so the update happens in
place inside an enclosing jit that donates it.

Reads never race writes: a live row's read slot is one of its own written slots, and written slots are
distinct across live rows (checked by ``short_conv_update`` when the indices are concrete), so only the
program that reads a slot's channels writes them, after its loads.

The taps arrive as ``weight [D, W]`` row-major, so one tap is a stride-``W`` column: it is loaded once per
program one channel per thread-element and re-laid out through SMEM into the channels-per-thread layout
of the rows (no transpose op per call).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _interpret, _util

BLOCKS = (1024, 512, 256, 128)  # channels per program, widest first; 128 threads x up to 8 channels
MAX_VEC = 8  # channels per thread and access: 16 bytes of bf16
# Grid sizing for an H200 (132 SMs): at least one program per SM, and rows grouped per program (the taps
# are loaded once per program) only while about 16 resident programs per SM remain.
NUM_SMS = 132
TARGET_PROGRAMS = 16 * NUM_SMS
MAX_ROWS = 4


def plan(n: int, d: int) -> tuple[int, int]:
  """``(BD, R)``: channels and rows per program for ``n`` rows of ``d`` channels (``d % 128 == 0``).

  The widest block that still gives every SM a program (small batches are latency bound: more programs
  issue more loads at once), then as many rows per program as keep ``TARGET_PROGRAMS`` programs.
  """
  block = next((b for b in BLOCKS if n * _util.cdiv(d, b) >= NUM_SMS), BLOCKS[-1])
  rows = max(1, min(MAX_ROWS, n * _util.cdiv(d, block) // TARGET_PROGRAMS))
  return block, rows


def _vec(channels: int) -> int:
  """Channels per thread and access for a block of ``channels`` (a multiple of 128): the widest that fits."""
  return next(v for v in (MAX_VEC, 4, 2, 1) if channels % (128 * v) == 0)


def _conv_body(x_ref, w_ref, slots_ref, accepted_ref, pool_ref, y_ref, w_smem, *, steps: int, rows: int,
               block: int, speculative: bool, activation: str | None):
  n_total, width, d = x_ref.shape[0], w_ref.shape[1], x_ref.shape[2]
  hist_len = width - 1
  first = lax.axis_index("g") * rows
  db = lax.axis_index("d")
  f32 = jnp.float32
  # Issue the slot reads first: they and the taps' loads are the only dependent round trips before the
  # rows' own loads. Rows past the end (a partial last group) read the last row's slot and do nothing.
  ns = [jnp.minimum(first + r, n_total - 1) for r in range(rows)]
  reads = [slots_ref[n, accepted_ref[n] - 1] if speculative else slots_ref[n, 0] for n in ns]

  def channels(size: int, start):
    """The program's work on channels ``[start, start + size)``."""
    chans = pl.ds(start, size)
    per_thread = plgpu.Layout.WG_STRIDED((size,), vec_size=_vec(size))
    load = lambda ref: plgpu.load(ref, layout=per_thread, optimized=False)
    taps_smem = w_smem.at[:, pl.ds(0, size)]
    for i in range(width):
      taps_smem[i] = plgpu.load(w_ref.at[chans, i], layout=plgpu.Layout.WG_STRIDED((size,), vec_size=1),
                                optimized=False).astype(f32)
    taps = [load(taps_smem.at[i]) for i in range(width)]

    def one_row(n, read):
      @pl.when(read >= 0)
      def _():
        raw = [load(pool_ref.at[read, j, chans]) for j in range(hist_len)]
        xs = [load(x_ref.at[n, t, chans]) for t in range(steps)]
        hist = [r.astype(f32) for r in raw + xs]
        # Windows hold pool-dtype rows: old rows move bitwise, new rows are rounded once (via f32, as XLA).
        stored = raw + [x if x.dtype == pool_ref.dtype else x.astype(f32).astype(pool_ref.dtype) for x in xs]
        for t in range(steps):
          acc = taps[0] * hist[t]
          for i in range(1, width):
            acc = acc + taps[i] * hist[t + i]
          if activation == "silu":
            acc = acc / (1.0 + jnp.exp(-acc))
          y_ref[n, t, chans] = acc.astype(y_ref.dtype)
          dst = slots_ref[n, t]

          @pl.when(dst >= 0)
          def _():
            for j in range(hist_len):
              pool_ref[dst, j, chans] = stored[t + 1 + j]

      @pl.when(read < 0)
      def _():
        for t in range(steps):
          y_ref[n, t, chans] = plgpu.layout_cast(jnp.zeros((size,), y_ref.dtype), per_thread)

    for r in range(rows):
      if n_total % rows:
        pl.when(first + r < n_total)(functools.partial(one_row, ns[r], reads[r]))
      else:
        one_row(ns[r], reads[r])

  # D need not be a multiple of the block (D = 3 * 11 * 128 at 11 heads per device): the last program
  # takes the remaining channels, with accesses as wide as they allow. Blocks never overlap: a channel
  # read by one program and written by another would race.
  full, tail = divmod(d, block)
  if not tail:
    channels(block, pl.multiple_of(db * block, block))
    return
  pl.when(db < full)(lambda: channels(block, pl.multiple_of(db * block, block)))
  pl.when(db == full)(lambda: channels(tail, full * block))


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
  with _interpret.interpret_mode(interpret):
    pool_ref = jax.new_ref(conv_pool)
    y = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(_util.cdiv(d, block), _util.cdiv(n, rows)),
        grid_names=("d", "g"),
        scratch_types=(plgpu.SMEM((weight.shape[1], block), jnp.float32),),
    )(x, weight, slots, accepted, pool_ref)
  return (y[:, 0] if single else y), pool_ref[...]


def short_conv_update_mosaic(x: jax.Array, weight: jax.Array, conv_pool: jax.Array, state_indices: jax.Array,
                             num_accepted: jax.Array | None, *, activation: str | None, interpret: bool,
                             block_rows: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array]:
  """Kernel path of ``short_conv_update``: inputs already validated by it (same shapes and meaning).

  Args:
    x: ``[N, D]`` or ``[N, 1 + S, D]`` pre-conv rows, f32/bf16/f16.
    weight: ``[D, W]`` taps, oldest first, f32/bf16/f16.
    conv_pool: ``[P, W - 1, D]`` conv state pool, any float dtype (kept; not donated here).
    state_indices: ``[N]`` or ``[N, 1 + S]`` int slots; num_accepted: ``[N]`` int (speculative form) or None.
    activation: ``"silu"`` or None.
    interpret: run in Mosaic GPU interpret mode (CPU).
    block_rows: ``(BD, R)`` channels and rows per program (``BD`` in ``BLOCKS``, ``R >= 1``); None:
      ``plan(N, D)``. Lets small tests run the configs of large shapes.

  Returns:
    ``y`` (x's shape and dtype) and the new pool.

  Raises:
    NotImplementedError: ``D`` not a multiple of 128 (one channel per thread of the narrowest block).
  """
  n, d = x.shape[0], x.shape[-1]
  if d % BLOCKS[-1]:
    raise NotImplementedError(f"the short conv kernel needs D % {BLOCKS[-1]} == 0, got D={d}")
  if n == 0:  # no program to run (a grid dimension of 0 does not lower)
    return x, conv_pool
  block, rows = plan(n, d) if block_rows is None else block_rows
  if block not in BLOCKS or rows < 1:
    raise ValueError(f"block_rows must be (BD, R) with BD in {BLOCKS} and R >= 1, got {block_rows}")
  return _update(x, weight, conv_pool, state_indices, num_accepted, activation=activation, interpret=interpret,
                 block=block, rows=rows)

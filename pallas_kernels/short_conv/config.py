"""Static configuration of the short convolution (prefill and decode): semantics, backend and kernel tuning."""

import dataclasses

from pallas_kernels import util

ACTIVATIONS = ("silu", None)
# Kernel channel blocks, widest first: 128 threads (one warpgroup) x up to 8 channels each.
BLOCKS = (1024, 512, 256, 128)
# Prefill token programs: tokens each, widest first; rows are loaded UNROLL at a time (independent loads in
# flight per thread), so every token block is a multiple of UNROLL.
TOKEN_BLOCKS = (64, 32, 16, 8)
UNROLL = 8
# Grid sizing for an H200 (util.NUM_SMS SMs): at least one program per SM, and decode rows grouped per program
# (the taps are loaded once per program) only while about 16 resident programs per SM remain.
TARGET_PROGRAMS = 16 * util.NUM_SMS
MAX_ROWS = 4


def _check_choice(name: str, value, choices: tuple[int, ...]) -> int | None:
  """``value`` as an int when it is one of ``choices``; None stays None."""
  if value is None:
    return None
  if isinstance(value, bool) or value not in choices:
    raise ValueError(f"{name} must be one of {choices} or None, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShortConvTuning:
  """The Mosaic GPU kernels' grid knobs; a None field takes the heuristic of ``default_tuning``.

  Tuning changes the grid only, never the results: every channel is computed by the same f32 arithmetic
  whatever the program that owns it. The ``"xla"`` impl ignores it.

  Attributes:
    block: channels per program (both ops), one of ``BLOCKS``. When it does not divide ``D`` the last
      program takes the ``D mod block`` remaining channels.
    rows: decode rows per program (``short_conv_update`` only), an int >= 1.
    token_block: tokens per prefill token program (``short_conv_prefill`` only), one of ``TOKEN_BLOCKS``.
  """

  block: int | None = None
  rows: int | None = None
  token_block: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "block", _check_choice("block", self.block, BLOCKS))
    object.__setattr__(self, "token_block", _check_choice("token_block", self.token_block, TOKEN_BLOCKS))
    if self.rows is not None:
      if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
        raise ValueError(f"rows must be an int >= 1 or None, got {self.rows!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShortConvConfig:
  """One frozen, hashable config for ``short_conv_prefill`` and ``short_conv_update``.

  Attributes:
    activation: ``"silu"`` (applied to the conv output, as Kimi-Linear's q/k/v convolutions) or None.
    impl: "xla" (pure JAX), "pallas" (Mosaic GPU kernel, Hopper) or "interpret" (the same kernel in Mosaic
      GPU interpret mode on CPU). Default: "pallas" on a Hopper GPU, else "xla".
    tuning: the kernels' grid (``ShortConvTuning``); None: the heuristic of ``default_tuning`` in every field.
  """

  activation: str | None = "silu"
  impl: str = dataclasses.field(default_factory=util.default_impl)
  tuning: ShortConvTuning | None = None

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.tuning is not None and not isinstance(self.tuning, ShortConvTuning):
      raise ValueError(f"tuning must be a ShortConvTuning or None, got {self.tuning!r}")


def default_tuning(*, num_rows: int, channels: int) -> ShortConvTuning:
  """The tuning the kernels take where ``ShortConvConfig.tuning`` (or a field of it) is None, for one call.

  Heuristic, for ``num_rows`` rows of ``channels`` channels:
  * ``block``: the widest of ``BLOCKS`` that still gives every SM a program (small batches are latency
    bound: more programs issue more loads at once);
  * ``rows``: as many decode rows per program as keep ``TARGET_PROGRAMS`` programs, at most ``MAX_ROWS``;
  * ``token_block``: the longest of ``TOKEN_BLOCKS`` that keeps ``TARGET_PROGRAMS`` prefill token programs
    (each also reads the ``W - 1`` rows before its block: longer blocks read fewer rows twice).

  Args:
    num_rows: rows of ``x``: N sequences of a ``short_conv_update``, T tokens of a ``short_conv_prefill``.
    channels: D, the channels of ``x``.

  Returns:
    A ``ShortConvTuning`` with every field set (each op reads the fields it uses).

  Raises:
    ValueError: ``num_rows`` not an int >= 0 or ``channels`` not an int >= 1.
  """
  for name, size, least in (("num_rows", num_rows, 0), ("channels", channels, 1)):
    if not isinstance(size, int) or isinstance(size, bool) or size < least:
      raise ValueError(f"{name} must be an int >= {least}, got {size!r}")
  return resolve_tuning(None, num_rows=num_rows, channels=channels)


def resolve_tuning(tuning: ShortConvTuning | None, *, num_rows: int, channels: int) -> ShortConvTuning:
  """``tuning`` with its None fields from ``default_tuning``'s heuristic, which sizes ``rows`` and
  ``token_block`` for the block the kernel runs (``tuning.block`` when it is set)."""
  tuning = ShortConvTuning() if tuning is None else tuning
  block = tuning.block or next((b for b in BLOCKS if num_rows * util.cdiv(channels, b) >= util.NUM_SMS),
                               BLOCKS[-1])
  channel_blocks = util.cdiv(channels, block)
  rows = tuning.rows or max(1, min(MAX_ROWS, num_rows * channel_blocks // TARGET_PROGRAMS))
  token_block = tuning.token_block or next(
      (b for b in TOKEN_BLOCKS if util.cdiv(num_rows, b) * channel_blocks >= TARGET_PROGRAMS), TOKEN_BLOCKS[-1])
  return ShortConvTuning(block=block, rows=rows, token_block=token_block)

"""Static configuration of the MLA prefill attention: ``MlaPrefillConfig`` and its ``MlaPrefillTuning``."""

import dataclasses

from pallas_kernels import util
from pallas_kernels.mla.config import positive_float

KERNEL_BLOCK_KS = (64, 128)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaPrefillTuning:
  """Block sizes of the blockwise "xla" path and of the Mosaic GPU kernel ("pallas", "interpret"); every choice
  gives the same result up to rounding: the f32 summation order, and in the kernel where P is rounded to q's
  dtype (relative to the running maximum of the blocks seen so far). None means
  ``mla_prefill.api.default_tuning``'s value.

  Attributes:
    block_q: query rows per block of the "xla" path (the kernel's query blocks are always 128 rows: two
      warpgroups of 64).
    block_k: key rows per block of the "xla" path. The working set per step is the f32 score block
      ``[H, block_q, block_k]`` plus one key block, so memory is O(T * H * D + H * block_q * block_k), never
      ``[T, T]``.
    kernel_block_k: key rows per step of the kernel, 64 or 128 (a wgmma N and K of whole 128-byte rows).
    num_stages: K/V tiles the kernel's producer keeps in flight (ring slots), >= 2. Each slot holds
      ``kernel_block_k * (Dn + Dr + Dv)`` elements; a call whose slots and q tiles exceed the 227 KiB of SMEM
      of an SM raises ``ValueError`` (K3 bf16: at most 4 slots of 64 rows or 2 of 128).
  """

  block_q: int | None = None
  block_k: int | None = None
  kernel_block_k: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name, least in (("block_q", 1), ("block_k", 1), ("num_stages", 2)):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise ValueError(f"{name} must be an int >= {least} or None, got {value!r}")
    if self.kernel_block_k is not None and (isinstance(self.kernel_block_k, bool)
                                            or self.kernel_block_k not in KERNEL_BLOCK_KS):
      raise ValueError(f"kernel_block_k must be one of {KERNEL_BLOCK_KS} or None, got {self.kernel_block_k!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaPrefillConfig:
  """One frozen, hashable config for ``mla_prefill_attention``.

  Attributes:
    scale: softmax scale on the logits ``q . [k_nope | k_rope]``, a finite float > 0; None means
      ``(Dn + Dr) ** -0.5`` (q's last dim). K3 uses ``192 ** -0.5``.
    impl: "xla" (blockwise flash-style pure JAX), "pallas" (the Mosaic GPU kernel, Hopper; bf16 or f16 inputs,
      head dims positive multiples of 64) or "interpret" (the same kernel in Mosaic GPU interpret mode on the CPU:
      slow, for tests). Default: "pallas" on a Hopper GPU, "xla" elsewhere (as the other ops).
    tuning: ``MlaPrefillTuning``, or None for ``default_tuning`` in every field.
  """

  scale: float | None = None
  impl: str = dataclasses.field(default_factory=util.default_impl)
  tuning: MlaPrefillTuning | None = None

  def __post_init__(self):
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.scale is not None:
      object.__setattr__(self, "scale", positive_float("scale", self.scale))
    if self.tuning is not None and not isinstance(self.tuning, MlaPrefillTuning):
      raise ValueError(f"tuning must be an MlaPrefillTuning or None, got {self.tuning!r}")

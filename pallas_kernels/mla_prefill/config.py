"""Static configuration of the MLA prefill attention: ``MlaPrefillConfig`` and its ``MlaPrefillTuning``."""

import dataclasses

from pallas_kernels import util
from pallas_kernels.mla.config import positive_float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaPrefillTuning:
  """Block sizes of the blockwise "xla" path; every choice gives the same result up to f32 summation order.
  None means ``mla_prefill.api.default_tuning``'s value.

  Attributes:
    block_q: query rows per block.
    block_k: key rows per block. The working set per step is the f32 score block ``[H, block_q, block_k]``
      plus one key block, so memory is O(T * H * D + H * block_q * block_k), never ``[T, T]``.
  """

  block_q: int | None = None
  block_k: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaPrefillConfig:
  """One frozen, hashable config for ``mla_prefill_attention``.

  Attributes:
    scale: softmax scale on the logits ``q . [k_nope | k_rope]``, a finite float > 0; None means
      ``(Dn + Dr) ** -0.5`` (q's last dim). K3 uses ``192 ** -0.5``.
    impl: "xla" (blockwise flash-style pure JAX), "pallas" or "interpret" (the Mosaic GPU kernel, not written
      yet: both raise ``NotImplementedError``). Default "xla" everywhere until the kernel exists (the other
      ops default to "pallas" on a Hopper GPU; this one would then raise by default).
    tuning: ``MlaPrefillTuning``, or None for ``default_tuning`` in every field.
  """

  scale: float | None = None
  impl: str = "xla"
  tuning: MlaPrefillTuning | None = None

  def __post_init__(self):
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.scale is not None:
      object.__setattr__(self, "scale", positive_float("scale", self.scale))
    if self.tuning is not None and not isinstance(self.tuning, MlaPrefillTuning):
      raise ValueError(f"tuning must be an MlaPrefillTuning or None, got {self.tuning!r}")

"""Static configuration of the MLA prefill attention."""

import dataclasses
import math

from pallas_kernels import util


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MlaPrefillConfig:
  """One frozen, hashable config for ``mla_prefill_attention``.

  Attributes:
    scale: softmax scale on the logits ``q . [k_nope | k_rope]``, a finite float > 0; None means
      ``(Dn + Dr) ** -0.5`` (q's last dim). K3 uses ``192 ** -0.5``.
    impl: "xla" (blockwise flash-style pure JAX), "pallas" or "interpret" (the Mosaic GPU kernel, not written
      yet: both raise ``NotImplementedError``). Default "xla" everywhere until the kernel exists (the other
      ops default to "pallas" on a Hopper GPU; this one would then raise by default).
    block_q: query rows per block of the blockwise "xla" path (tuning only).
    block_k: key rows per block of the blockwise "xla" path (tuning only). Its working set per step is the
      f32 score block ``[H, block_q, block_k]`` plus one key block, so memory is O(T * H * D + H * block_q *
      block_k), never ``[T, T]``.
  """

  scale: float | None = None
  impl: str = "xla"
  block_q: int = 256
  block_k: int = 512

  def __post_init__(self):
    object.__setattr__(self, "impl", util.canonical_impl(self.impl))
    if self.scale is not None:
      try:
        scale = float(self.scale)
      except (TypeError, ValueError):
        raise ValueError(f"scale must be a float or None, got {self.scale!r}") from None
      if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be a finite float > 0 or None, got {self.scale}")
      object.__setattr__(self, "scale", scale)
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")

"""Causal varlen MLA prefill attention (non-absorbed, rope key shared by all heads)."""

from pallas_kernels.mla_prefill.api import mla_prefill_attention
from pallas_kernels.mla_prefill.config import MlaPrefillConfig

__all__ = ["MlaPrefillConfig", "mla_prefill_attention"]

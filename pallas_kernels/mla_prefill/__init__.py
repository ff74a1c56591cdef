"""Causal varlen MLA prefill attention (non-absorbed, rope key shared by all heads)."""

from pallas_kernels.mla_prefill.api import default_tuning, mla_prefill_attention
from pallas_kernels.mla_prefill.config import MlaPrefillConfig, MlaPrefillTuning

__all__ = ["MlaPrefillConfig", "MlaPrefillTuning", "default_tuning", "mla_prefill_attention"]

"""Kimi Delta Attention: chunked prefill, recurrent decode, their references."""

from pallas_kernels.kda.api import kda_decode, kda_prefill
from pallas_kernels.kda.config import KdaConfig

__all__ = ["KdaConfig", "kda_decode", "kda_prefill"]

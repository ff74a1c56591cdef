"""Kimi Delta Attention: chunked prefill, recurrent decode, their references (the short convolution in front of it:
``pallas_kernels.short_conv``)."""

from pallas_kernels.kda.api import default_tuning, kda_decode, kda_prefill
from pallas_kernels.kda.config import KdaConfig, KdaTuning
from pallas_kernels.kda.reference import (kda_chunk_reference, kda_decode_reference, kda_gate,
                                          kda_prefill_reference, kda_recurrent_reference)

__all__ = ["KdaConfig", "KdaTuning", "default_tuning", "kda_chunk_reference", "kda_decode", "kda_decode_reference",
           "kda_gate", "kda_prefill", "kda_prefill_reference", "kda_recurrent_reference"]

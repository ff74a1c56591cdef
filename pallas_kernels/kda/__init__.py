"""Kimi Delta Attention: chunked prefill, recurrent decode, the short convolution, their references."""

from pallas_kernels.kda.api import kda_decode, kda_prefill
from pallas_kernels.kda.config import KdaConfig
from pallas_kernels.kda.reference import (kda_chunk_reference, kda_decode_reference, kda_gate,
                                          kda_prefill_reference, kda_recurrent_reference)
from pallas_kernels.kda.short_conv import short_conv_prefill, short_conv_update

__all__ = ["KdaConfig", "kda_chunk_reference", "kda_decode", "kda_decode_reference", "kda_gate", "kda_prefill",
           "kda_prefill_reference", "kda_recurrent_reference", "short_conv_prefill", "short_conv_update"]

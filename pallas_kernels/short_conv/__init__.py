"""The short causal depthwise convolution of KDA's q|k|v projection, with a conv state pool (see README.md)."""

from pallas_kernels.short_conv.api import short_conv_prefill, short_conv_update
from pallas_kernels.short_conv.config import ShortConvConfig, ShortConvTuning, default_tuning
from pallas_kernels.short_conv.reference import short_conv_prefill_reference, short_conv_update_reference

__all__ = ["ShortConvConfig", "ShortConvTuning", "default_tuning", "short_conv_prefill", "short_conv_prefill_reference",
           "short_conv_update", "short_conv_update_reference"]

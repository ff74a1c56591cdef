"""Pallas Mosaic GPU kernels (Hopper) for Kimi-K3 style blocks, each beside a pure-JAX reference."""

from pallas_kernels.kda import KdaConfig, KdaTuning, kda_decode, kda_prefill
from pallas_kernels.mla import MlaDecodeConfig, MlaDecodeTuning, merge_partials, mla_decode
from pallas_kernels.mla_prefill import MlaPrefillConfig, MlaPrefillTuning, mla_prefill_attention
from pallas_kernels.short_conv import ShortConvConfig, ShortConvTuning, short_conv_prefill, short_conv_update

# Each op's ``default_tuning`` heuristic stays in its own package (``pallas_kernels.kda.default_tuning``, ...).
__all__ = ["KdaConfig", "KdaTuning", "MlaDecodeConfig", "MlaDecodeTuning", "MlaPrefillConfig", "MlaPrefillTuning",
           "ShortConvConfig", "ShortConvTuning", "kda_decode", "kda_prefill", "merge_partials", "mla_decode",
           "mla_prefill_attention", "short_conv_prefill", "short_conv_update"]

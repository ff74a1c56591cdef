"""Pallas Mosaic GPU kernels (Hopper) for Kimi-K3 style blocks, each beside a pure-JAX reference."""

from pallas_kernels.kda import KdaConfig, kda_decode, kda_prefill
from pallas_kernels.mla import MlaDecodeConfig, merge_partials, mla_decode
from pallas_kernels.mla_prefill import MlaPrefillConfig, mla_prefill_attention

__all__ = ["KdaConfig", "MlaDecodeConfig", "MlaPrefillConfig", "kda_decode", "kda_prefill", "merge_partials",
           "mla_decode", "mla_prefill_attention"]

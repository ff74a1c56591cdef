"""Pallas Mosaic GPU kernels (Hopper) for Kimi-K3 style blocks, each beside a pure-JAX reference."""

from pallas_kernels.kda import KdaConfig, kda_decode, kda_prefill
from pallas_kernels.mla import MlaDecodeConfig, merge_partials, mla_decode

__all__ = ["KdaConfig", "MlaDecodeConfig", "kda_decode", "kda_prefill", "merge_partials", "mla_decode"]

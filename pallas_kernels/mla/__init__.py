"""Split-K absorbed MLA decode over a paged latent cache, and the LSE merge."""

from pallas_kernels.mla.api import merge_partials, mla_decode
from pallas_kernels.mla.config import MlaDecodeConfig

__all__ = ["MlaDecodeConfig", "merge_partials", "mla_decode"]

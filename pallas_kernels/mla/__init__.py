"""Split-K absorbed MLA decode over a paged latent cache, and the LSE merge (see README.md)."""

from pallas_kernels.mla.api import default_tuning, merge_partials, mla_decode
from pallas_kernels.mla.config import MlaDecodeConfig, MlaDecodeTuning

__all__ = ["MlaDecodeConfig", "MlaDecodeTuning", "default_tuning", "merge_partials", "mla_decode"]

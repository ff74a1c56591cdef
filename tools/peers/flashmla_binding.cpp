// FlashMLA's dense-decode entry point, alone, as the extension `flash_mla.cuda`.
//
// FlashMLA's own csrc/api/api.cpp binds every kernel it has, so importing it needs the sparse, fp8 and sm100
// objects too. This binds only `dense_decode_fwd`, the one function flash_mla.flash_mla_with_kvcache calls for
// dense attention, under the name that Python wrapper expects; the host code behind it is FlashMLA's own header
// (csrc/api/dense_decode.h), included unchanged so that argument checks, scheduling and launches are theirs.
// Built by tools/peers/flashmla_setup.py; its sparse and prefill wrappers stay unusable (never benchmarked).

#include <pybind11/pybind11.h>

#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashMLA sm90a dense decode only (built by k3jax tools/peers/build_flashmla.sh)";
  m.def("dense_decode_fwd", &dense_attn_decode_interface,
        "(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, tile_scheduler_metadata, "
        "num_splits) -> (out, lse, tile_scheduler_metadata, num_splits)");
}

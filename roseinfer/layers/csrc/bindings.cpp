// The Python module of roseinfer's CPU kernels; each kernel lives in its own source file.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
  m.def("rms_norm", &rms_norm, "x / rms(x) * weight over the last dimension (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "in place: residual += x; x = rms_norm(residual) * weight (CPU)");
}

// The Python module of roseinfer's CPU kernels; each kernel lives in its own source file.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, bool quantize_x);
torch::Tensor q4_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins);
torch::Tensor q8_dequantize(torch::Tensor codes, torch::Tensor scales);
void rotary_embedding_(torch::Tensor x, torch::Tensor rotations);
void write_kv_(torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor k, torch::Tensor v);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor logits);
void bind_llama_decoder(pybind11::module& m);
bool quantizes_activations();
bool q8_float_gemm();
std::vector<std::string> panel_linear_dtypes();
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
  m.def("rms_norm", &rms_norm, "x / rms(x) * weight over the last dimension (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "in place: residual += x; x = rms_norm(residual) * weight (CPU)");
  m.def("rotary_embedding_", &rotary_embedding_, "in place: rotary embedding on adjacent pairs (CPU)");
  m.def("write_kv_", &write_kv_, "in place: the step's keys and values stored at their pool slots (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of each [gate, up] row (CPU)");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (CPU)");
  m.def("q4_linear", &q4_linear, "x @ w.T for 4-bit blocked weights (GGUF Q4_1 layout)");
  m.def("q8_linear", &q8_linear, "x @ w.T for 8-bit blocked weights (GGUF Q8_0 layout)", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("quantize_x") = true);
  m.def("q4_dequantize", &q4_dequantize, "the float weights of 4-bit blocks");
  m.def("q8_dequantize", &q8_dequantize, "the float weights of 8-bit blocks");
  m.def("q8_float_gemm", &q8_float_gemm,
        "whether q8_linear with float activations is a register-blocked matrix product from 32 rows (AVX-512 builds)");
  m.def("quantizes_activations", &quantizes_activations,
        "whether q4_linear and q8_linear (by default) quantize x to 8 bits per block of 32 (VNNI builds)");
  m.def("panel_linear_dtypes", &panel_linear_dtypes,
        "the weight dtypes this build's panel kernel takes (CPUs with AVX-512 but no AMX; elsewhere oneDNN is used)");
  m.def("pack_panels", &pack_panels, "an [N, K] float32 or bfloat16 weight in the panel kernel's layout");
  m.def("panel_linear", &panel_linear, "x @ w.T (+ bias) for a weight packed by pack_panels", pybind11::arg("x"),
        pybind11::arg("panels"), pybind11::arg("bias"), pybind11::arg("N"));
  bind_llama_decoder(m);
}

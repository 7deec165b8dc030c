// The Python module of roseinfer's CPU kernels; each kernel lives in its own source file.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding_(torch::Tensor x, torch::Tensor rotations);
void write_kv_(torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor k, torch::Tensor v);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor logits);
void bind_decoder_step(pybind11::module& m);
std::vector<std::string> panel_linear_dtypes();
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N);
std::vector<int64_t> gguf_types();
std::string gguf_kernel_isa();
int64_t gguf_row_bytes(int64_t type, int64_t K);
std::tuple<torch::Tensor, int64_t> gguf_pack(torch::Tensor raw, int64_t type, int64_t K, bool lasting);
torch::Tensor gguf_unpack(torch::Tensor packed, int64_t type, int64_t K);
torch::Tensor gguf_dequantize(torch::Tensor packed, int64_t type, int64_t K, c10::optional<torch::Tensor> ids,
                              c10::ScalarType dtype);
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias, bool exact);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV pool (CPU), optionally in a sliding window and soft-capped",
        pybind11::arg("q"), pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0);
  m.def("rms_norm", &rms_norm, "x / rms(x) * weight over the last dimension (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "in place: residual += x; x = rms_norm(residual) * weight (CPU)");
  m.def("rotary_embedding_", &rotary_embedding_, "in place: rotary embedding on adjacent pairs (CPU)");
  m.def("write_kv_", &write_kv_, "in place: the step's keys and values stored at their pool slots (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of each [gate, up] row (CPU)");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (CPU)");
  m.def("panel_linear_dtypes", &panel_linear_dtypes,
        "the weight dtypes this build's panel kernel takes (CPUs with AVX-512 but no AMX; elsewhere oneDNN is used)");
  m.def("pack_panels", &pack_panels, "an [N, K] float32 or bfloat16 weight in the panel kernel's layout");
  m.def("panel_linear", &panel_linear, "x @ w.T (+ bias) for a weight packed by pack_panels", pybind11::arg("x"),
        pybind11::arg("panels"), pybind11::arg("bias"), pybind11::arg("N"));
  m.def("gguf_types", &gguf_types, "the GGML block types the GGUF kernels run, as type ids");
  m.def("gguf_kernel_isa", &gguf_kernel_isa, "which dot products the GGUF kernels use for small batches");
  m.def("gguf_row_bytes", &gguf_row_bytes, "bytes of one packed row of K values of a GGML type");
  m.def("gguf_pack", &gguf_pack,
        "a GGUF tensor's rows in the kernels' layout, and that layout's kernel type id; lasting: a weight "
        "kept for the model's life, placed in 2 MiB pages",
        pybind11::arg("raw"), pybind11::arg("type"), pybind11::arg("K"), pybind11::arg("lasting") = false);
  m.def("gguf_unpack", &gguf_unpack, "packed rows back to the GGUF file's bytes");
  m.def("gguf_dequantize", &gguf_dequantize, "rows of a packed weight (all, or `ids`), exact",
        pybind11::arg("packed"), pybind11::arg("type"), pybind11::arg("K"), pybind11::arg("ids") = pybind11::none(),
        pybind11::arg("dtype") = torch::kFloat);
  m.def("gguf_linear", &gguf_linear, "x @ w.T (+ bias) for a weight in packed GGUF parts stacked along N",
        pybind11::arg("x"), pybind11::arg("parts"), pybind11::arg("types"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("exact") = false);
  bind_decoder_step(m);
}

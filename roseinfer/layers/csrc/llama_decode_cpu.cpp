// A whole decode step of a Llama-family model in one C++ call, on the CPU.
//
// Run op by op from Python, a 30-layer model's decode step is ~400 PyTorch operations, and at a
// few tokens per step their dispatch costs more than their arithmetic (about 5 ms of a token).
// Here the same step is plain loops over the activations, from the token embeddings the model
// looked up: per layer RMSNorm, the q/k/v projection (+ biases, Qwen2; + q/k RMSNorm, Qwen3),
// rotary on adjacent pairs, the new K/V written to their slots, paged attention
// (paged_attention_cpu.cpp), the output projection, the residual, RMSNorm, gate/up, SiLU * up,
// down, the residual; then the final norm and the LM head.
//
// The activations are float32, or bfloat16 for a bfloat16 model, rounded where the op-by-op path
// rounds them: every step calls the same row functions (cpu_kernels.h) and the same linear
// kernels, GGUF-typed blocks (gguf_linear_cpu.cpp, float32 activations) or weights packed in panels
// (panel_linear_cpu.cpp), so the two paths agree up to summation order (attention splits its sums
// as it does op by op; a Qwen3 q/k norm runs in PyTorch there).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using OptTensor = std::optional<torch::Tensor>;

template <typename T>
constexpr c10::ScalarType kDtype = std::is_same_v<T, float> ? torch::kFloat : torch::kBFloat16;

// One linear layer [N, K], as models/fused_decode.py describes it: (tensors, GGML types, bias,
// exact). Blocks: one packed weight per type, stacked along N (gguf_linear_cpu.cpp; float32
// activations); panels: (panels, panel_bias or nothing) from pack_panels with no types, weights of
// the activations' type.
using LinearSpec = std::tuple<std::vector<torch::Tensor>, std::vector<int64_t>, OptTensor, bool>;

struct DecodeLinear {
  std::vector<torch::Tensor> parts;  // blocks
  std::vector<int64_t> types;
  torch::Tensor bias;                // blocks: float32 or undefined
  bool exact = false;
  torch::Tensor panels, panel_bias;  // panels: panel_bias float32 over the packed columns, or undefined
  int64_t N = 0, K = 0;

  DecodeLinear() = default;
  DecodeLinear(const LinearSpec& spec, int64_t n, int64_t k, c10::ScalarType activations, const char* name)
      : N(n), K(k) {
    const auto& [tensors, ggml_types, bias_, exact_] = spec;
    TORCH_CHECK(!tensors.empty(), name, ": no weight");
    if (ggml_types.empty()) {
      panels = tensors[0].contiguous();
      const auto type = panels.scalar_type();
      TORCH_CHECK(type == activations, name, ": ", type, " panels in a ", activations, " model");
      TORCH_CHECK(panels.dim() == 4 && panels.size(0) * panels.size(2) >= N && panels.size(1) * panels.size(3) == K,
                  name, ": the packed panels are not of a [", N, ", ", K, "] weight");
      if (tensors.size() > 1 && tensors[1].defined()) {
        panel_bias = tensors[1].contiguous();
        TORCH_CHECK(panel_bias.scalar_type() == torch::kFloat && panel_bias.numel() == panels.size(0) * panels.size(2),
                    name, ": the panel bias must be float32 over the packed columns");
      }
      return;
    }
    TORCH_CHECK(tensors.size() == ggml_types.size(), name, ": one GGML type per part");
    int64_t rows = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      roseinfer::gguf_check(tensors[i], ggml_types[i], K);
      parts.push_back(tensors[i]);
      rows += tensors[i].size(0);
    }
    TORCH_CHECK(rows == N, name, ": the parts hold ", rows, " rows, not ", N);
    types = ggml_types;
    exact = exact_;
    if (bias_) bias = bias_->contiguous().to(torch::kFloat);
  }

  // out [M, N] = x [M, K] @ w.T (+ bias). scratch: float32 buffers for a bfloat16 model's blocks.
  template <typename T>
  void apply(const T* x, int64_t M, T* out, std::vector<float>& x_scratch, std::vector<float>& out_scratch) const {
    if (panels.defined()) {
      roseinfer::panel_matmul(x, M, K, panels.data_ptr<T>(), panels.size(0),
                              panel_bias.defined() ? panel_bias.data_ptr<float>() : nullptr, N, out);
      return;
    }
    const float* xf;
    float* of;
    if constexpr (std::is_same_v<T, float>) {
      xf = x;
      of = out;
    } else {
      x_scratch.resize(M * K);
      out_scratch.resize(M * N);
      for (int64_t i = 0; i < M * K; ++i) x_scratch[i] = roseinfer::load_float(x + i);
      xf = x_scratch.data();
      of = out_scratch.data();
    }
    int64_t first = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      roseinfer::gguf_matmul(static_cast<int>(types[i]), xf, M, K, parts[i].data_ptr<uint8_t>(), parts[i].size(0),
                             of + first, N, exact);
      first += parts[i].size(0);
    }
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float value = of[m * N + n] + (b ? b[n] : 0.0f);
        roseinfer::store_float(out + m * N + n, value);
      }
  }
};

struct Layer {
  torch::Tensor attn_norm, q_norm, k_norm, mlp_norm;  // q_norm, k_norm: Qwen3 only
  DecodeLinear qkv, o, gate_up, down;
};

}  // namespace

class LlamaDecoder {
 public:
  // vocab: the LM head's rows (this rank's). final_norm's dtype is the activations' (float32 or
  // bfloat16); the layers' tensors: see LlamaDecoder in models/fused_decode.py.
  // (attn_norm, q_norm or None, k_norm or None, mlp_norm, qkv, o, gate_up, down): see models/fused_decode.py.
  using LayerSpec = std::tuple<torch::Tensor, OptTensor, OptTensor, torch::Tensor, LinearSpec, LinearSpec, LinearSpec,
                               LinearSpec>;

  LlamaDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, int64_t vocab,
               double eps, torch::Tensor final_norm, LinearSpec head, std::vector<LayerSpec> layers,
               int64_t sliding_window)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        window_(sliding_window), eps_(static_cast<float>(eps)), dtype_(final_norm.scalar_type()) {
    TORCH_CHECK(dtype_ == torch::kFloat || dtype_ == torch::kBFloat16, "activations must be float32 or bfloat16, not ",
                dtype_);
    final_norm_ = final_norm.contiguous();
    const int64_t qkv_size = (heads + 2 * kv_heads) * head_dim;
    head_ = DecodeLinear(head, vocab, hidden, dtype_, "the LM head");
    auto norm = [&](const torch::Tensor& t) { return t.contiguous().to(dtype_); };
    for (const auto& spec : layers) {
      const auto& [attn_norm, q_norm, k_norm, mlp_norm, qkv, o, gate_up, down] = spec;
      Layer layer;
      layer.attn_norm = norm(attn_norm);
      if (q_norm) layer.q_norm = norm(*q_norm);
      if (k_norm) layer.k_norm = norm(*k_norm);
      layer.mlp_norm = norm(mlp_norm);
      layer.qkv = DecodeLinear(qkv, qkv_size, hidden, dtype_, "qkv_proj");
      layer.o = DecodeLinear(o, hidden, heads * head_dim, dtype_, "o_proj");
      layer.gate_up = DecodeLinear(gate_up, 2 * intermediate, hidden, dtype_, "gate_up_proj");
      layer.down = DecodeLinear(down, hidden, intermediate, dtype_, "down_proj");
      layers_.push_back(std::move(layer));
    }
  }

  // embedded [B, hidden] of the activations' dtype: the rows' token embeddings; slot_mapping,
  // context_lens [B] int64; rotations [B, ..., head_dim / 2, 2] float32: (cos, sin) of each row's
  // rotary angles, as models/rotary.py computes them; block_tables [B, max_blocks] int64;
  // kv_caches: per layer [2, blocks, block_size, kv_heads, head_dim] (float32, 16-bit or q8_0 for a
  // float32 model; bfloat16 or q8_0 for a bfloat16 one). -> logits [B, vocab], float32 from blocks,
  // else of the activations' dtype (as the op-by-op LM head returns them).
  torch::Tensor forward(torch::Tensor embedded, torch::Tensor rotations, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens, std::vector<torch::Tensor> kv_caches) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV pool per layer");
    embedded = embedded.contiguous();
    TORCH_CHECK(embedded.scalar_type() == dtype_ && embedded.dim() == 2 && embedded.size(1) == hidden_,
                "embedded: [B, hidden] of the model's dtype (", dtype_, ")");
    rotations = rotations.contiguous();
    TORCH_CHECK(rotations.scalar_type() == torch::kFloat && rotations.numel() == embedded.size(0) * head_dim_,
                "rotations: [B, head_dim / 2, 2] float32");
    Step step{rotations.data_ptr<float>(), slot_mapping.contiguous(), block_tables.contiguous(),
              context_lens.contiguous()};
    if (dtype_ == torch::kFloat) return run<float>(embedded, step, kv_caches);
    return run<c10::BFloat16>(embedded, step, kv_caches);
  }

 private:
  struct Step {
    const float* rotations;
    torch::Tensor slots, tables, lens;
  };

  template <typename T>
  torch::Tensor run(const torch::Tensor& embedded, const Step& step, const std::vector<torch::Tensor>& kv_caches) {
    const int64_t B = embedded.size(0), H = hidden_, D = head_dim_, I = intermediate_;
    const int64_t q_size = heads_ * D, kv_size = kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
    const T* rows = embedded.data_ptr<T>();
    std::vector<T> residual(rows, rows + B * H), normed(B * H), qkv(B * qkv_size), attn(B * q_size),
        mlp(B * 2 * I), act(B * I), out(B * H);
    std::vector<float> xs, os;  // float32 scratch for a bfloat16 model's blocked layers
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      if (l == 0) {
        roseinfer::norm_rows_in_parallel(residual.data(), layer.attn_norm.data_ptr<T>(), normed.data(), B, H, eps_);
      } else {
        roseinfer::add_and_norm_rows_in_parallel(residual.data(), out.data(), layer.attn_norm.data_ptr<T>(),
                                                 normed.data(), B, H, eps_);
      }
      layer.qkv.apply(normed.data(), B, qkv.data(), xs, os);
      at::parallel_for(0, B, roseinfer::kNormRowsPerTask, [&](int64_t begin, int64_t end) {
        std::vector<T> copy(layer.q_norm.defined() ? q_size : 0);
        for (int64_t b = begin; b < end; ++b) {
          T* q = qkv.data() + b * qkv_size;
          T* k = q + q_size;
          if (layer.q_norm.defined()) {  // norm_rows does not work in place: through a copy
            std::memcpy(copy.data(), q, q_size * sizeof(T));
            roseinfer::norm_rows<T>(copy.data(), layer.q_norm.data_ptr<T>(), q, 0, heads_, D, eps_);
            std::memcpy(copy.data(), k, kv_size * sizeof(T));
            roseinfer::norm_rows<T>(copy.data(), layer.k_norm.data_ptr<T>(), k, 0, kv_heads_, D, eps_);
          }
          roseinfer::rotate_heads(q, heads_, D, step.rotations + b * D);
          roseinfer::rotate_heads(k, kv_heads_, D, step.rotations + b * D);
        }
      });
      attend(qkv.data(), attn.data(), B, kv_caches[l], step);
      layer.o.apply(attn.data(), B, out.data(), xs, os);
      roseinfer::add_and_norm_rows_in_parallel(residual.data(), out.data(), layer.mlp_norm.data_ptr<T>(),
                                               normed.data(), B, H, eps_);
      layer.gate_up.apply(normed.data(), B, mlp.data(), xs, os);
      roseinfer::silu_and_mul_in_parallel(mlp.data(), act.data(), I, B);
      layer.down.apply(act.data(), B, out.data(), xs, os);
    }
    roseinfer::add_and_norm_rows_in_parallel(residual.data(), out.data(), final_norm_.data_ptr<T>(), normed.data(), B,
                                             H, eps_);
    // Logits of the activations' dtype, as the op-by-op LM head returns them.
    torch::Tensor logits = torch::empty({B, head_.N}, torch::dtype(kDtype<T>));
    head_.apply(normed.data(), B, logits.data_ptr<T>(), xs, os);
    return logits;
  }

  // Each row's new key and value written to its slot, then its attention over the pool: qkv [B,
  // q | k | v] -> out [B, q_size].
  template <typename T>
  void attend(const T* qkv, T* out, int64_t B, const torch::Tensor& pool, const Step& step) const {
    const int64_t D = head_dim_, q_size = heads_ * D, kv_size = kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
    const int64_t* slots = step.slots.data_ptr<int64_t>();
    const int64_t* tables = step.tables.data_ptr<int64_t>();
    const int64_t* lens = step.lens.data_ptr<int64_t>();
    const int64_t max_blocks = step.tables.size(1), block_size = pool.size(2), pool_half = pool.numel() / 2;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    auto run = [&](auto* keys) {  // keys, then values, in one pool
      using cache_t = std::remove_pointer_t<decltype(keys)>;
      const int64_t row = roseinfer::kv_row_elements<cache_t>(D);
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, work;
        for (int64_t b = begin; b < end; ++b) {
          // A row's new slot is in a block of its own sequence (shared prefix blocks are full),
          // so each row can write its key and value and attend in the same task.
          const T* k = qkv + b * qkv_size + q_size;
          const T* v = k + kv_size;
          for (int64_t h = 0; h < kv_heads_; ++h) {
            roseinfer::store_kv_row(keys + (slots[b] * kv_heads_ + h) * row, k + h * D, D);
            roseinfer::store_kv_row(keys + pool_half + (slots[b] * kv_heads_ + h) * row, v + h * D, D);
          }
          roseinfer::paged_attention_sequence<T, cache_t>(qkv + b * qkv_size, keys, keys + pool_half,
                                                          tables + b * max_blocks, lens[b], heads_, kv_heads_,
                                                          block_size, D, scale, out + b * q_size, scores, work,
                                                          window_);
        }
      });
    };
    // The pool is the model's dtype, or another with --kv-cache-dtype (a bfloat16 model: q8_0 only).
    const auto type = pool.scalar_type();
    if (type == torch::kChar) return run(pool.data_ptr<int8_t>());  // q8_0
    if (type == torch::kBFloat16) return run(pool.data_ptr<c10::BFloat16>());
    if constexpr (std::is_same_v<T, float>) {
      if (type == torch::kFloat) return run(pool.data_ptr<float>());
      if (type == torch::kHalf) return run(pool.data_ptr<c10::Half>());
    }
    TORCH_CHECK(false, "a ", kDtype<T>, " model's KV pool cannot be ", type);
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  int64_t window_;  // every layer's sliding window (Mistral, Qwen2), 0: none
  float eps_;
  c10::ScalarType dtype_;
  torch::Tensor final_norm_;
  DecodeLinear head_;
  std::vector<Layer> layers_;
};

void bind_llama_decoder(pybind11::module& m) {
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, LinearSpec,
                          std::vector<LlamaDecoder::LayerSpec>, int64_t>())
      .def("forward", &LlamaDecoder::forward, "one decode step: token embeddings -> logits (see the source's header)");
}

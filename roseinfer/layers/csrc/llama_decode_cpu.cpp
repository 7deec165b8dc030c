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
// kernels, blocked 4/8-bit weights (quant_linear_cpu.cpp, float32 activations) or weights packed
// in panels (panel_linear_cpu.cpp), so the two paths agree up to summation order (the blocked
// kernels and attention split their sums as they do op by op; a Qwen3 q/k norm runs in PyTorch there).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using OptTensor = std::optional<torch::Tensor>;

template <typename T>
constexpr c10::ScalarType kDtype = std::is_same_v<T, float> ? torch::kFloat : torch::kBFloat16;

// One linear layer [N, K]: 4-bit or 8-bit blocks (float32 activations), or float32 / bfloat16
// weights packed in panels (activations of the weight's type).
struct DecodeLinear {
  torch::Tensor codes, scales, mins, bias;  // blocks: mins for 4-bit only; bias float32 or undefined
  torch::Tensor panels, panel_bias;         // panels: panel_bias float32 over the packed columns, or undefined
  int64_t N = 0, K = 0;
  bool q4 = false;
  bool quantize_x = true;  // 8-bit blocks: see q8_matmul (the head keeps float activations)

  DecodeLinear() = default;
  // (codes, scales, mins, bias) of blocks, or (panels, panel_bias, None, None) from pack_panels.
  DecodeLinear(const std::vector<OptTensor>& t, int64_t n, int64_t k, c10::ScalarType activations, const char* name)
      : N(n), K(k) {
    TORCH_CHECK(t.size() == 4 && t[0] && t[0]->defined(), name, ": (codes, scales, mins, bias) or (panels, bias, None, None)");
    const auto type = t[0]->scalar_type();
    if (type == torch::kFloat || type == torch::kBFloat16) {
      panels = t[0]->contiguous();
      TORCH_CHECK(type == activations, name, ": ", type, " panels in a ", activations, " model");
      TORCH_CHECK(panels.dim() == 4 && panels.size(0) * panels.size(2) >= N && panels.size(1) * panels.size(3) == K,
                  name, ": the packed panels are not of a [", N, ", ", K, "] weight");
      if (t[1] && t[1]->defined()) {
        panel_bias = t[1]->contiguous();
        TORCH_CHECK(panel_bias.scalar_type() == torch::kFloat && panel_bias.numel() == panels.size(0) * panels.size(2),
                    name, ": the panel bias must be float32 over the packed columns");
      }
      return;
    }
    TORCH_CHECK(activations == torch::kFloat, name, ": blocked weights take float32 activations");
    TORCH_CHECK(t[1], name, ": blocks need their scales");
    codes = t[0]->contiguous();
    scales = t[1]->contiguous().to(torch::kFloat);
    q4 = type == torch::kUInt8;
    TORCH_CHECK(q4 || type == torch::kChar, name, ": codes must be uint8 (4-bit) or int8 (8-bit)");
    TORCH_CHECK(codes.size(0) == N && (q4 ? codes.size(1) * 2 : codes.size(1)) == K, name,
                ": the codes are not of a [", N, ", ", K, "] weight");
    if (q4) {
      TORCH_CHECK(t[2], name, ": 4-bit blocks need their minimums");
      mins = t[2]->contiguous().to(torch::kFloat);
    }
    if (t[3]) bias = t[3]->contiguous().to(torch::kFloat);
  }

  // out [M, N] = x [M, K] @ w.T (+ bias). xsums: scratch (4-bit blocks).
  template <typename T>
  void apply(const T* x, int64_t M, T* out, std::vector<float>& xsums) const {
    if (panels.defined()) {
      roseinfer::panel_matmul(x, M, K, panels.data_ptr<T>(), panels.size(0),
                              panel_bias.defined() ? panel_bias.data_ptr<float>() : nullptr, N, out);
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (q4) {
        xsums.resize(M * K / 32);
        roseinfer::q4_matmul(x, M, K, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), N,
                             xsums.data(), out);
      } else {
        roseinfer::q8_matmul(x, M, K, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), N, out, quantize_x);
      }
      if (bias.defined()) {
        const float* b = bias.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) out[m * N + n] += b[n];
      }
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
  LlamaDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, int64_t vocab,
               double eps, torch::Tensor final_norm, std::vector<OptTensor> head,
               std::vector<std::vector<OptTensor>> layers)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(static_cast<float>(eps)), dtype_(final_norm.scalar_type()) {
    TORCH_CHECK(dtype_ == torch::kFloat || dtype_ == torch::kBFloat16, "activations must be float32 or bfloat16, not ",
                dtype_);
    final_norm_ = final_norm.contiguous();
    const int64_t qkv_size = (heads + 2 * kv_heads) * head_dim;
    head_ = DecodeLinear(head, vocab, hidden, dtype_, "the LM head");
    head_.quantize_x = false;  // bound by reading its weights: exact activations cost nothing here
    auto norm = [&](const OptTensor& t) { return t->contiguous().to(dtype_); };
    for (auto& t : layers) {
      TORCH_CHECK(t.size() == 20, "a layer is 20 tensors (see LlamaDecoder in models/fused_decode.py)");
      Layer layer;
      layer.attn_norm = norm(t[0]);
      layer.qkv = DecodeLinear({t[1], t[2], t[3], t[4]}, qkv_size, hidden, dtype_, "qkv_proj");
      if (t[5]) layer.q_norm = norm(t[5]);
      if (t[6]) layer.k_norm = norm(t[6]);
      layer.o = DecodeLinear({t[7], t[8], t[9], t[10]}, hidden, heads * head_dim, dtype_, "o_proj");
      layer.mlp_norm = norm(t[11]);
      layer.gate_up = DecodeLinear({t[12], t[13], t[14], t[15]}, 2 * intermediate, hidden, dtype_, "gate_up_proj");
      layer.down = DecodeLinear({t[16], t[17], t[18], t[19]}, hidden, intermediate, dtype_, "down_proj");
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
    std::vector<float> xsums;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      if (l == 0) {
        roseinfer::norm_rows_in_parallel(residual.data(), layer.attn_norm.data_ptr<T>(), normed.data(), B, H, eps_);
      } else {
        roseinfer::add_and_norm_rows_in_parallel(residual.data(), out.data(), layer.attn_norm.data_ptr<T>(),
                                                 normed.data(), B, H, eps_);
      }
      layer.qkv.apply(normed.data(), B, qkv.data(), xsums);
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
      layer.o.apply(attn.data(), B, out.data(), xsums);
      roseinfer::add_and_norm_rows_in_parallel(residual.data(), out.data(), layer.mlp_norm.data_ptr<T>(),
                                               normed.data(), B, H, eps_);
      layer.gate_up.apply(normed.data(), B, mlp.data(), xsums);
      roseinfer::silu_and_mul_in_parallel(mlp.data(), act.data(), I, B);
      layer.down.apply(act.data(), B, out.data(), xsums);
    }
    roseinfer::add_and_norm_rows_in_parallel(residual.data(), out.data(), final_norm_.data_ptr<T>(), normed.data(), B,
                                             H, eps_);
    if (head_.panels.defined()) {
      torch::Tensor logits = torch::empty({B, head_.N}, torch::dtype(kDtype<T>));
      head_.apply(normed.data(), B, logits.data_ptr<T>(), xsums);
      return logits;
    }
    auto logits = torch::empty({B, head_.N}, torch::dtype(torch::kFloat));
    if constexpr (std::is_same_v<T, float>) head_.apply(normed.data(), B, logits.data_ptr<float>(), xsums);
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
                                                          block_size, D, scale, out + b * q_size, scores, work);
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
  float eps_;
  c10::ScalarType dtype_;
  torch::Tensor final_norm_;
  DecodeLinear head_;
  std::vector<Layer> layers_;
};

void bind_llama_decoder(pybind11::module& m) {
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor,
                          std::vector<OptTensor>, std::vector<std::vector<OptTensor>>>())
      .def("forward", &LlamaDecoder::forward, "one decode step: token embeddings -> logits (see the source's header)");
}

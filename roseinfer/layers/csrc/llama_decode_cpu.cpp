// A whole decode step of a Llama-family model in one C++ call, for small batches on the CPU.
//
// Run op by op from Python, a 30-layer model's decode step is ~400 PyTorch operations, and at a
// few tokens per step their dispatch costs more than their arithmetic (about 5 ms of a token).
// Here the same step is plain loops over float32 activations, from the token embeddings the model
// looked up: per layer RMSNorm, the blocked q/k/v projection (+ biases, Qwen2; + q/k RMSNorm,
// Qwen3), rotary on adjacent pairs, the new K/V written to their slots, paged attention
// (paged_attention_cpu.cpp), the output projection, the residual, RMSNorm, gate/up, SiLU * up, down, the residual; then the final norm
// and the LM head. The linear layers are the blocked kernels of quant_linear_cpu.cpp. Every
// number is computed as the op-by-op path computes it, up to summation order.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using OptTensor = std::optional<torch::Tensor>;

struct BlockedLinear {
  torch::Tensor codes, scales, mins, bias;  // mins: q4 only; bias may be undefined
  int64_t N = 0, K = 0;
  bool q4 = false;
  bool quantize_x = true;  // 8-bit blocks: see q8_matmul (the head keeps float activations)

  BlockedLinear() = default;
  BlockedLinear(const OptTensor& c, const OptTensor& s, const OptTensor& m, const OptTensor& b) {
    TORCH_CHECK(c && s, "a linear layer needs codes and scales");
    codes = c->contiguous();
    scales = s->contiguous().to(torch::kFloat);
    q4 = codes.scalar_type() == torch::kUInt8;
    TORCH_CHECK(q4 || codes.scalar_type() == torch::kChar, "codes must be uint8 (4-bit) or int8 (8-bit)");
    N = codes.size(0);
    K = q4 ? codes.size(1) * 2 : codes.size(1);
    if (q4) {
      TORCH_CHECK(m.has_value(), "4-bit blocks need their minimums");
      mins = m->contiguous().to(torch::kFloat);
    }
    if (b) bias = b->contiguous().to(torch::kFloat);
  }

  void apply(const float* x, int64_t M, float* out, std::vector<float>& xsums) const {
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
};

struct Layer {
  torch::Tensor attn_norm, q_norm, k_norm, mlp_norm;  // q_norm, k_norm: Qwen3 only
  BlockedLinear qkv, o, gate_up, down;
};

void rms_norm_rows(const float* in, const float* weight, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = in + r * dim;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; ++d) squares += x[d] * x[d];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
    float* y = out + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) y[d] = x[d] * inv * weight[d];
  }
}

}  // namespace

class LlamaDecoder {
 public:
  LlamaDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               torch::Tensor final_norm, std::vector<OptTensor> head,
               std::vector<std::vector<OptTensor>> layers)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(static_cast<float>(eps)) {
    final_norm_ = final_norm.contiguous().to(torch::kFloat);
    TORCH_CHECK(head.size() == 4, "head: codes, scales, mins, bias");
    head_ = BlockedLinear(head[0], head[1], head[2], head[3]);
    head_.quantize_x = false;  // bound by reading its weights: exact activations cost nothing here
    for (auto& t : layers) {
      TORCH_CHECK(t.size() == 20, "a layer is 20 tensors (see LlamaDecoder in models/fused_decode.py)");
      Layer layer;
      layer.attn_norm = t[0]->contiguous().to(torch::kFloat);
      layer.qkv = BlockedLinear(t[1], t[2], t[3], t[4]);
      if (t[5]) layer.q_norm = t[5]->contiguous().to(torch::kFloat);
      if (t[6]) layer.k_norm = t[6]->contiguous().to(torch::kFloat);
      layer.o = BlockedLinear(t[7], t[8], t[9], t[10]);
      layer.mlp_norm = t[11]->contiguous().to(torch::kFloat);
      layer.gate_up = BlockedLinear(t[12], t[13], t[14], t[15]);
      layer.down = BlockedLinear(t[16], t[17], t[18], t[19]);
      layers_.push_back(std::move(layer));
    }
  }

  // embedded [B, hidden] float32: the rows' token embeddings; slot_mapping, context_lens [B] int64;
  // rotations [B, ..., head_dim / 2, 2] float32: (cos, sin) of each row's rotary angles, as
  // models/rotary.py computes them; block_tables [B, max_blocks] int64; kv_caches: per layer
  // [2, blocks, block_size, kv_heads, head_dim], float32 or 16-bit. -> logits [B, V].
  torch::Tensor forward(torch::Tensor embedded, torch::Tensor rotations, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens, std::vector<torch::Tensor> kv_caches) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV pool per layer");
    const int64_t B = embedded.size(0), H = hidden_, D = head_dim_;
    const int64_t q_size = heads_ * D, kv_size = kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
    embedded = embedded.contiguous();
    TORCH_CHECK(embedded.scalar_type() == torch::kFloat && embedded.dim() == 2 && embedded.size(1) == H,
                "embedded: [B, hidden] float32");
    rotations = rotations.contiguous();
    TORCH_CHECK(rotations.scalar_type() == torch::kFloat && rotations.numel() == B * D,
                "rotations: [B, head_dim / 2, 2] float32");
    slot_mapping = slot_mapping.contiguous();
    block_tables = block_tables.contiguous();
    context_lens = context_lens.contiguous();
    const float* rot = rotations.data_ptr<float>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t max_blocks = block_tables.size(1);

    const float* rows = embedded.data_ptr<float>();
    std::vector<float> residual(rows, rows + B * H), normed(B * H), qkv(B * qkv_size), attn(B * q_size),
        mlp(B * 2 * intermediate_), act(B * intermediate_), out(B * H), xsums;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      rms_norm_rows(residual.data(), layer.attn_norm.data_ptr<float>(), normed.data(), B, H, eps_);
      layer.qkv.apply(normed.data(), B, qkv.data(), xsums);
      const int64_t pool_half = kv_caches[l].numel() / 2;  // keys, then values
      for (int64_t b = 0; b < B; ++b) {
        float* q = qkv.data() + b * qkv_size;
        float* k = q + q_size;
        if (layer.q_norm.defined()) {
          rms_norm_rows(q, layer.q_norm.data_ptr<float>(), q, heads_, D, eps_);
          rms_norm_rows(k, layer.k_norm.data_ptr<float>(), k, kv_heads_, D, eps_);
        }
        roseinfer::rotate_heads(q, heads_, D, rot + b * D);
        roseinfer::rotate_heads(k, kv_heads_, D, rot + b * D);
      }
      // The pool is float32, or 16-bit or q8_0 with --kv-cache-dtype.
      auto attend = [&](auto* pool) {
        using scalar_t = std::remove_pointer_t<decltype(pool)>;
        for (int64_t b = 0; b < B; ++b) {
          const float* k = qkv.data() + b * qkv_size + q_size;
          const float* v = k + kv_size;
          const int64_t row = roseinfer::kv_row_elements<scalar_t>(D);
          for (int64_t h = 0; h < kv_heads_; ++h) {
            roseinfer::store_kv_row(pool + (slots[b] * kv_heads_ + h) * row, k + h * D, D);
            roseinfer::store_kv_row(pool + pool_half + (slots[b] * kv_heads_ + h) * row, v + h * D, D);
          }
        }
        at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scores, work;
          for (int64_t b = begin; b < end; ++b)
            roseinfer::paged_attention_sequence<scalar_t>(
                qkv.data() + b * qkv_size, pool, pool + pool_half, tables + b * max_blocks, lens[b], heads_, kv_heads_,
                kv_caches[l].size(2), D, scale, attn.data() + b * q_size, scores, work);
        });
      };
      switch (kv_caches[l].scalar_type()) {
        case torch::kFloat: attend(kv_caches[l].data_ptr<float>()); break;
        case torch::kBFloat16: attend(kv_caches[l].data_ptr<c10::BFloat16>()); break;
        case torch::kHalf: attend(kv_caches[l].data_ptr<c10::Half>()); break;
        case torch::kChar: attend(kv_caches[l].data_ptr<int8_t>()); break;  // q8_0
        default: TORCH_CHECK(false, "the KV pool must be float32, bfloat16, float16 or int8 (q8_0)");
      }
      layer.o.apply(attn.data(), B, out.data(), xsums);
      for (int64_t i = 0; i < B * H; ++i) residual[i] += out[i];
      rms_norm_rows(residual.data(), layer.mlp_norm.data_ptr<float>(), normed.data(), B, H, eps_);
      layer.gate_up.apply(normed.data(), B, mlp.data(), xsums);
      const int64_t I = intermediate_;
      for (int64_t b = 0; b < B; ++b) {
        const float* gate = mlp.data() + b * 2 * I;
        const float* up = gate + I;
        float* a = act.data() + b * I;
        for (int64_t i = 0; i < I; ++i) a[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
      }
      layer.down.apply(act.data(), B, out.data(), xsums);
      for (int64_t i = 0; i < B * H; ++i) residual[i] += out[i];
    }
    rms_norm_rows(residual.data(), final_norm_.data_ptr<float>(), normed.data(), B, H, eps_);
    auto logits = torch::empty({B, head_.N}, torch::dtype(torch::kFloat));
    head_.apply(normed.data(), B, logits.data_ptr<float>(), xsums);
    return logits;
  }

 private:
  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  float eps_;
  torch::Tensor final_norm_;
  BlockedLinear head_;
  std::vector<Layer> layers_;
};

void bind_llama_decoder(pybind11::module& m) {
  pybind11::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor,
                          std::vector<OptTensor>, std::vector<std::vector<OptTensor>>>())
      .def("forward", &LlamaDecoder::forward, "one decode step: token ids -> logits (see the source's header)");
}

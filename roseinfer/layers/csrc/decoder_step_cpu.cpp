// A whole decode step of a pre-norm decoder (Llama, Qwen, Mistral, Gemma 2/3, mixtures of experts)
// in one C++ call, on the CPU.
//
// Run op by op from Python, a 30-layer model's decode step is ~400 PyTorch operations, and at a
// few tokens per step their dispatch costs more than their arithmetic (about 5 ms of a token).
// Here the same step is plain loops over the activations, from the token embeddings the model
// looked up: per layer RMSNorm, the q/k/v projection (+ biases, Qwen2; + q/k RMSNorm, Qwen3),
// rotary on adjacent pairs, the new K/V written to their slots, paged attention
// (paged_attention_cpu.cpp), the output projection, the residual, RMSNorm, gate/up, SiLU * up,
// down, the residual; then the final norm and the LM head.
//
// A layer is built from the features its description names (models/fused_decode.py:
// DecodeLayerSpec), one setter each, not from flags of a family: add_layer gives the attention
// core (norms, q/k/v and output projections, scale, rotary table); then, where the layer has them,
// a KV cache group, a sliding window, a soft-cap of the scores, norms of q and k (per head, or over
// all heads), norms of the attention's and the MLP's outputs, and its MLP: gated (SwiGLU or GeGLU,
// its own width) or a mixture of experts (each row's top-k experts run over the rows that chose
// them; on GGUF blocks all of a step's chosen experts' products in one parallel region). Per model:
// a factor of the embeddings.
//
// The activations are float32, or bfloat16 for a bfloat16 model, rounded where the op-by-op path
// rounds them: every step calls the same row functions (cpu_kernels.h) and the same linear
// kernels, GGUF-typed blocks (gguf_linear_cpu.cpp, float32 activations) or weights packed in panels
// (panel_linear_cpu.cpp), so the two paths agree up to summation order (attention splits its sums
// as it does op by op; a Qwen3 or Gemma 3 q/k norm runs in PyTorch there).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
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

  // Whether the layer is GGUF blocks with no bias: products gguf_matmul_group can run.
  bool plain_blocks() const { return !panels.defined() && !bias.defined(); }

  // The products of out [M, N] (rows ldo apart) = x [M, K] @ w.T, one per part, appended to
  // `products` (plain_blocks() layers only).
  void add_products(const float* x, int64_t M, float* out, int64_t ldo,
                    std::vector<roseinfer::GgufProduct>& products) const {
    int64_t first = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      products.push_back({static_cast<int>(types[i]), x, M, K, parts[i].data_ptr<uint8_t>(), parts[i].size(0),
                          out + first, ldo});
      first += parts[i].size(0);
    }
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

// A mixture-of-experts MLP (models/moe.py: SparseMoeBlock): a router over the experts, each row's
// top-k experts (their softmax probabilities, renormalised to sum to 1 where the model does), each
// a SwiGLU FFN; plus, for Qwen2-MoE, a shared expert behind a sigmoid gate.
struct SparseMlp {
  bool grouped = false;  // every expert plain GGUF blocks, alike in exactness: one product group a step
  DecodeLinear router;                     // [experts, hidden]
  std::vector<DecodeLinear> gate_up, down;  // per expert: [2 * intermediate, hidden], [hidden, intermediate]
  int64_t top_k = 0, intermediate = 0;
  bool normalize = false;
  DecodeLinear shared_gate_up, shared_down, shared_gate;  // shared_gate: [1, hidden]
  int64_t shared_intermediate = 0;                         // 0: no shared expert
};

// A gated MLP: down(activation(gate) * up), gate and up rows in one matrix.
struct GatedMlp {
  DecodeLinear gate_up, down;  // [2 * intermediate, hidden], [hidden, intermediate]
  int64_t intermediate = 0;
  bool gelu = false;  // GeGLU (GELU, tanh approximation) rather than SwiGLU
};

// RMSNorms of q and k before rotary: one per head, or one over all of q (and of k).
struct QkNorm {
  torch::Tensor q, k;
  bool over_all_heads = false;
};

// RMSNorms of the attention's and the MLP's outputs before their residual adds.
struct PostNorms {
  torch::Tensor attention, mlp;
};

struct Attention {
  DecodeLinear qkv, o;
  float scale = 0.0f;    // of the scores
  int64_t rotary = 0;    // which of the step's rotation tables q and k rotate with
  int64_t kv_group = 0;  // which of the step's block tables / slot mappings its pool is read through
  int64_t window = 0;    // sliding window, 0: none
  float softcap = 0.0f;  // of the scores, 0: none
  std::optional<QkNorm> qk_norm;
};

struct Layer {
  torch::Tensor input_norm, mlp_norm;
  Attention attention;
  std::optional<PostNorms> post_norms;
  std::variant<std::monostate, GatedMlp, SparseMlp> mlp;  // monostate: not given yet
};

// Each row's chosen experts and their weights (as the activations' dtype rounds them): softmax over
// every expert's router logit in float32, the top k (ties to the lower index), renormalised where
// the model does. -> per expert, its (row, weight) pairs in row order.
template <typename T>
std::vector<std::vector<std::pair<int64_t, T>>> route(const T* logits, int64_t B, int64_t E, int64_t top_k,
                                                     bool normalize) {
  std::vector<std::vector<std::pair<int64_t, T>>> rows_of(E);
  std::vector<float> probs(E);
  std::vector<int64_t> order(E);
  for (int64_t b = 0; b < B; ++b) {
    const T* row = logits + b * E;
    float top = roseinfer::load_float(row), sum = 0.0f;  // (-ffast-math: no infinities)
    for (int64_t e = 1; e < E; ++e) top = std::max(top, roseinfer::load_float(row + e));
    for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(roseinfer::load_float(row + e) - top);
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t c) { return probs[a] > probs[c] || (probs[a] == probs[c] && a < c); });
    float chosen = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) chosen += probs[order[k]];
    for (int64_t k = 0; k < top_k; ++k) {
      T weight;
      roseinfer::store_float(&weight, normalize ? probs[order[k]] / chosen : probs[order[k]]);
      rows_of[order[k]].emplace_back(b, weight);
    }
  }
  return rows_of;
}

// out [rows, hidden] += weight * y, each product and sum rounded to T as the op-by-op path's
// `y * weight` and index_add_ round them.
template <typename T>
void add_weighted(T* out, const T* y, float weight, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) {
    T product;
    roseinfer::store_float(&product, roseinfer::load_float(y + h) * weight);
    roseinfer::store_float(out + h, roseinfer::load_float(out + h) + roseinfer::load_float(&product));
  }
}

// x [rows, dim] normed by `weight` (a norm of a sub-layer's output) into `scratch`, which is returned.
template <typename T>
const T* output_norm(const torch::Tensor& weight, const T* x, T* scratch, int64_t rows, int64_t dim, float eps) {
  roseinfer::norm_rows_in_parallel(x, weight.data_ptr<T>(), scratch, rows, dim, eps);
  return scratch;
}

}  // namespace

class DecoderStep {
 public:
  // vocab: the LM head's rows (this rank's). final_norm's dtype is the activations' (float32 or
  // bfloat16). embedding_scale: the token embeddings' factor, already rounded to the activations'
  // dtype, or 0: none.
  DecoderStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t vocab, double eps,
              torch::Tensor final_norm, LinearSpec head, double embedding_scale)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        embedding_scale_(static_cast<float>(embedding_scale)), eps_(static_cast<float>(eps)),
        dtype_(final_norm.scalar_type()) {
    TORCH_CHECK(dtype_ == torch::kFloat || dtype_ == torch::kBFloat16, "activations must be float32 or bfloat16, not ",
                dtype_);
    final_norm_ = final_norm.contiguous();
    head_ = DecodeLinear(head, vocab, hidden, dtype_, "the LM head");
  }

  // The next layer's attention core: its input and MLP norms (the MLP norm before its MLP), the q/k/v
  // and output projections, the scores' scale and the index of its rotation table. -> its index.
  int64_t add_layer(torch::Tensor input_norm, LinearSpec qkv, LinearSpec o, torch::Tensor mlp_norm, double scale,
                    int64_t rotary) {
    TORCH_CHECK(scale > 0, "attention scale ", scale, ": the scale must be positive");
    TORCH_CHECK(rotary >= 0, "a rotation table's index cannot be negative");
    Layer layer;
    layer.input_norm = norm(input_norm);
    layer.mlp_norm = norm(mlp_norm);
    Attention& attention = layer.attention;
    attention.qkv = DecodeLinear(qkv, (heads_ + 2 * kv_heads_) * head_dim_, hidden_, dtype_, "qkv_proj");
    attention.o = DecodeLinear(o, hidden_, heads_ * head_dim_, dtype_, "o_proj");
    attention.scale = static_cast<float>(scale);
    attention.rotary = rotary;
    rotary_tables_ = std::max(rotary_tables_, rotary + 1);
    layers_.push_back(std::move(layer));
    return static_cast<int64_t>(layers_.size()) - 1;
  }

  // Layer `index`'s pool belongs to KV cache group `group` (common/kv_cache_spec.py: a model with
  // full and sliding-window layers keeps one pool, block table and slot mapping per kind).
  void set_kv_group(int64_t index, int64_t group) {
    TORCH_CHECK(group >= 0, "a KV cache group's index cannot be negative");
    layer(index).attention.kv_group = group;
    kv_groups_ = std::max(kv_groups_, group + 1);
  }

  // Layer `index` attends to its last `window` positions only.
  void set_sliding_window(int64_t index, int64_t window) {
    TORCH_CHECK(window > 0, "a sliding window must be positive, not ", window);
    layer(index).attention.window = window;
  }

  // Layer `index`'s scores are soft-capped: cap * tanh(score / cap).
  void set_score_softcap(int64_t index, double cap) {
    TORCH_CHECK(cap > 0, "a soft-cap must be positive, not ", cap);
    layer(index).attention.softcap = static_cast<float>(cap);
  }

  // Layer `index` norms q and k before rotary: one norm per head, or over all heads (a norm of all
  // of q, and of all of k).
  void set_qk_norm(int64_t index, torch::Tensor q, torch::Tensor k, bool over_all_heads) {
    const int64_t q_width = over_all_heads ? heads_ * head_dim_ : head_dim_;
    const int64_t k_width = over_all_heads ? kv_heads_ * head_dim_ : head_dim_;
    TORCH_CHECK(q.numel() == q_width && k.numel() == k_width, "q/k norms of ", q.numel(), " and ", k.numel(),
                " values, not ", q_width, " and ", k_width);
    layer(index).attention.qk_norm = QkNorm{norm(q), norm(k), over_all_heads};
  }

  // Layer `index` norms the attention's and the MLP's outputs before their residual adds.
  void set_post_norms(int64_t index, torch::Tensor attention, torch::Tensor mlp) {
    layer(index).post_norms = PostNorms{norm(attention), norm(mlp)};
  }

  // Layer `index`'s MLP is gated: down(activation(gate) * up), activation "silu" | "gelu_tanh".
  void set_gated_mlp(int64_t index, LinearSpec gate_up, LinearSpec down, int64_t intermediate,
                     const std::string& activation) {
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation ", activation,
                ": the fused step has silu and gelu_tanh");
    TORCH_CHECK(intermediate > 0, "an MLP's width must be positive");
    GatedMlp mlp;
    mlp.gate_up = DecodeLinear(gate_up, 2 * intermediate, hidden_, dtype_, "gate_up_proj");
    mlp.down = DecodeLinear(down, hidden_, intermediate, dtype_, "down_proj");
    mlp.intermediate = intermediate;
    mlp.gelu = activation == "gelu_tanh";
    layer(index).mlp = std::move(mlp);
  }

  // Layer `index`'s MLP is a mixture of experts (see SparseMlp); shared: (gate_up, down, gate,
  // intermediate) of a shared expert.
  using SharedExpertSpec = std::tuple<LinearSpec, LinearSpec, LinearSpec, int64_t>;
  void set_experts(int64_t index, LinearSpec router, std::vector<LinearSpec> gate_ups, std::vector<LinearSpec> downs,
                   int64_t top_k, bool normalize, int64_t intermediate, std::optional<SharedExpertSpec> shared) {
    Layer& target = layer(index);
    const int64_t experts = static_cast<int64_t>(gate_ups.size());
    TORCH_CHECK(experts > 0 && downs.size() == gate_ups.size(), "one gate_up and one down per expert");
    TORCH_CHECK(top_k > 0 && top_k <= experts, "top_k must be in 1 .. ", experts, ", not ", top_k);
    SparseMlp mlp;
    mlp.router = DecodeLinear(router, experts, hidden_, dtype_, "the router");
    for (int64_t e = 0; e < experts; ++e) {
      mlp.gate_up.emplace_back(gate_ups[e], 2 * intermediate, hidden_, dtype_, "an expert's gate_up_proj");
      mlp.down.emplace_back(downs[e], hidden_, intermediate, dtype_, "an expert's down_proj");
    }
    mlp.grouped = std::all_of(mlp.gate_up.begin(), mlp.gate_up.end(), [&](const DecodeLinear& l) {
      return l.plain_blocks() && l.exact == mlp.gate_up[0].exact;
    }) && std::all_of(mlp.down.begin(), mlp.down.end(), [&](const DecodeLinear& l) {
      return l.plain_blocks() && l.exact == mlp.gate_up[0].exact;
    });
    mlp.top_k = top_k;
    mlp.normalize = normalize;
    mlp.intermediate = intermediate;
    if (shared) {
      const auto& [gate_up, down, gate, width] = *shared;
      mlp.shared_gate_up = DecodeLinear(gate_up, 2 * width, hidden_, dtype_, "the shared expert's gate_up_proj");
      mlp.shared_down = DecodeLinear(down, hidden_, width, dtype_, "the shared expert's down_proj");
      mlp.shared_gate = DecodeLinear(gate, 1, hidden_, dtype_, "the shared expert's gate");
      mlp.shared_intermediate = width;
    }
    target.mlp = std::move(mlp);
  }

  // How many rotation tables forward takes: one per index the layers name.
  int64_t rotary_tables() const { return rotary_tables_; }

  // embedded [B, hidden] of the activations' dtype: the rows' token embeddings (unscaled);
  // slot_mapping, context_lens [B] int64; rotations: per table (rotary_tables()) [B, ...,
  // head_dim / 2, 2] float32: (cos, sin) of each row's rotary angles, as models/rotary.py computes
  // them; slot_mappings, block_tables: per KV cache group (set_kv_group; one without groups) [B]
  // and [B, max_blocks] int64;
  // kv_caches: per layer [2, blocks, block_size, kv_heads, head_dim] (float32, 16-bit or q8_0 for a
  // float32 model; bfloat16 or q8_0 for a bfloat16 one). -> logits [B, vocab], float32 from blocks,
  // else of the activations' dtype (as the op-by-op LM head returns them).
  torch::Tensor forward(torch::Tensor embedded, std::vector<torch::Tensor> rotations,
                        std::vector<torch::Tensor> slot_mappings, std::vector<torch::Tensor> block_tables,
                        torch::Tensor context_lens, std::vector<torch::Tensor> kv_caches) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV pool per layer");
    TORCH_CHECK(static_cast<int64_t>(slot_mappings.size()) == kv_groups_ &&
                    static_cast<int64_t>(block_tables.size()) == kv_groups_,
                "one slot mapping and one block table per KV cache group (", kv_groups_, "), not ",
                slot_mappings.size(), " and ", block_tables.size());
    for (size_t l = 0; l < layers_.size(); ++l)
      TORCH_CHECK(!std::holds_alternative<std::monostate>(layers_[l].mlp), "layer ", l, " has no MLP");
    embedded = embedded.contiguous();
    TORCH_CHECK(embedded.scalar_type() == dtype_ && embedded.dim() == 2 && embedded.size(1) == hidden_,
                "embedded: [B, hidden] of the model's dtype (", dtype_, ")");
    TORCH_CHECK(static_cast<int64_t>(rotations.size()) == rotary_tables_, "one rotation tensor per table (",
                rotary_tables_, "), not ", rotations.size());
    Step step{{}, {}, {}, context_lens.contiguous()};
    for (int64_t g = 0; g < kv_groups_; ++g) {
      step.slots.push_back(slot_mappings[g].contiguous());
      step.tables.push_back(block_tables[g].contiguous());
      TORCH_CHECK(step.slots[g].numel() == embedded.size(0) && step.tables[g].dim() == 2 &&
                      step.tables[g].size(0) == embedded.size(0),
                  "KV cache group ", g, ": a slot and a block table row per row");
    }
    for (auto& table : rotations) {
      table = table.contiguous();
      TORCH_CHECK(table.scalar_type() == torch::kFloat && table.numel() == embedded.size(0) * head_dim_,
                  "rotations: [B, head_dim / 2, 2] float32 per table");
      step.rotations.push_back(table.data_ptr<float>());
    }
    if (dtype_ == torch::kFloat) return run<float>(embedded, step, kv_caches);
    return run<c10::BFloat16>(embedded, step, kv_caches);
  }

 private:
  struct Step {
    std::vector<const float*> rotations;  // per table
    std::vector<torch::Tensor> slots, tables;  // per KV cache group
    torch::Tensor lens;
  };

  template <typename T>
  torch::Tensor run(const torch::Tensor& embedded, const Step& step, const std::vector<torch::Tensor>& kv_caches) {
    const int64_t B = embedded.size(0), H = hidden_, D = head_dim_;
    int64_t I = 0;  // the widest gated MLP's width
    for (const Layer& layer : layers_)
      if (const auto* gated = std::get_if<GatedMlp>(&layer.mlp)) I = std::max(I, gated->intermediate);
    const int64_t q_size = heads_ * D, kv_size = kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
    const T* rows = embedded.data_ptr<T>();
    std::vector<T> residual(rows, rows + B * H), normed(B * H), qkv(B * qkv_size), attn(B * q_size),
        mlp(B * 2 * I), act(B * I), out(B * H);
    std::vector<float> xs, os;  // float32 scratch for a bfloat16 model's blocked layers
    if (embedding_scale_ != 0.0f) scale_rows(residual.data(), B * H);
    const T* layer_out = out.data();  // the previous layer's output (its MLP's, normed or not)
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      const Attention& attention = layer.attention;
      const PostNorms* post = layer.post_norms ? &*layer.post_norms : nullptr;
      if (l == 0) {
        roseinfer::norm_rows_in_parallel(residual.data(), layer.input_norm.data_ptr<T>(), normed.data(), B, H, eps_);
      } else {
        roseinfer::add_and_norm_rows_in_parallel(residual.data(), layer_out, layer.input_norm.data_ptr<T>(),
                                                 normed.data(), B, H, eps_);
      }
      attention.qkv.apply(normed.data(), B, qkv.data(), xs, os);
      at::parallel_for(0, B, roseinfer::kNormRowsPerTask, [&](int64_t begin, int64_t end) {
        const QkNorm* qk_norm = attention.qk_norm ? &*attention.qk_norm : nullptr;
        std::vector<T> copy(qk_norm ? q_size : 0);
        for (int64_t b = begin; b < end; ++b) {
          T* q = qkv.data() + b * qkv_size;
          T* k = q + q_size;
          if (qk_norm) {  // norm_rows does not work in place: through a copy
            std::memcpy(copy.data(), q, q_size * sizeof(T));
            const bool whole = qk_norm->over_all_heads;  // one row of all heads, or a row per head
            roseinfer::norm_rows<T>(copy.data(), qk_norm->q.data_ptr<T>(), q, 0, whole ? 1 : heads_,
                                    whole ? q_size : D, eps_);
            std::memcpy(copy.data(), k, kv_size * sizeof(T));
            roseinfer::norm_rows<T>(copy.data(), qk_norm->k.data_ptr<T>(), k, 0, whole ? 1 : kv_heads_,
                                    whole ? kv_size : D, eps_);
          }
          const float* rotation = step.rotations[attention.rotary] + b * D;
          roseinfer::rotate_heads(q, heads_, D, rotation);
          roseinfer::rotate_heads(k, kv_heads_, D, rotation);
        }
      });
      attend(qkv.data(), attn.data(), B, kv_caches[l], step, attention);
      attention.o.apply(attn.data(), B, out.data(), xs, os);
      // normed is free here (the projections have read it): the scratch of the output norms.
      const T* attention_out = post ? output_norm(post->attention, out.data(), normed.data(), B, H, eps_) : out.data();
      roseinfer::add_and_norm_rows_in_parallel(residual.data(), attention_out, layer.mlp_norm.data_ptr<T>(),
                                               normed.data(), B, H, eps_);
      if (const auto* experts = std::get_if<SparseMlp>(&layer.mlp)) {
        sparse_mlp(*experts, normed.data(), B, out.data(), xs, os);
      } else {
        const GatedMlp& gated = std::get<GatedMlp>(layer.mlp);
        gated.gate_up.apply(normed.data(), B, mlp.data(), xs, os);
        roseinfer::gated_activation_in_parallel(mlp.data(), act.data(), gated.intermediate, B, gated.gelu);
        gated.down.apply(act.data(), B, out.data(), xs, os);
      }
      layer_out = post ? output_norm(post->mlp, out.data(), normed.data(), B, H, eps_) : out.data();
    }
    roseinfer::add_and_norm_rows_in_parallel(residual.data(), layer_out, final_norm_.data_ptr<T>(), normed.data(), B,
                                             H, eps_);
    // Logits of the activations' dtype, as the op-by-op LM head returns them.
    torch::Tensor logits = torch::empty({B, head_.N}, torch::dtype(kDtype<T>));
    head_.apply(normed.data(), B, logits.data_ptr<T>(), xs, os);
    return logits;
  }

  // out [B, hidden] = the mixture of experts of x [B, hidden]: each expert that a row chose runs
  // once over the rows that chose it, in expert order, its weighted output added into theirs (as
  // SparseMoeBlock.forward groups them), then the shared expert's gated output.
  template <typename T>
  void sparse_mlp(const SparseMlp& moe, const T* x, int64_t B, T* out, std::vector<float>& xs,
                  std::vector<float>& os) const {
    const int64_t H = hidden_, E = static_cast<int64_t>(moe.gate_up.size()), I = moe.intermediate;
    std::vector<T> logits(B * E);
    moe.router.apply(x, B, logits.data(), xs, os);
    const auto rows_of = route(logits.data(), B, E, moe.top_k, moe.normalize);
    std::fill(out, out + B * H, T(0.0f));
    std::vector<T> rows, gate_up, act, y;
    if (moe.grouped) {
      experts_grouped(moe, rows_of, x, B, out);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const auto& chosen = rows_of[e];
        const int64_t count = static_cast<int64_t>(chosen.size());
        if (!count) continue;
        const T* input = x + chosen[0].first * H;
        if (count > 1) {  // the rows that chose this expert, together
          rows.resize(count * H);
          for (int64_t i = 0; i < count; ++i) std::copy_n(x + chosen[i].first * H, H, rows.data() + i * H);
          input = rows.data();
        }
        gate_up.resize(count * 2 * I);
        act.resize(count * I);
        y.resize(count * H);
        moe.gate_up[e].apply(input, count, gate_up.data(), xs, os);
        roseinfer::silu_and_mul_in_parallel(gate_up.data(), act.data(), I, count);
        moe.down[e].apply(act.data(), count, y.data(), xs, os);
        for (int64_t i = 0; i < count; ++i)
          add_weighted(out + chosen[i].first * H, y.data() + i * H, roseinfer::load_float(&chosen[i].second), H);
      }
    }
    if (moe.shared_intermediate) {
      const int64_t S = moe.shared_intermediate;
      std::vector<T> gate(B);
      gate_up.resize(B * 2 * S);
      act.resize(B * S);
      y.resize(B * H);
      moe.shared_gate.apply(x, B, gate.data(), xs, os);
      moe.shared_gate_up.apply(x, B, gate_up.data(), xs, os);
      roseinfer::silu_and_mul_in_parallel(gate_up.data(), act.data(), S, B);
      moe.shared_down.apply(act.data(), B, y.data(), xs, os);
      for (int64_t b = 0; b < B; ++b) {
        T sigmoid;  // rounded to T, as torch.sigmoid leaves it
        roseinfer::store_float(&sigmoid, 1.0f / (1.0f + std::exp(-roseinfer::load_float(&gate[b]))));
        add_weighted(out + b * H, y.data() + b * H, roseinfer::load_float(&sigmoid), H);
      }
    }
  }

  // The experts of sparse_mlp on GGUF blocks, all at once: every chosen expert's gate_up products
  // in one parallel region, then every down product in another (the threads shared among all their
  // rows), each product as the expert's own linear layer computes it.
  template <typename T>
  void experts_grouped(const SparseMlp& moe, const std::vector<std::vector<std::pair<int64_t, T>>>& rows_of,
                       const T* x, int64_t B, T* out) const {
    const int64_t H = hidden_, E = static_cast<int64_t>(moe.gate_up.size()), I = moe.intermediate;
    std::vector<int64_t> first(E + 1, 0);  // expert e's rows: first[e] .. first[e + 1] of the gathered rows
    for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + static_cast<int64_t>(rows_of[e].size());
    const int64_t rows = first[E];
    // Scratch kept between layers and steps, never cleared: what is read of each is written first
    // (xf only for experts with several rows). Allocating and clearing them every layer was ~1% of
    // one-stream OLMoE decode, on the main thread alone.
    thread_local std::vector<float> x_float, xf, gate_up, act_f, y;
    thread_local std::vector<T> act;
    xf.resize(rows * H);
    gate_up.resize(rows * 2 * I);
    y.resize(rows * H);
    act.resize(rows * I);
    const float* rows_in;  // x as float32
    if constexpr (std::is_same_v<T, float>) {
      rows_in = x;
    } else {
      x_float.resize(B * H);
      for (int64_t i = 0; i < B * H; ++i) x_float[i] = roseinfer::load_float(x + i);
      rows_in = x_float.data();
    }
    // An expert chosen by one row reads that row where it is, so that the experts of a decode row
    // share one input, which gguf_matmul_group quantizes once; several rows are gathered.
    std::vector<const float*> inputs(E, nullptr);
    for (int64_t e = 0; e < E; ++e) {
      const auto& chosen = rows_of[e];
      if (chosen.size() == 1) {
        inputs[e] = rows_in + chosen[0].first * H;
      } else if (chosen.size() > 1) {
        for (size_t i = 0; i < chosen.size(); ++i)
          std::copy_n(rows_in + chosen[i].first * H, H, xf.data() + (first[e] + i) * H);
        inputs[e] = xf.data() + first[e] * H;
      }
    }
    const bool exact = moe.gate_up[0].exact;
    std::vector<roseinfer::GgufProduct> products;
    for (int64_t e = 0; e < E; ++e)
      if (first[e + 1] > first[e])
        moe.gate_up[e].add_products(inputs[e], first[e + 1] - first[e], gate_up.data() + first[e] * 2 * I, 2 * I,
                                    products);
    roseinfer::gguf_matmul_group(products, exact);
    // SiLU(gate) * up of the outputs rounded to T, as each expert's layers leave them.
    if constexpr (std::is_same_v<T, float>) {
      roseinfer::silu_and_mul_in_parallel(gate_up.data(), act.data(), I, rows);
    } else {
      std::vector<T> rounded(rows * 2 * I);
      for (int64_t i = 0; i < rows * 2 * I; ++i) roseinfer::store_float(rounded.data() + i, gate_up[i]);
      roseinfer::silu_and_mul_in_parallel(rounded.data(), act.data(), I, rows);
    }
    const float* act_in;
    if constexpr (std::is_same_v<T, float>) {
      act_in = act.data();
    } else {
      act_f.resize(rows * I);
      for (int64_t i = 0; i < rows * I; ++i) act_f[i] = roseinfer::load_float(act.data() + i);
      act_in = act_f.data();
    }
    products.clear();
    for (int64_t e = 0; e < E; ++e)
      if (first[e + 1] > first[e])
        moe.down[e].add_products(act_in + first[e] * I, first[e + 1] - first[e], y.data() + first[e] * H, H,
                                 products);
    roseinfer::gguf_matmul_group(products, exact);
    std::vector<T> rounded(std::is_same_v<T, float> ? 0 : H);  // an expert's output rounded to T, as its layer returns it
    for (int64_t e = 0; e < E; ++e)
      for (size_t i = 0; i < rows_of[e].size(); ++i) {
        T* dst = out + rows_of[e][i].first * H;
        const float* yi = y.data() + (first[e] + i) * H;
        const float weight = roseinfer::load_float(&rows_of[e][i].second);
        if constexpr (std::is_same_v<T, float>) {
          add_weighted(dst, yi, weight, H);
        } else {
          for (int64_t h = 0; h < H; ++h) roseinfer::store_float(rounded.data() + h, yi[h]);
          add_weighted(dst, rounded.data(), weight, H);
        }
      }
  }

  // Each row's new key and value written to its slot, then its attention over the pool: qkv [B,
  // q | k | v] -> out [B, q_size].
  template <typename T>
  void attend(const T* qkv, T* out, int64_t B, const torch::Tensor& pool, const Step& step,
              const Attention& attention) const {
    const int64_t D = head_dim_, q_size = heads_ * D, kv_size = kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
    const torch::Tensor& group_tables = step.tables[attention.kv_group];
    const int64_t* slots = step.slots[attention.kv_group].data_ptr<int64_t>();
    const int64_t* tables = group_tables.data_ptr<int64_t>();
    const int64_t* lens = step.lens.data_ptr<int64_t>();
    const int64_t max_blocks = group_tables.size(1), block_size = pool.size(2), pool_half = pool.numel() / 2;
    auto run = [&](auto* keys) {  // keys, then values, in one pool
      using cache_t = std::remove_pointer_t<decltype(keys)>;
      const int64_t row = roseinfer::kv_row_elements<cache_t>(D);
      const int64_t slices = roseinfer::kv_head_slices(B, kv_heads_);
      at::parallel_for(0, B * slices, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, work;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / slices;
          const auto [first, last] = roseinfer::kv_head_slice(kv_heads_, slices, task % slices);
          // A row's new slot is in a block of its own sequence (shared prefix blocks are full),
          // so each task can write its heads' keys and values and attend over them.
          const T* k = qkv + b * qkv_size + q_size;
          const T* v = k + kv_size;
          for (int64_t h = first; h < last; ++h) {
            roseinfer::store_kv_row(keys + (slots[b] * kv_heads_ + h) * row, k + h * D, D);
            roseinfer::store_kv_row(keys + pool_half + (slots[b] * kv_heads_ + h) * row, v + h * D, D);
          }
          roseinfer::paged_attention_heads<T, cache_t>(qkv + b * qkv_size, keys, keys + pool_half,
                                                       tables + b * max_blocks, lens[b], heads_, kv_heads_, first,
                                                       last, block_size, D, attention.scale, out + b * q_size,
                                                       scores, work, attention.window, attention.softcap);
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

  Layer& layer(int64_t index) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers_.size()), "no layer ", index);
    return layers_[index];
  }

  // A norm's weights as the activations' dtype.
  torch::Tensor norm(const torch::Tensor& weight) const { return weight.contiguous().to(dtype_); }

  // In place: x *= the embedding scale, in the activations' dtype (as `embedded * scale` in
  // PyTorch, the scale already of that dtype).
  template <typename T>
  void scale_rows(T* x, int64_t n) const {
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        roseinfer::store_float(x + i, roseinfer::load_float(x + i) * embedding_scale_);
    });
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_;
  float embedding_scale_;  // Gemma's sqrt(hidden), of the activations' dtype; 0: none
  int64_t rotary_tables_ = 0;
  int64_t kv_groups_ = 1;  // one more than the highest group a layer names
  float eps_;
  c10::ScalarType dtype_;
  torch::Tensor final_norm_;
  DecodeLinear head_;
  std::vector<Layer> layers_;
};

void bind_decoder_step(pybind11::module& m) {
  pybind11::class_<DecoderStep>(m, "DecoderStep")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, LinearSpec, double>())
      .def("add_layer", &DecoderStep::add_layer, "the next layer's attention core; -> its index")
      .def("set_kv_group", &DecoderStep::set_kv_group, "a layer's KV pool is read through a group's tables")
      .def("set_sliding_window", &DecoderStep::set_sliding_window, "a layer attends to its last positions only")
      .def("set_score_softcap", &DecoderStep::set_score_softcap, "a layer soft-caps its attention scores")
      .def("set_qk_norm", &DecoderStep::set_qk_norm, "a layer norms q and k, per head or over all heads")
      .def("set_post_norms", &DecoderStep::set_post_norms, "a layer norms its attention's and MLP's outputs")
      .def("set_gated_mlp", &DecoderStep::set_gated_mlp, "a layer's MLP is gated (SwiGLU or GeGLU)")
      .def("set_experts", &DecoderStep::set_experts, "a layer's MLP is a mixture of experts")
      .def("rotary_tables", &DecoderStep::rotary_tables, "how many rotation tensors forward takes")
      .def("forward", &DecoderStep::forward, "one decode step: token embeddings -> logits (see the source's header)");
}

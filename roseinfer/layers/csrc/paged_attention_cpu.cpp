// Paged attention for decode steps on the CPU: one query token per sequence, keys and values read
// straight from the block pool through the block table (no gathered copy, no padding).
//
// Each (sequence, KV head) pair is one task: the query heads that share the KV head are scored
// against every cached key, softmax-normalised (max-subtracted, in float), and used to weight the
// values. The pool is read once; all arithmetic is in float whatever the storage type.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Attention weights of far-off tokens are often below float's normal range; arithmetic on such
// denormal numbers is ~100x slower on x86. They are treated as zero while the kernel runs.
struct DenormalsAreZero {
#if defined(__SSE__)
  unsigned int saved = _mm_getcsr();
  DenormalsAreZero() { _mm_setcsr(saved | 0x8040); }  // flush-to-zero | denormals-are-zero
  ~DenormalsAreZero() { _mm_setcsr(saved); }
#endif
};

// Rows are read one after another but blocks lie anywhere in the pool, so the hardware prefetcher
// loses the stream at every block boundary: rows a few tokens ahead are requested explicitly.
constexpr int64_t kPrefetchDistance = 4;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// One sequence: all its query heads against its cached keys and values. Each cached token's row
// (every KV head) is contiguous in the pool, so the row is read once, front to back, and every
// query head sharing a KV head is scored against it while it is in cache. HEAD_DIM is a
// compile-time constant for the common sizes so the inner loops become whole vector registers.
template <typename scalar_t, typename cache_t, int HEAD_DIM>
void decode_sequence(const scalar_t* __restrict q,      // [heads, head_dim]
                     const cache_t* __restrict k_pool,  // [blocks, block_size, kv_heads, head_dim]
                     const cache_t* __restrict v_pool,
                     const int64_t* __restrict block_table,  // this sequence's blocks
                     int64_t context_len, int64_t heads, int64_t kv_heads, int64_t block_size,
                     int64_t head_dim_runtime, float scale,
                     scalar_t* __restrict out,  // [heads, head_dim]
                     std::vector<float>& scores_buffer, std::vector<float>& work) {
  const int64_t head_dim = HEAD_DIM ? HEAD_DIM : head_dim_runtime;
  const int64_t group = heads / kv_heads;
  scores_buffer.resize(heads * context_len);
  work.assign(2 * heads * head_dim, 0.0f);
  float* __restrict scores = scores_buffer.data();  // [heads, context_len]
  float* __restrict qf = work.data();
  float* __restrict acc = work.data() + heads * head_dim;
  for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = roseinfer::load_float(q + i) * scale;

  const int64_t token_stride = kv_heads * head_dim;
  auto slot_of = [&](int64_t t) { return block_table[t / block_size] * block_size + t % block_size; };
  for (int64_t t = 0; t < context_len; ++t) {
    const cache_t* __restrict row = k_pool + slot_of(t) * token_stride;
    if (t + kPrefetchDistance < context_len) prefetch_row(k_pool + slot_of(t + kPrefetchDistance) * token_stride, token_stride);
    for (int64_t head = 0; head < heads; ++head) {
      const cache_t* __restrict k = row + (head / group) * head_dim;
      const float* __restrict qh = qf + head * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * roseinfer::load_float(k + d);
      scores[head * context_len + t] = dot;
    }
  }
  // Softmax per query head, in float (the max is subtracted; no infinities are involved).
  for (int64_t head = 0; head < heads; ++head) {
    float* __restrict s = scores + head * context_len;
    float max_score = s[0];
    for (int64_t t = 1; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      total += s[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  for (int64_t t = 0; t < context_len; ++t) {
    const cache_t* __restrict row = v_pool + slot_of(t) * token_stride;
    if (t + kPrefetchDistance < context_len) prefetch_row(v_pool + slot_of(t + kPrefetchDistance) * token_stride, token_stride);
    for (int64_t head = 0; head < heads; ++head) {
      const cache_t* __restrict v = row + (head / group) * head_dim;
      const float p = scores[head * context_len + t];
      float* __restrict a = acc + head * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * roseinfer::load_float(v + d);
    }
  }
  for (int64_t i = 0; i < heads * head_dim; ++i) roseinfer::store_float(out + i, acc[i]);
}

template <typename scalar_t, typename cache_t>
void decode_dispatch(int64_t head_dim, const scalar_t* q, const cache_t* k, const cache_t* v,
                     const int64_t* table, int64_t len, int64_t heads, int64_t kv_heads,
                     int64_t block_size, float scale, scalar_t* out, std::vector<float>& scores,
                     std::vector<float>& work) {
  switch (head_dim) {
    case 64:
      return decode_sequence<scalar_t, cache_t, 64>(q, k, v, table, len, heads, kv_heads, block_size, 64, scale, out,
                                           scores, work);
    case 128:
      return decode_sequence<scalar_t, cache_t, 128>(q, k, v, table, len, heads, kv_heads, block_size, 128, scale,
                                            out, scores, work);
    default:
      return decode_sequence<scalar_t, cache_t, 0>(q, k, v, table, len, heads, kv_heads, block_size, head_dim, scale,
                                          out, scores, work);
  }
}

}  // namespace

namespace roseinfer {

template <typename cache_t>
void paged_attention_sequence(const float* q, const cache_t* k_pool, const cache_t* v_pool, const int64_t* block_table,
                              int64_t context_len, int64_t heads, int64_t kv_heads, int64_t block_size,
                              int64_t head_dim, float scale, float* out, std::vector<float>& scores,
                              std::vector<float>& work) {
  DenormalsAreZero flush;
  decode_dispatch<float, cache_t>(head_dim, q, k_pool, v_pool, block_table, context_len, heads, kv_heads,
                                  block_size, scale, out, scores, work);
}

template void paged_attention_sequence<float>(const float*, const float*, const float*, const int64_t*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t, float, float*,
                                              std::vector<float>&, std::vector<float>&);
template void paged_attention_sequence<c10::BFloat16>(const float*, const c10::BFloat16*, const c10::BFloat16*,
                                                      const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                      float, float*, std::vector<float>&, std::vector<float>&);
template void paged_attention_sequence<c10::Half>(const float*, const c10::Half*, const c10::Half*, const int64_t*,
                                                  int64_t, int64_t, int64_t, int64_t, int64_t, float, float*,
                                                  std::vector<float>&, std::vector<float>&);

}  // namespace roseinfer

namespace {

template <typename scalar_t, typename cache_t>
void decode_batch(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, float scale,
                  torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_pool.data_ptr<cache_t>();
  const cache_t* v_ptr = v_pool.data_ptr<cache_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lengths = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    DenormalsAreZero flush;
    std::vector<float> scores, work;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t offset = b * heads * head_dim;
      decode_dispatch<scalar_t, cache_t>(head_dim, q_ptr + offset, k_ptr, v_ptr, tables + b * max_blocks, lengths[b],
                                         heads, kv_heads, block_size, scale, out_ptr + offset, scores, work);
    }
  });
}

}  // namespace

// q: [batch, heads, head_dim]; k_pool, v_pool: [blocks, block_size, kv_heads, head_dim];
// block_tables: [batch, max_blocks] int64; context_lens: [batch] int64. Returns [batch, heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == head_dim && heads % kv_heads == 0, "head counts do not match");
  auto out = torch::empty_like(q);
  const float scale_f = static_cast<float>(scale);
  if (k_pool.scalar_type() == q.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      decode_batch<scalar_t, scalar_t>(q, k_pool, v_pool, block_tables, context_lens, scale_f, out);
    });
  } else {  // a float32 model over a 16-bit cache (--kv-cache-dtype)
    TORCH_CHECK(q.scalar_type() == torch::kFloat && v_pool.scalar_type() == k_pool.scalar_type(),
                "a KV pool of another dtype than q: q must be float32");
    AT_DISPATCH_REDUCED_FLOATING_TYPES(k_pool.scalar_type(), "paged_decode_attention", [&] {
      decode_batch<float, scalar_t>(q, k_pool, v_pool, block_tables, context_lens, scale_f, out);
    });
  }
  return out;
}

// Paged attention for decode steps on the CPU: one query token per sequence, keys and values read
// straight from the block pool through the block table (no gathered copy, no padding).
//
// Each sequence (in a batch smaller than the thread count, each slice of its KV heads) is one task:
// the query heads that share a KV head are scored against every cached key, softmax-normalised
// (max-subtracted, in float), and used to weight the values. The pool is read once; all arithmetic is in float whatever the storage type.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
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

// Softmax of each query head's scores (rows of `stride` floats, the first context_len used), in
// float: the max is subtracted; no infinities are involved. The first `skip` tokens are outside a
// sliding window: they get weight exactly 0. `softcap` > 0: scores are first squashed to
// softcap * tanh(score / softcap) (Gemma 2's attention logit soft-capping).
inline void softmax_rows(float* scores, int64_t heads, int64_t context_len, int64_t stride, int64_t skip,
                         float softcap) {
  for (int64_t head = 0; head < heads; ++head) {
    float* __restrict s = scores + head * stride;
    for (int64_t t = 0; t < skip; ++t) s[t] = 0.0f;
    if (softcap > 0.0f)
      for (int64_t t = skip; t < context_len; ++t) s[t] = std::tanh(s[t] / softcap) * softcap;
    float max_score = s[skip];
    for (int64_t t = skip + 1; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = skip; t < context_len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      total += s[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = skip; t < context_len; ++t) s[t] *= inv;
  }
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
                     int64_t context_len, int64_t heads, int64_t kv_heads, int64_t pool_kv_heads,
                     int64_t block_size, int64_t head_dim_runtime, float scale, int64_t skip, float softcap,
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

  const int64_t row_elements = roseinfer::kv_row_elements<cache_t>(head_dim);
  const int64_t token_stride = pool_kv_heads * row_elements;
  auto slot_of = [&](int64_t t) { return block_table[t / block_size] * block_size + t % block_size; };
  for (int64_t t = 0; t < context_len; ++t) {
    const cache_t* __restrict row = k_pool + slot_of(t) * token_stride;
    if (t + kPrefetchDistance < context_len) prefetch_row(k_pool + slot_of(t + kPrefetchDistance) * token_stride, kv_heads * row_elements);
    for (int64_t head = 0; head < heads; ++head) {
      const cache_t* __restrict k = row + (head / group) * row_elements;
      const float* __restrict qh = qf + head * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * roseinfer::kv_value(k, head_dim, d);
      scores[head * context_len + t] = dot;
    }
  }
  softmax_rows(scores, heads, context_len, context_len, skip, softcap);
  for (int64_t t = 0; t < context_len; ++t) {
    const cache_t* __restrict row = v_pool + slot_of(t) * token_stride;
    if (t + kPrefetchDistance < context_len) prefetch_row(v_pool + slot_of(t + kPrefetchDistance) * token_stride, kv_heads * row_elements);
    for (int64_t head = 0; head < heads; ++head) {
      const cache_t* __restrict v = row + (head / group) * row_elements;
      const float p = scores[head * context_len + t];
      float* __restrict a = acc + head * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * roseinfer::kv_value(v, head_dim, d);
    }
  }
  for (int64_t i = 0; i < heads * head_dim; ++i) roseinfer::store_float(out + i, acc[i]);
}

#if defined(__AVX512F__)
// The same computation in whole AVX-512 registers, for head sizes that are multiples of 16. Three
// costs bound the plain loops above at batch 64: a horizontal sum for every (token, head) score,
// value accumulators that go through memory for every token, and, at long contexts, waiting on
// memory. Here 16 tokens' partial dot products are summed across lanes together (a transposing add
// tree: ~3 instructions a score instead of ~10); each KV head's query heads keep their value
// accumulators in registers through a block of tokens; the pool is walked block by block (no
// division per token) with the next block requested while this one is used. Against the plain
// loops, batch 64 (kernel alone, 30 layers): bfloat16 ~1.8x, float32 ~1.4x; a whole bfloat16
// batch of 64 x 1,024 new tokens ~1.3x.
constexpr int kLanes = 16;

using roseinfer::load16;

// r[i] = the sum of v[i]'s 16 lanes.
inline __m512 sum_lanes_of_16(const float* v /* [16][16] */) {
  __m512 pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i) {  // lanes {4j, 4j+2} of v[2i] and v[2i+1], interleaved
    const __m512 a = _mm512_loadu_ps(v + 32 * i), b = _mm512_loadu_ps(v + 32 * i + 16);
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)  // per 128-bit lane j: the lane's sums of v[4i .. 4i+3]
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes added in pairs
    octets[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc[h] += sum over tokens t0 <= t < t1 of p[h][t] * v_t for HEADS query heads sharing one KV
// head, where the tokens' rows follow one another in the pool (one block).
template <typename cache_t, int HEAD_DIM, int HEADS>
void accumulate_values(const cache_t* __restrict rows, int64_t t0, int64_t t1, int64_t token_stride,
                       const float* __restrict scores, int64_t scores_stride, float* __restrict acc) {
  constexpr int V = HEAD_DIM / kLanes;
  __m512 sums[HEADS][V];
  for (int h = 0; h < HEADS; ++h)
    for (int i = 0; i < V; ++i) sums[h][i] = _mm512_loadu_ps(acc + h * HEAD_DIM + i * kLanes);
  for (int64_t t = t0; t < t1; ++t, rows += token_stride) {
    __m512 v[V];
    for (int i = 0; i < V; ++i) v[i] = roseinfer::kv_lanes(rows, HEAD_DIM, i);
    for (int h = 0; h < HEADS; ++h) {
      const __m512 p = _mm512_set1_ps(scores[h * scores_stride + t]);
      for (int i = 0; i < V; ++i) sums[h][i] = _mm512_fmadd_ps(p, v[i], sums[h][i]);
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + h * HEAD_DIM + i * kLanes, sums[h][i]);
}

#if defined(__AVX512BF16__)
// The same sum for a bfloat16 model over a bfloat16 cache, two tokens per instruction: rows t and
// t + 1 are interleaved element by element into (v_t[d], v_t+1[d]) pairs and multiplied pair-wise
// by (p_t, p_t+1) rounded to bfloat16, as flash attention rounds its probabilities before the
// value product. Half the multiply-adds and no widening of the values; sums stay in float.
// Lanes come out of the interleave permuted; they are put back in order once, at the end.
template <int HEAD_DIM, int HEADS>
void accumulate_values_pairwise(const c10::BFloat16* __restrict rows, int64_t t0, int64_t t1, int64_t token_stride,
                                const float* __restrict scores, int64_t scores_stride, float* __restrict acc) {
  constexpr int C = HEAD_DIM / (2 * kLanes);  // 32-value chunks of a row
  __m512 lo[HEADS][C], hi[HEADS][C];  // lane 4L+i: value 8L+i (lo) or 8L+4+i (hi) of chunk c
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < C; ++c) lo[h][c] = hi[h][c] = _mm512_setzero_ps();
  for (int64_t start = t0; start < t1; start += kLanes) {  // pairs of up to 16 tokens' probabilities at a time
    const int64_t count = std::min<int64_t>(kLanes, t1 - start);
    alignas(64) uint32_t pairs[HEADS][kLanes / 2];  // (p_t, p_t+1) in bfloat16
    for (int h = 0; h < HEADS; ++h) {
      const __m512 p = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), scores + h * scores_stride + start);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[h]), (__m256i)_mm512_cvtneps_pbh(p));
    }
    for (int64_t t = 0; t < count; t += 2, rows += 2 * token_stride) {
      const bool pair = t + 1 < count;  // an odd last token pairs with zeros (its partner's p is 0)
      for (int c = 0; c < C; ++c) {
        const __m512i a = _mm512_loadu_si512(rows + c * 2 * kLanes);
        const __m512i b = pair ? _mm512_loadu_si512(rows + token_stride + c * 2 * kLanes) : _mm512_setzero_si512();
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b), high = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < HEADS; ++h) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[h][t / 2]));
          lo[h][c] = _mm512_dpbf16_ps(lo[h][c], low, p);
          hi[h][c] = _mm512_dpbf16_ps(hi[h][c], high, p);
        }
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < C; ++c) {
      float* a = acc + h * HEAD_DIM + c * 2 * kLanes;
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_permutex2var_ps(lo[h][c], first, hi[h][c])));
      _mm512_storeu_ps(a + kLanes,
                       _mm512_add_ps(_mm512_loadu_ps(a + kLanes), _mm512_permutex2var_ps(lo[h][c], second, hi[h][c])));
    }
}
#endif

template <typename scalar_t, typename cache_t, int HEAD_DIM>
void decode_sequence_avx512(const scalar_t* __restrict q, const cache_t* __restrict k_pool,
                            const cache_t* __restrict v_pool, const int64_t* __restrict block_table,
                            int64_t context_len, int64_t heads, int64_t kv_heads, int64_t pool_kv_heads,
                            int64_t block_size, float scale, int64_t skip, float softcap, scalar_t* __restrict out,
                            std::vector<float>& scores_buffer, std::vector<float>& work) {
  constexpr int V = HEAD_DIM / kLanes;
  constexpr int64_t ROW = roseinfer::kv_row_elements<cache_t>(HEAD_DIM);
  const int64_t group = heads / kv_heads, token_stride = pool_kv_heads * ROW;
  const int64_t padded = (context_len + kLanes - 1) / kLanes * kLanes;
  scores_buffer.resize(heads * padded);
  work.assign(heads * HEAD_DIM * 2 + heads * kLanes * kLanes, 0.0f);
  float* __restrict scores = scores_buffer.data();  // [heads, padded]
  float* __restrict qf = work.data();
  float* __restrict acc = qf + heads * HEAD_DIM;
  float* __restrict partial = acc + heads * HEAD_DIM;  // [heads][16 tokens][16 lanes]
  for (int64_t i = 0; i < heads * HEAD_DIM; ++i) qf[i] = roseinfer::load_float(q + i);
  const __m512 scale_v = _mm512_set1_ps(scale);
  const int64_t blocks = (context_len + block_size - 1) / block_size;
  const int64_t block_elements = block_size * token_stride;
  auto block_rows = [&](const cache_t* pool, int64_t block) { return pool + block_table[block] * block_elements; };

  // Keys in token order, walked block by block (no division per token); each row one block ahead
  // is requested early, since blocks lie anywhere in the pool.
  int64_t block = 0, offset = 0;
  for (int64_t start = 0; start < context_len; start += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, context_len - start);
    for (int64_t i = 0; i < count; ++i) {
      const cache_t* __restrict row = block_rows(k_pool, block) + offset * token_stride;
      if (block + 1 < blocks) prefetch_row(block_rows(k_pool, block + 1) + offset * token_stride, kv_heads * ROW);
      if (++offset == block_size) offset = 0, ++block;
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        const cache_t* __restrict key = row + kv * ROW;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
          // bfloat16 query and keys: 32 products a pair-wise dot instruction, summed in float.
          __m512bh k[V / 2];
          for (int j = 0; j < V / 2; ++j) k[j] = (__m512bh)_mm512_loadu_si512(key + j * 2 * kLanes);
          for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
            const scalar_t* __restrict qh = q + head * HEAD_DIM;
            __m512 dot = _mm512_setzero_ps();
            for (int j = 0; j < V / 2; ++j) dot = _mm512_dpbf16_ps(dot, k[j], (__m512bh)_mm512_loadu_si512(qh + j * 2 * kLanes));
            _mm512_storeu_ps(partial + (head * kLanes + i) * kLanes, dot);
          }
          continue;
        }
#endif
        __m512 k[V];
        for (int j = 0; j < V; ++j) k[j] = roseinfer::kv_lanes(key, HEAD_DIM, j);
        for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
          const float* __restrict qh = qf + head * HEAD_DIM;
          __m512 dot = _mm512_mul_ps(k[0], _mm512_loadu_ps(qh));
          for (int j = 1; j < V; ++j) dot = _mm512_fmadd_ps(k[j], _mm512_loadu_ps(qh + j * kLanes), dot);
          _mm512_storeu_ps(partial + (head * kLanes + i) * kLanes, dot);
        }
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t head = 0; head < heads; ++head)
      _mm512_mask_storeu_ps(scores + head * padded + start, valid,
                            _mm512_mul_ps(scale_v, sum_lanes_of_16(partial + head * kLanes * kLanes)));
  }
  softmax_rows(scores, heads, context_len, padded, skip, softcap);
  // Values block by block, the next block requested while this one is used; within a block, each
  // KV head's query heads in register-sized chunks (HEADS x V accumulators plus V value registers).
  constexpr int kMaxHeads = std::max(1, 16 / V);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks)  // each token's rows of this slice's KV heads (all of the block when it has every head)
      for (int64_t t = 0; t < block_size; ++t) prefetch_row(block_rows(v_pool, b + 1) + t * token_stride, kv_heads * ROW);
    const int64_t t0 = b * block_size, t1 = std::min(context_len, t0 + block_size);
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const cache_t* rows = block_rows(v_pool, b) + kv * ROW;
      for (int64_t first = kv * group; first < (kv + 1) * group; first += kMaxHeads) {
        const int64_t count = std::min<int64_t>(kMaxHeads, (kv + 1) * group - first);
        const float* s = scores + first * padded;
        float* a = acc + first * HEAD_DIM;
        auto sum = [&](auto heads_constant) {
          constexpr int HEADS = decltype(heads_constant)::value;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
            accumulate_values_pairwise<HEAD_DIM, HEADS>(rows, t0, t1, token_stride, s, padded, a);
            return;
          }
#endif
          accumulate_values<cache_t, HEAD_DIM, HEADS>(rows, t0, t1, token_stride, s, padded, a);
        };
        switch (count) {
          case 1: sum(std::integral_constant<int, 1>{}); break;
          case 2: sum(std::integral_constant<int, 2>{}); break;
          case 3: sum(std::integral_constant<int, 3>{}); break;
          default: sum(std::integral_constant<int, kMaxHeads>{}); break;
        }
      }
    }
  }
  for (int64_t i = 0; i < heads * HEAD_DIM; ++i) roseinfer::store_float(out + i, acc[i]);
}
#endif

template <typename scalar_t, typename cache_t>
void decode_dispatch(int64_t head_dim, const scalar_t* q, const cache_t* k, const cache_t* v,
                     const int64_t* table, int64_t len, int64_t heads, int64_t kv_heads, int64_t pool_kv_heads,
                     int64_t block_size, float scale, int64_t skip, float softcap, scalar_t* out,
                     std::vector<float>& scores, std::vector<float>& work) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<cache_t, double>) {  // (a double pool takes the plain loops)
    if (head_dim == 64)
      return decode_sequence_avx512<scalar_t, cache_t, 64>(q, k, v, table, len, heads, kv_heads, pool_kv_heads,
                                                           block_size, scale, skip, softcap, out, scores, work);
    if (head_dim == 128)
      return decode_sequence_avx512<scalar_t, cache_t, 128>(q, k, v, table, len, heads, kv_heads, pool_kv_heads,
                                                            block_size, scale, skip, softcap, out, scores, work);
    if (head_dim == 256)  // Gemma 2 and 3
      return decode_sequence_avx512<scalar_t, cache_t, 256>(q, k, v, table, len, heads, kv_heads, pool_kv_heads,
                                                            block_size, scale, skip, softcap, out, scores, work);
  }
#endif
  switch (head_dim) {
    case 64:
      return decode_sequence<scalar_t, cache_t, 64>(q, k, v, table, len, heads, kv_heads, pool_kv_heads, block_size,
                                                    64, scale, skip, softcap, out, scores, work);
    case 128:
      return decode_sequence<scalar_t, cache_t, 128>(q, k, v, table, len, heads, kv_heads, pool_kv_heads, block_size,
                                                     128, scale, skip, softcap, out, scores, work);
    default:
      return decode_sequence<scalar_t, cache_t, 0>(q, k, v, table, len, heads, kv_heads, pool_kv_heads, block_size,
                                                   head_dim, scale, skip, softcap, out, scores, work);
  }
}

// A sequence's attention limited to its last `window` tokens (0: all of them), the query being the
// last token (Hugging Face's sliding window: key positions > query position - window). The blocks
// wholly before the window are never read; the first block's earlier tokens get zero weight. Only
// KV heads [kv_first, kv_last) and their query heads are computed (a slice of the sequence's work).
template <typename scalar_t, typename cache_t>
void decode_window(int64_t head_dim, const scalar_t* q, const cache_t* k, const cache_t* v, const int64_t* table,
                   int64_t len, int64_t heads, int64_t kv_heads, int64_t kv_first, int64_t kv_last,
                   int64_t block_size, float scale, int64_t window, float softcap, scalar_t* out,
                   std::vector<float>& scores, std::vector<float>& work) {
  const int64_t first = window > 0 && len > window ? len - window : 0;
  const int64_t first_block = first / block_size, start = first_block * block_size;
  const int64_t group = heads / kv_heads, row = roseinfer::kv_row_elements<cache_t>(head_dim);
  const int64_t q_offset = kv_first * group * head_dim;
  decode_dispatch<scalar_t, cache_t>(head_dim, q + q_offset, k + kv_first * row, v + kv_first * row,
                                     table + first_block, len - start, (kv_last - kv_first) * group,
                                     kv_last - kv_first, kv_heads, block_size, scale, first - start, softcap,
                                     out + q_offset, scores, work);
}

}  // namespace

namespace roseinfer {

template <typename scalar_t, typename cache_t>
void paged_attention_heads(const scalar_t* q, const cache_t* k_pool, const cache_t* v_pool,
                           const int64_t* block_table, int64_t context_len, int64_t heads, int64_t kv_heads,
                           int64_t kv_first, int64_t kv_last, int64_t block_size, int64_t head_dim, float scale,
                           scalar_t* out, std::vector<float>& scores, std::vector<float>& work, int64_t window,
                           float softcap) {
  DenormalsAreZero flush;
  decode_window<scalar_t, cache_t>(head_dim, q, k_pool, v_pool, block_table, context_len, heads, kv_heads, kv_first,
                                   kv_last, block_size, scale, window, softcap, out, scores, work);
}

#define ROSEINFER_ATTENTION(scalar_t, cache_t)                                                                  \
  template void paged_attention_heads<scalar_t, cache_t>(const scalar_t*, const cache_t*, const cache_t*,        \
                                                         const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                                         int64_t, int64_t, float, scalar_t*, std::vector<float>&,     \
                                                         std::vector<float>&, int64_t, float);
ROSEINFER_ATTENTION(float, float)
ROSEINFER_ATTENTION(float, c10::BFloat16)
ROSEINFER_ATTENTION(float, c10::Half)
ROSEINFER_ATTENTION(float, int8_t)
ROSEINFER_ATTENTION(c10::BFloat16, c10::BFloat16)
ROSEINFER_ATTENTION(c10::BFloat16, int8_t)
#undef ROSEINFER_ATTENTION

}  // namespace roseinfer

namespace {

template <typename scalar_t, typename cache_t>
void decode_batch(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, float scale,
                  int64_t window, float softcap, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2), q_stride = q.stride(0);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_pool.data_ptr<cache_t>();
  const cache_t* v_ptr = v_pool.data_ptr<cache_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lengths = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t slices = roseinfer::kv_head_slices(batch, kv_heads);
  at::parallel_for(0, batch * slices, 1, [&](int64_t begin, int64_t end) {
    DenormalsAreZero flush;
    std::vector<float> scores, work;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / slices;
      const auto [first, last] = roseinfer::kv_head_slice(kv_heads, slices, task % slices);
      decode_window<scalar_t, cache_t>(head_dim, q_ptr + b * q_stride, k_ptr, v_ptr, tables + b * max_blocks,
                                       lengths[b], heads, kv_heads, first, last, block_size, scale, window, softcap,
                                       out_ptr + b * heads * head_dim, scores, work);
    }
  });
}

}  // namespace

// q: [batch, heads, head_dim], each row's heads contiguous (rows may be strided: the q part of a
// fused qkv output is read in place); k_pool, v_pool: [blocks, block_size, kv_heads, head_dim];
// block_tables: [batch, max_blocks] int64; context_lens: [batch] int64. Returns [batch, heads, head_dim].
// window > 0: each row attends to its last `window` tokens only (a sliding-window layer); softcap > 0:
// scores are soft-capped (softcap * tanh(score / softcap)) before the softmax.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_pool.size(2);
  const bool q8_0 = k_pool.scalar_type() == torch::kChar;  // --kv-cache-dtype q8_0: see kv_row_elements
  TORCH_CHECK(k_pool.size(3) == roseinfer::pool_row_elements(q8_0, head_dim) && heads % kv_heads == 0,
              "head counts or sizes do not match");
  auto out = torch::empty({q.size(0), heads, head_dim}, q.options());
  const float scale_f = static_cast<float>(scale), softcap_f = static_cast<float>(softcap);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  if (q8_0) {
    TORCH_CHECK(v_pool.scalar_type() == torch::kChar, "keys and values must share a dtype");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      decode_batch<scalar_t, int8_t>(q, k_pool, v_pool, block_tables, context_lens, scale_f, window, softcap_f, out);
    });
  } else if (k_pool.scalar_type() == q.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      decode_batch<scalar_t, scalar_t>(q, k_pool, v_pool, block_tables, context_lens, scale_f, window, softcap_f, out);
    });
  } else {  // a float32 model over a 16-bit cache (--kv-cache-dtype)
    TORCH_CHECK(q.scalar_type() == torch::kFloat && v_pool.scalar_type() == k_pool.scalar_type(),
                "a KV pool of another dtype than q: q must be float32");
    AT_DISPATCH_REDUCED_FLOATING_TYPES(k_pool.scalar_type(), "paged_decode_attention", [&] {
      decode_batch<float, scalar_t>(q, k_pool, v_pool, block_tables, context_lens, scale_f, window, softcap_f, out);
    });
  }
  return out;
}

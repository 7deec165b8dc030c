// What the kernels' source files share with one another: storage-type conversions, and the
// attention and linear kernels that the fused decode step calls directly, without going through
// PyTorch's dispatcher.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace roseinfer {

// Conversions the compiler can vectorise: c10's float -> bfloat16 rounding checks for NaN first,
// which keeps the loops around it scalar (rotary: 7x slower here). Round to nearest even; no NaNs arise.
template <typename scalar_t>
inline float load_float(const scalar_t* p) {
  return static_cast<float>(*p);
}
template <>
inline float load_float<c10::BFloat16>(const c10::BFloat16* p) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(p->x) << 16);
}
template <typename scalar_t>
inline void store_float(scalar_t* p, float value) {
  *p = static_cast<scalar_t>(value);
}
template <>
inline void store_float<c10::BFloat16>(c10::BFloat16* p, float value) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, value);
  p->x = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
// 16 values of a storage type as floats, and back (rounded to nearest even, as store_float).
template <typename scalar_t>
inline __m512 load16(const scalar_t* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename scalar_t>
inline void store16(scalar_t* p, __m512 v);
template <>
inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// v's bits rounded to nearest even at bfloat16 precision: the high 16 bits of each lane are the result.
inline __m512i bfloat16_rounded_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
}
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bfloat16_rounded_bits(v), 16)));
}
template <>
inline void store16<c10::Half>(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// The KV pool's rows. A row is one token's values of one KV head: head_dim values of the pool's
// type, or, for llama.cpp's q8_0 cache (`--kv-cache-dtype q8_0`, an int8 pool), head_dim int8 codes
// followed by one float16 scale per 32 of them (head_dim + head_dim / 16 bytes; value = code * scale).
template <typename cache_t>
constexpr int64_t kv_row_elements(int64_t head_dim) {
  return std::is_same_v<cache_t, int8_t> ? head_dim + head_dim / 16 : head_dim;
}
// The row length of a pool for heads of head_dim values (a q8_0 pool: int8).
inline int64_t pool_row_elements(bool q8_0, int64_t head_dim) {
  TORCH_CHECK(!q8_0 || head_dim % 32 == 0, "a q8_0 KV pool needs a head size that is a multiple of 32");
  return q8_0 ? kv_row_elements<int8_t>(head_dim) : head_dim;
}
inline float q8_row_scale(const int8_t* row, int64_t head_dim, int64_t block) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim + 2 * block, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
// Value d of a row.
template <typename cache_t>
inline float kv_value(const cache_t* row, int64_t head_dim, int64_t d) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    return static_cast<float>(row[d]) * q8_row_scale(row, head_dim, d / 32);
  } else {
    return load_float(row + d);
  }
}
inline float exact_reciprocal(float x) {
#if defined(__AVX512F__)
  return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(1.0f), _mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return 1.0f / x;
#endif
}
// A row stored from head_dim values of `src`: rounded to the pool's type, or quantized as llama.cpp's
// quantize_row_q8_0 does (scale = max|x| / 127 per 32, codes = round(x / scale); the scale kept in float16).
template <typename cache_t, typename scalar_t>
inline void store_kv_row(cache_t* __restrict dst, const scalar_t* __restrict src, int64_t head_dim) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    for (int64_t b = 0; b < head_dim / 32; ++b) {
      float amax = 0.0f;
      for (int64_t i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(load_float(src + b * 32 + i)));
      // The PyTorch path (attention.kv_rows) must store the same bytes: times 1/127 rather than
      // / 127 (-ffast-math may rewrite a division by a constant), and a true 1 / scale (under
      // -ffast-math GCC computes it with an approximate reciprocal and a Newton step, 1 ulp off).
      const float scale = amax * (1.0f / 127.0f), inverse = scale > 0.0f ? exact_reciprocal(scale) : 0.0f;
      for (int64_t i = 0; i < 32; ++i)
        dst[b * 32 + i] = static_cast<int8_t>(std::nearbyint(load_float(src + b * 32 + i) * inverse));
      const uint16_t bits = c10::Half(scale).x;
      std::memcpy(dst + head_dim + 2 * b, &bits, sizeof(bits));
    }
  } else if constexpr (std::is_same_v<cache_t, scalar_t>) {
    std::memcpy(dst, src, head_dim * sizeof(cache_t));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < head_dim; ++i) store_float(dst + i, static_cast<float>(src[i]));
  }
}
#if defined(__AVX512F__)
// Values 16j .. 16j + 15 of a row as floats.
template <typename cache_t>
inline __m512 kv_lanes(const cache_t* row, int64_t head_dim, int64_t j) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    const __m512 codes =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))));
    return _mm512_mul_ps(codes, _mm512_set1_ps(q8_row_scale(row, head_dim, j / 2)));
  } else {
    return load16(row + 16 * j);
  }
}
#endif

// In place: one token's heads [heads, head_dim], adjacent pairs (x0, x1) rotated by the token's
// angles, given as (cos, sin) per pair. Shared by the rotary kernel and the fused decode step, which
// are fed the same (cos, sin), so that both paths rotate alike.
template <typename scalar_t>
inline void rotate_heads(scalar_t* __restrict x, int64_t heads, int64_t head_dim, const float* __restrict cos_sin) {
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* __restrict head = x + h * head_dim;
#pragma omp simd
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const float a = load_float(head + 2 * i), b = load_float(head + 2 * i + 1);
      const float c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
      // Explicit fused multiply-adds: every caller rounds alike, whatever the compiler would
      // contract where it is inlined.
      store_float(head + 2 * i, std::fma(a, c, -(b * s)));
      store_float(head + 2 * i + 1, std::fma(a, s, b * c));
    }
  }
}

// One sequence's decode attention over the paged pool (float32, bfloat16 or half storage) for its KV
// heads [kv_first, kv_last) and their query heads: q [heads, head_dim] (unscaled) -> those heads of
// out [heads, head_dim] (the others untouched). The buffers are scratch space reused
// between calls. Queries and outputs are float32 over any pool, or bfloat16 over a bfloat16 or
// q8_0 pool (a bfloat16 model), as paged_decode_attention takes them.
// (A q8_0 pool is int8_t here: see kv_row_elements.) window > 0: the last `window` tokens only;
// softcap > 0: scores soft-capped before the softmax (see paged_decode_attention).
template <typename scalar_t, typename cache_t>
void paged_attention_heads(const scalar_t* q, const cache_t* k_pool, const cache_t* v_pool,
                           const int64_t* block_table, int64_t context_len, int64_t heads, int64_t kv_heads,
                           int64_t kv_first, int64_t kv_last, int64_t block_size, int64_t head_dim, float scale,
                           scalar_t* out, std::vector<float>& scores, std::vector<float>& work, int64_t window = 0,
                           float softcap = 0.0f);

// Slices of KV heads per sequence for a decode batch of `batch` sequences: enough that every thread
// has work (one sequence would otherwise attend on one thread while the others wait), else 1.
inline int64_t kv_head_slices(int64_t batch, int64_t kv_heads) {
  const int64_t threads = at::get_num_threads();
  if (batch <= 0 || batch >= threads) return 1;
  return std::min(kv_heads, (threads + batch - 1) / batch);
}

// The KV heads [first, last) of slice `slice` of a sequence's `slices` (sizes differing by at most 1).
inline std::pair<int64_t, int64_t> kv_head_slice(int64_t kv_heads, int64_t slices, int64_t slice) {
  return {kv_heads * slice / slices, kv_heads * (slice + 1) / slices};
}

// A zero tensor for a weight kept for the model's life, in 2 MiB pages where the kernel lends them
// (weight_memory_cpu.cpp): never for temporaries.
torch::Tensor lasting_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

// out [M, N] = x [M, K] @ w.T + bias for a weight packed by pack_panels (panel_linear_cpu.cpp), in
// parallel over the panels; bias: nullptr, or float32 over the packed columns. Only where
// panel_linear_dtypes() lists the type.
void panel_matmul(const float* x, int64_t M, int64_t K, const float* panels, int64_t panel_count,
                  const float* bias, int64_t N, float* out);
void panel_matmul(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* panels, int64_t panel_count,
                  const float* bias, int64_t N, c10::BFloat16* out);

// Every row of x [M, K] (rows ldx apart) against one panel of pack_panels' layout ([K / S][48][S]),
// on the calling thread: out[m * N + c] for the panel's first `columns` columns, float32
// (unrounded), or added to it (`accumulate`: a panel of a slice of the inputs).
void panel_rows(const float* x, int64_t M, int64_t K, int64_t ldx, const float* panel, float* out, int64_t N,
                int64_t columns, bool accumulate);
void panel_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t ldx, const c10::BFloat16* panel, float* out,
                int64_t N, int64_t columns, bool accumulate);
bool has_panel_kernel(c10::ScalarType dtype);
constexpr int64_t kPanelWidth = 48;  // output columns per panel (panel_linear_cpu.cpp)

// out [M, N] (rows ldo apart) = x [M, K] @ w.T for a GGUF-typed weight in the kernels' layout
// (gguf_linear_cpu.cpp), in parallel over N. exact: float activations throughout (products of the
// exact weights); else 8-bit activations for small batches (VNNI builds) and bfloat16 products for
// large ones (builds with AVX512-BF16), as llama.cpp trades exactness for speed.
void gguf_matmul(int type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int64_t ldo,
                 bool exact);
// One product of gguf_matmul's: out [M, N] (rows ldo apart) = x [M, K] @ w.T.
struct GgufProduct {
  int type;
  const float* x;
  int64_t M, K;
  const uint8_t* w;
  int64_t N;
  float* out;
  int64_t ldo;
};
// Several independent products (a mixture of experts' chosen experts) in one parallel region, each
// computed as gguf_matmul computes it: the threads share all their rows, where one call per
// product would start and join the threads for each. (Large or exact products: one call each.)
void gguf_matmul_group(const std::vector<GgufProduct>& products, bool exact);
// Fails with a message unless `part` is a packed weight of kernel type `type` with rows of K values.
void gguf_check(const torch::Tensor& part, int64_t type, int64_t K);

// Rows begin .. end of x [rows, dim]: out = x / rms(x) * weight, the sum of squares in float
// whatever the storage type (norm_cpu.cpp, and the fused decode step). x and out may not overlap.
template <typename scalar_t>
void norm_rows(const scalar_t* __restrict in, const scalar_t* __restrict weight, scalar_t* __restrict out,
               int64_t begin, int64_t end, int64_t dim, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* __restrict row = in + r * dim;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; ++d) squares += load_float(row + d) * load_float(row + d);
    const float inv_rms = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
    scalar_t* __restrict dst = out + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) store_float(dst + d, load_float(row + d) * inv_rms * load_float(weight + d));
  }
}

// Rows begin .. end: residual += x, rounded to the storage type as the unfused `residual + x`.
template <typename scalar_t>
void add_rows(scalar_t* __restrict residual, const scalar_t* __restrict x, int64_t begin, int64_t end, int64_t dim) {
#pragma omp simd
  for (int64_t i = begin * dim; i < end * dim; ++i) store_float(residual + i, load_float(residual + i) + load_float(x + i));
}

// Rows per parallel task of the elementwise passes: enough work per task that threads are not
// started for a handful of rows.
constexpr int64_t kNormRowsPerTask = 16;
constexpr int64_t kActivationRowsPerTask = 8;

// norm_rows over all rows, in parallel.
template <typename scalar_t>
void norm_rows_in_parallel(const scalar_t* in, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t dim,
                           float eps) {
  at::parallel_for(0, rows, kNormRowsPerTask,
                   [&](int64_t begin, int64_t end) { norm_rows<scalar_t>(in, weight, out, begin, end, dim, eps); });
}

// residual += x, then out = rms_norm(residual) * weight, each task's rows in both passes while in
// cache (out may be x).
template <typename scalar_t>
void add_and_norm_rows_in_parallel(scalar_t* residual, const scalar_t* x, const scalar_t* weight, scalar_t* out,
                                   int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kNormRowsPerTask, [&](int64_t begin, int64_t end) {
    add_rows<scalar_t>(residual, x, begin, end, dim);
    norm_rows<scalar_t>(residual, weight, out, begin, end, dim, eps);
  });
}

#if defined(__AVX512F__)
// v rounded to scalar_t's precision (nearest even), kept as floats.
template <typename scalar_t>
inline __m512 rounded_to(__m512 v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_and_si512(bfloat16_rounded_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return v;
  }
}
#endif

// The gate activations of gated MLPs, each as PyTorch's CPU kernel computes it in float: `vector`
// on AVX-512 builds (the same Sleef calls as PyTorch's vectorised kernels, so bit for bit) and
// `scalar` for a row's tail (and every element elsewhere), where PyTorch takes the scalar libm call.
struct Silu {  // x / (1 + exp(-x))
#if defined(__AVX512F__)
  static __m512 vector(__m512 x) {
    // (A division with an explicit rounding mode: -ffast-math would make a plain one an
    // approximate reciprocal, which rounds differently.)
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_round_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x))),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
#endif
  static float scalar(float x) { return x / (1.0f + std::exp(-x)); }
};

struct GeluTanh {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in PyTorch's order
  static constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kKappa = 0.044715f;
#if defined(__AVX512F__)
  static __m512 vector(__m512 x) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kBeta), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kKappa), cube)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_tanhf16_u10(inner)));
  }
#endif
  static float scalar(float x) { return 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * (x * x * x)))); }
};

// Rows begin .. end of in [rows, 2 * width] (gate, then up): out [rows, width] = Act(gate) * up,
// rounded as PyTorch's op-by-op path rounds them: the activation in float, rounded to the storage
// type (as its separate kernel leaves it), then the product in float, rounded again.
template <typename Act, typename scalar_t>
void gated_rows(const scalar_t* __restrict in, scalar_t* __restrict out, int64_t width, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* __restrict gate = in + r * 2 * width;
    const scalar_t* __restrict up = gate + width;
    scalar_t* __restrict dst = out + r * width;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= width; i += 16)
      store16(dst + i, _mm512_mul_ps(rounded_to<scalar_t>(Act::vector(load16(gate + i))), load16(up + i)));
#endif
    for (; i < width; ++i) {
      scalar_t activated;
      store_float(&activated, Act::scalar(load_float(gate + i)));
      store_float(dst + i, load_float(&activated) * load_float(up + i));
    }
  }
}

// gated_rows over all rows, in parallel: SwiGLU, or GeGLU (tanh approximation) where `gelu`.
template <typename scalar_t>
void gated_activation_in_parallel(const scalar_t* in, scalar_t* out, int64_t width, int64_t rows, bool gelu = false) {
  at::parallel_for(0, rows, kActivationRowsPerTask, [&](int64_t begin, int64_t end) {
    if (gelu) {
      gated_rows<GeluTanh>(in, out, width, begin, end);
    } else {
      gated_rows<Silu>(in, out, width, begin, end);
    }
  });
}

// SiLU(gate) * up over all rows, in parallel.
template <typename scalar_t>
void silu_and_mul_in_parallel(const scalar_t* in, scalar_t* out, int64_t width, int64_t rows) {
  gated_activation_in_parallel(in, out, width, rows);
}

}  // namespace roseinfer

// What the kernels' source files share with one another: storage-type conversions, and the
// attention and linear kernels that the fused decode step calls directly, without going through
// PyTorch's dispatcher.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
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

// One sequence's decode attention over the paged pool (float32, bfloat16 or half storage): q
// [heads, head_dim] (unscaled) -> out [heads, head_dim]. The buffers are scratch space reused
// between calls.
template <typename cache_t>
void paged_attention_sequence(const float* q, const cache_t* k_pool, const cache_t* v_pool, const int64_t* block_table,
                              int64_t context_len, int64_t heads, int64_t kv_heads, int64_t block_size,
                              int64_t head_dim, float scale, float* out, std::vector<float>& scores,
                              std::vector<float>& work);

// out [M, N] = x [M, K] @ w.T for blocked weights (see quant_linear_cpu.cpp), in parallel over N.
// xsums: scratch of at least M * K / 32 floats (q4 only).
void q4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales, const float* mins,
               int64_t N, float* xsums, float* out);
// quantize_x: on VNNI builds, quantize x to 8 bits per block of 32 and multiply bytes (faster where
// converting codes bounds the product); off, float activations (exact; the LM head, which is bound
// by reading its weights either way).
void q8_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales, int64_t N,
               float* out, bool quantize_x);

}  // namespace roseinfer

// Block-quantized linear layers for small batches on the CPU: weights stay in GGUF-style blocks of
// 32 along the input dimension and are expanded to float in registers, activations stay in float.
//
//   q4: 4-bit codes with a scale and a minimum per block (GGUF's Q4_1): w = scale * q + minimum.
//       Byte j of a block holds element j in its low nibble and element j + 16 in its high nibble.
//   q8: 8-bit signed codes with a scale per block (GGUF's Q8_0): w = scale * q.
//
// At decode batch sizes a linear layer is a matrix-vector product that should be bound by reading
// the weights: 5 (q4) or 8.5 (q8) bits a weight instead of 32 is what makes a token fast. Each weight row is
// read once for all the batch's rows (up to kTile at a time), so a few rows cost little more than
// one. dot(w, x) = scale * dot(q, x) + minimum * sum(x) per block: the minimums' part needs only
// the block sums of x, computed once per call.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;  // batch rows computed together against one pass over a weight row

#if defined(__AVX512F__)
inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// out[m][n] for rows m in [m0, m0 + tile) of x and weight rows n in [n0, n1).
template <int TILE>
void q4_rows(const float* __restrict x, const float* __restrict xsums, const uint8_t* __restrict codes,
             const float* __restrict scales, const float* __restrict mins, float* __restrict out, int64_t m0,
             int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* __restrict row = codes + n * (K / 2);
    const float* __restrict s = scales + n * blocks;
    const float* __restrict mn = mins + n * blocks;
    float result[TILE];
#if defined(__AVX512F__)
    __m512 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, low_mask)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), low_mask)));
      const __m512 scale = _mm512_set1_ps(s[b]);
      for (int t = 0; t < TILE; ++t) {
        const float* xb = x + (m0 + t) * K + b * kBlock;
        const __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
        acc[t] = _mm512_fmadd_ps(scale, dot, acc[t]);
      }
    }
    for (int t = 0; t < TILE; ++t) result[t] = reduce(acc[t]);
#else
    for (int t = 0; t < TILE; ++t) result[t] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* q = row + b * 16;
      for (int t = 0; t < TILE; ++t) {
        const float* xb = x + (m0 + t) * K + b * kBlock;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j < 16; ++j) dot += static_cast<float>(q[j] & 0x0F) * xb[j] + static_cast<float>(q[j] >> 4) * xb[j + 16];
        result[t] += s[b] * dot;
      }
    }
#endif
    for (int t = 0; t < TILE; ++t) {
      const float* xs = xsums + (m0 + t) * blocks;
      float minimums = 0.0f;
#pragma omp simd reduction(+ : minimums)
      for (int64_t b = 0; b < blocks; ++b) minimums += mn[b] * xs[b];
      out[(m0 + t) * N + n] = result[t] + minimums;
    }
  }
}

template <int TILE>
void q8_rows(const float* __restrict x, const int8_t* __restrict codes, const float* __restrict scales,
             float* __restrict out, int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* __restrict row = codes + n * K;
    const float* __restrict s = scales + n * blocks;
    float result[TILE];
#if defined(__AVX512F__)
    __m512 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock))));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock + 16))));
      const __m512 scale = _mm512_set1_ps(s[b]);
      for (int t = 0; t < TILE; ++t) {
        const float* xb = x + (m0 + t) * K + b * kBlock;
        const __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xb)));
        acc[t] = _mm512_fmadd_ps(scale, dot, acc[t]);
      }
    }
    for (int t = 0; t < TILE; ++t) result[t] = reduce(acc[t]);
#else
    for (int t = 0; t < TILE; ++t) result[t] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* q = row + b * kBlock;
      for (int t = 0; t < TILE; ++t) {
        const float* xb = x + (m0 + t) * K + b * kBlock;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j < kBlock; ++j) dot += static_cast<float>(q[j]) * xb[j];
        result[t] += s[b] * dot;
      }
    }
#endif
    for (int t = 0; t < TILE; ++t) out[(m0 + t) * N + n] = result[t];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ROSEINFER_VNNI 1
// With VNNI the activations are quantized too, to 8 bits per block of 32 (a scale per block, as
// llama.cpp's Q8 activations), and each block's dot product is integer multiply-adds on bytes:
// one instruction does 64 of them, where expanding 4-bit codes to float lanes costs several per 16.
// Expanding the codes was what bounded the float path, not reading the weights.

// Quantize one block of a row (32 floats) to int8 codes; returns the scale, and the codes' sum
// where `code_sum` is given (the 4-bit kernel's centring needs it, the 8-bit one does not).
inline float quantize_block(const float* __restrict xb, __m128i& low, __m128i& high, int* code_sum) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  low = _mm512_cvtsepi32_epi8(qa);
  high = _mm512_cvtsepi32_epi8(qb);
  if (code_sum) *code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return amax / 127.0f;
}

// Activations for the 4-bit kernel, per row: groups of 4 blocks as 128 bytes, the 4 blocks' first
// halves (elements 0-15) then their second halves, which is how one 64-byte load of packed codes
// splits into low and high nibbles. Missing blocks of the last group are zero.
// Also, per block, 8 * (sum(x) - sum(quantized x)): the kernel multiplies the codes as they are
// (0..15), but the rounding error it makes is that of codes centred on 8, half the size, once this
// term (times the block's scale) is added back; see q4_rows_vnni.
void quantize_for_q4(const float* x, const float* xsums, int64_t M, int64_t K, int8_t* q, float* d,
                     float* centring) {
  const int64_t blocks = K / kBlock, groups = (blocks + 3) / 4;
  for (int64_t m = 0; m < M; ++m) {
    int8_t* qm = q + m * groups * 128;
    float* dm = d + m * groups * 4;
    std::fill(qm, qm + groups * 128, 0);
    std::fill(dm, dm + groups * 4, 0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      __m128i low, high;
      int code_sum;
      dm[b] = quantize_block(x + m * K + b * kBlock, low, high, &code_sum);
      centring[m * blocks + b] = 8.0f * (xsums[m * blocks + b] - dm[b] * static_cast<float>(code_sum));
      int8_t* dst = qm + (b / 4) * 128 + (b % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), low);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64), high);
    }
  }
}

// Activations for the 8-bit kernel, per row: the blocks in order, each code plus 128 as an unsigned
// byte (VNNI multiplies unsigned by signed bytes; the weights are the signed side), padded to whole
// pairs of blocks with codes of zero.
void quantize_for_q8(const float* x, int64_t M, int64_t K, uint8_t* q, float* d) {
  const int64_t blocks = K / kBlock, pairs = (blocks + 1) / 2;
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* qm = q + m * pairs * 64;
    float* dm = d + m * pairs * 2;
    std::fill(qm, qm + pairs * 64, 0x80);
    std::fill(dm, dm + pairs * 2, 0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      __m128i low, high;
      dm[b] = quantize_block(x + m * K + b * kBlock, low, high, nullptr);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qm + b * kBlock), _mm_xor_si128(low, flip));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qm + b * kBlock + 16), _mm_xor_si128(high, flip));
    }
  }
}

// out[m][n] = sum over blocks of scale_w * (scale_x * dot(codes, xq) + centring) + minimum_w * sum(x):
// exactly w.x for the quantized x plus scale_w * sum((codes - 8) * (x - quantized x)).
template <int TILE>
void q4_rows_vnni(const int8_t* __restrict xq, const float* __restrict xd, const float* __restrict xsums,
                  const float* __restrict centring,
                  const uint8_t* __restrict codes, const float* __restrict scales, const float* __restrict mins,
                  float* __restrict out, int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock, groups = (blocks + 3) / 4, tail = blocks - (groups - 1) * 4;
  const __mmask64 tail_bytes = tail == 4 ? ~0ULL : (1ULL << (tail * 16)) - 1;
  const __mmask8 tail_scales = static_cast<__mmask8>((1u << tail) - 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* __restrict row = codes + n * (K / 2);
    const float* __restrict s = scales + n * blocks;
    __m512 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const bool last = g == groups - 1;
      const __m512i packed = last ? _mm512_maskz_loadu_epi8(tail_bytes, row + g * 64) : _mm512_loadu_si512(row + g * 64);
      const __m128 sw = last ? _mm_maskz_loadu_ps(tail_scales, s + g * 4) : _mm_loadu_ps(s + g * 4);
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      for (int t = 0; t < TILE; ++t) {
        const int8_t* xg = xq + (m0 + t) * groups * 128 + g * 128;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xg));
        dot = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(xg + 64));
        const __m128 scale = _mm_mul_ps(sw, _mm_loadu_ps(xd + (m0 + t) * groups * 4 + g * 4));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale)),
                                 acc[t]);
      }
    }
    const float* __restrict mn = mins + n * blocks;
    for (int t = 0; t < TILE; ++t) {
      const float *xs = xsums + (m0 + t) * blocks, *xc = centring + (m0 + t) * blocks;
      float corrections = 0.0f;
#pragma omp simd reduction(+ : corrections)
      for (int64_t b = 0; b < blocks; ++b) corrections += mn[b] * xs[b] + s[b] * xc[b];
      out[(m0 + t) * N + n] = reduce(acc[t]) + corrections;
    }
  }
}

// out[m][n] = sum over blocks of scale_w * scale_x * (dot(xq + 128, w) - dot(128, w)).
template <int TILE>
void q8_rows_vnni(const uint8_t* __restrict xq, const float* __restrict xd, const int8_t* __restrict codes,
                  const float* __restrict scales, float* __restrict out, int64_t m0, int64_t n0, int64_t n1,
                  int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock, pairs = (blocks + 1) / 2;
  const bool odd = blocks % 2;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* __restrict row = codes + n * K;
    const float* __restrict s = scales + n * blocks;
    __m512 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const bool half = odd && p == pairs - 1;
      const __m512i w = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, row + p * 64) : _mm512_loadu_si512(row + p * 64);
      const __m128 sw = half ? _mm_maskz_loadu_ps(1, s + p * 2) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s + p * 2)));
      const __m512i bias = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w);
      for (int t = 0; t < TILE; ++t) {
        const __m512i dot = _mm512_sub_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xq + (m0 + t) * pairs * 64 + p * 64), w), bias);
        const __m128 scale = _mm_mul_ps(sw, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xd + (m0 + t) * pairs * 2 + p * 2))));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale)),
                                 acc[t]);
      }
    }
    for (int t = 0; t < TILE; ++t) out[(m0 + t) * N + n] = reduce(acc[t]);
  }
}
#endif

// `count` 8-bit blocks (codes times their scale) as floats: the dequantized weight.
inline void expand_q8_blocks(const int8_t* __restrict codes, const float* __restrict scales, int64_t count,
                             float* __restrict out) {
  for (int64_t i = 0; i < count; ++i) {
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) out[i * kBlock + j] = scales[i] * static_cast<float>(codes[i * kBlock + j]);
  }
}

#if defined(__AVX512F__)
// Float activations against 8-bit blocks for many rows (the LM head at batch sizes): a matrix
// product, not a dot product per output. The batch is transposed once (x^T, columns padded to
// whole vectors of 16 rows); each group of kWeightRows weight rows is expanded once to float
// (codes times scale: exactly the dequantized weight) and every step k multiplies each expanded
// weight, broadcast, by 16 batch rows at a time. No horizontal sums, and each block is expanded
// once per call instead of once per tile of rows, which is what made the dot-product kernel slower
// than a prepacked float32 matrix product past ~16 rows.
constexpr int64_t kGemmRows = 32;  // from here on q8_gemm beats the dot-product kernel
constexpr int kWeightRows = 6;  // 6 weight rows x 4 vectors of 16 batch rows = 24 accumulators
constexpr int kBatchVectors = 4;
constexpr int64_t kPanelRows = 16 * kWeightRows;  // weight rows whose outputs are gathered before storing
constexpr int64_t kGemmMaxRows = 128;  // batch rows per pass over the weights

template <int R, int V>
void q8_gemm_tile(const float* __restrict xt, int64_t mpad, const float* __restrict w, int64_t K, int64_t m0,
                  int64_t M, int64_t n, int64_t N, float* __restrict out) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + k * mpad + m0 + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 wk = _mm512_set1_ps(w[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wk, xv[v], acc[r][v]);
    }
  }
  alignas(64) float lanes[16];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      _mm512_store_ps(lanes, acc[r][v]);
      const int64_t first = m0 + v * 16, count = std::min<int64_t>(16, M - first);
      for (int64_t i = 0; i < count; ++i) out[(first + i) * N + n + r] = lanes[i];
    }
}

template <int R>
void q8_gemm_rows(const float* xt, int64_t mpad, const float* w, int64_t K, int64_t M, int64_t n, int64_t N,
                  float* out) {
  constexpr int64_t chunk = kBatchVectors * 16;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    switch ((std::min(chunk, M - m0) + 15) / 16) {
      case 1: q8_gemm_tile<R, 1>(xt, mpad, w, K, m0, M, n, N, out); break;
      case 2: q8_gemm_tile<R, 2>(xt, mpad, w, K, m0, M, n, N, out); break;
      case 3: q8_gemm_tile<R, 3>(xt, mpad, w, K, m0, M, n, N, out); break;
      default: q8_gemm_tile<R, 4>(xt, mpad, w, K, m0, M, n, N, out); break;
    }
  }
}

void q8_gemm(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales, int64_t N,
             float* out) {
  if (M > kGemmMaxRows) {  // so that x^T stays in the core's cache while every weight row reads it
    for (int64_t m0 = 0; m0 < M; m0 += kGemmMaxRows)
      q8_gemm(x + m0 * K, std::min(kGemmMaxRows, M - m0), K, codes, scales, N, out + m0 * N);
    return;
  }
  const int64_t blocks = K / kBlock, mpad = (M + 15) / 16 * 16;
  std::vector<float> xt(K * mpad, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * mpad + m] = x[m * K + k];
  const float* xtp = xt.data();
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, std::max<int64_t>(1, panels / (8 * at::get_num_threads())), [&](int64_t p0, int64_t p1) {
    std::vector<float> w(kWeightRows * K), tile(M * kPanelRows);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t first = p * kPanelRows, width = std::min<int64_t>(kPanelRows, N - first);
      for (int64_t n = 0; n < width; n += kWeightRows) {
        const int64_t rows = std::min<int64_t>(kWeightRows, width - n);
        expand_q8_blocks(codes + (first + n) * K, scales + (first + n) * blocks, rows * blocks, w.data());
        float* t = tile.data();
        switch (rows) {
          case 1: q8_gemm_rows<1>(xtp, mpad, w.data(), K, M, n, kPanelRows, t); break;
          case 2: q8_gemm_rows<2>(xtp, mpad, w.data(), K, M, n, kPanelRows, t); break;
          case 3: q8_gemm_rows<3>(xtp, mpad, w.data(), K, M, n, kPanelRows, t); break;
          case 4: q8_gemm_rows<4>(xtp, mpad, w.data(), K, M, n, kPanelRows, t); break;
          case 5: q8_gemm_rows<5>(xtp, mpad, w.data(), K, M, n, kPanelRows, t); break;
          default: q8_gemm_rows<kWeightRows>(xtp, mpad, w.data(), K, M, n, kPanelRows, t); break;
        }
      }
      // The panel's outputs leave in whole rows: written straight from the tiles, the outputs of
      // one weight row are a column of [M, N] whose addresses, N floats apart, collide in the cache.
      for (int64_t m = 0; m < M; ++m) std::copy_n(tile.data() + m * kPanelRows, width, out + m * N + first);
    }
  });
}
#endif

// Weight rows per parallel task: enough to amortise a task, few enough to keep both cores busy.
int64_t grain(int64_t N) { return std::max<int64_t>(16, N / (4 * at::get_num_threads())); }

template <typename RowFn>
void over_tiles(int64_t M, int64_t N, RowFn rows) {
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows(std::integral_constant<int, 4>{}, m, n0, n1);
    for (; m + 2 <= M; m += 2) rows(std::integral_constant<int, 2>{}, m, n0, n1);
    for (; m < M; ++m) rows(std::integral_constant<int, 1>{}, m, n0, n1);
  });
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K,
              "x must be a float32 CPU matrix with ", K, " columns");
  TORCH_CHECK(K % kBlock == 0, "the input dimension must be a multiple of ", kBlock);
}

}  // namespace

namespace roseinfer {

void q4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales, const float* mins,
               int64_t N, float* xsums, float* out) {
  const int64_t blocks = K / kBlock;
  for (int64_t i = 0; i < M * blocks; ++i) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < kBlock; ++j) sum += x[i * kBlock + j];
    xsums[i] = sum;
  }
#if ROSEINFER_VNNI
  const int64_t groups = (blocks + 3) / 4;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, centring;
  xq.resize(M * groups * 128);
  xd.resize(M * groups * 4);
  centring.resize(M * blocks);
  quantize_for_q4(x, xsums, M, K, xq.data(), xd.data(), centring.data());
  // The pool's threads read this thread's buffers: pass pointers, not the thread_local names.
  const int8_t* xqp = xq.data();
  const float *xdp = xd.data(), *xcp = centring.data();
  over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
    q4_rows_vnni<decltype(tile)::value>(xqp, xdp, xsums, xcp, codes, scales, mins, out, m, n0, n1, K, N);
  });
#else
  over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
    q4_rows<decltype(tile)::value>(x, xsums, codes, scales, mins, out, m, n0, n1, K, N);
  });
#endif
}

void q8_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales, int64_t N,
               float* out, bool quantize_x) {
#if defined(__AVX512F__)
  if (!quantize_x && M >= kGemmRows) {
    q8_gemm(x, M, K, codes, scales, N, out);
    return;
  }
#endif
#if ROSEINFER_VNNI
  if (!quantize_x) {
    over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
      q8_rows<decltype(tile)::value>(x, codes, scales, out, m, n0, n1, K, N);
    });
    return;
  }
  const int64_t pairs = (K / kBlock + 1) / 2;
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> xd;
  xq.resize(M * pairs * 64);
  xd.resize(M * pairs * 2);
  quantize_for_q8(x, M, K, xq.data(), xd.data());
  const uint8_t* xqp = xq.data();
  const float* xdp = xd.data();
  over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
    q8_rows_vnni<decltype(tile)::value>(xqp, xdp, codes, scales, out, m, n0, n1, K, N);
  });
#else
  over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
    q8_rows<decltype(tile)::value>(x, codes, scales, out, m, n0, n1, K, N);
  });
#endif
}

}  // namespace roseinfer

bool q8_float_gemm() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool quantizes_activations() {
#if ROSEINFER_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, K] float32; codes [N, K / 2] uint8; scales, mins [N, K / 32] float32 -> [M, N] float32.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, blocks = K / kBlock;
  check_x(x, K);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(), "codes must be contiguous uint8");
  TORCH_CHECK(scales.sizes() == torch::IntArrayRef({N, blocks}) && mins.sizes() == scales.sizes() &&
                  scales.is_contiguous() && mins.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  mins.scalar_type() == torch::kFloat,
              "scales and mins must be contiguous float32 [N, K / 32]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  std::vector<float> xsums(M * blocks);
  auto out = torch::empty({M, N}, x.options());
  roseinfer::q4_matmul(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                       mins.data_ptr<float>(), N, xsums.data(), out.data_ptr<float>());
  return out;
}

// x [M, K] float32; codes [N, K] int8; scales [N, K / 32] float32 -> [M, N] float32.
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, bool quantize_x) {
  const int64_t N = codes.size(0), K = codes.size(1);
  check_x(x, K);
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.is_contiguous(), "codes must be contiguous int8");
  TORCH_CHECK(scales.sizes() == torch::IntArrayRef({N, K / kBlock}) && scales.is_contiguous() &&
                  scales.scalar_type() == torch::kFloat,
              "scales must be contiguous float32 [N, K / 32]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  roseinfer::q8_matmul(x.data_ptr<float>(), M, K, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), N,
                       out.data_ptr<float>(), quantize_x);
  return out;
}

// The float weights [N, K] of q4 blocks (for large batches, which a matrix product serves better).
torch::Tensor q4_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, blocks = K / kBlock;
  auto out = torch::empty({N, K}, scales.options());
  const uint8_t* cp = codes.contiguous().data_ptr<uint8_t>();
  const float *sp = scales.contiguous().data_ptr<float>(), *mp = mins.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* q = cp + i * 16;
      float* w = op + i * kBlock;
#pragma omp simd
      for (int j = 0; j < 16; ++j) {
        w[j] = sp[i] * static_cast<float>(q[j] & 0x0F) + mp[i];
        w[j + 16] = sp[i] * static_cast<float>(q[j] >> 4) + mp[i];
      }
    }
  });
  return out;
}

torch::Tensor q8_dequantize(torch::Tensor codes, torch::Tensor scales) {
  const int64_t N = codes.size(0), K = codes.size(1), blocks = K / kBlock;
  auto out = torch::empty({N, K}, scales.options());
  const int8_t* cp = codes.contiguous().data_ptr<int8_t>();
  const float* sp = scales.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    expand_q8_blocks(cp + begin * kBlock, sp + begin, end - begin, op + begin * kBlock);
  });
  return out;
}

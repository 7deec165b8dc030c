// Block-quantized linear layers for small batches on the CPU: weights stay in GGUF-style blocks of
// 32 along the input dimension and are expanded to float in registers, activations stay in float.
//
//   q4: 4-bit codes with a scale and a minimum per block (GGUF's Q4_1): w = scale * q + minimum.
//       Byte j of a block holds element j in its low nibble and element j + 16 in its high nibble.
//   q8: 8-bit signed codes with a scale per block (GGUF's Q8_0): w = scale * q.
//
// At decode batch sizes a linear layer is a matrix-vector product bound by reading the weights:
// 4.5 (q4) or 8.5 (q8) bits a weight instead of 32 is what makes a token fast. Each weight row is
// read once for all the batch's rows (up to kTile at a time), so a few rows cost little more than
// one. dot(w, x) = scale * dot(q, x) + minimum * sum(x) per block: the minimums' part needs only
// the block sums of x, computed once per call.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
  over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
    q4_rows<decltype(tile)::value>(x, xsums, codes, scales, mins, out, m, n0, n1, K, N);
  });
}

void q8_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales, int64_t N,
               float* out) {
  over_tiles(M, N, [&](auto tile, int64_t m, int64_t n0, int64_t n1) {
    q8_rows<decltype(tile)::value>(x, codes, scales, out, m, n0, n1, K, N);
  });
}

}  // namespace roseinfer

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
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
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
                       out.data_ptr<float>());
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
    for (int64_t i = begin; i < end; ++i) {
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) op[i * kBlock + j] = sp[i] * static_cast<float>(cp[i * kBlock + j]);
    }
  });
  return out;
}

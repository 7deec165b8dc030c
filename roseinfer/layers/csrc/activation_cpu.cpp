// SiLU(gate) * up of a gated MLP in one pass on the CPU.
//
// In PyTorch it is a split, a SiLU and a product: two kernels through the thread pool and a
// [tokens, intermediate] temporary, ~4% of a batch-64 decode step. Here each row of the fused
// gate/up projection is read once. Numbers as PyTorch's op-by-op path rounds them: the SiLU in
// float, rounded to the storage type, then the product in float, rounded again; on AVX-512 builds
// with the same exp, so bit for bit.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#if defined(__AVX512F__)
#include <sleef.h>
#endif

#include "cpu_kernels.h"

namespace {

// Rows per parallel task: enough work per task that threads are not started for a handful of rows.
constexpr int64_t kRowsPerTask = 8;

// SiLU in float, x / (1 + exp(-x)), rounded to the storage type: the scalar tail of a row (and
// every element on builds without AVX-512), where PyTorch's kernel also takes the scalar exp.
template <typename scalar_t>
inline float silu_rounded(float g) {
  scalar_t silu;
  roseinfer::store_float(&silu, g / (1.0f + std::exp(-g)));
  return roseinfer::load_float(&silu);
}

#if defined(__AVX512F__)
// v rounded to scalar_t's precision (nearest even), kept as floats.
template <typename scalar_t>
inline __m512 rounded_to(__m512 v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_and_si512(roseinfer::bfloat16_rounded_bits(v),
                                                _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return v;
  }
}
#endif

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* __restrict in, scalar_t* __restrict out, int64_t width, int64_t begin,
                       int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* __restrict gate = in + r * 2 * width;
    const scalar_t* __restrict up = gate + width;
    scalar_t* __restrict dst = out + r * width;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= width; i += 16) {
      const __m512 g = roseinfer::load16(gate + i);
      // PyTorch's vectorised SiLU takes Sleef's exp (1-ulp); the same call gives the same bits.
      // (A division with an explicit rounding mode: -ffast-math would make a plain one an
      // approximate reciprocal, which rounds differently.)
      const __m512 silu = _mm512_div_round_ps(g, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g))),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // The SiLU rounded to the storage type, as PyTorch's separate kernel leaves it.
      roseinfer::store16(dst + i, _mm512_mul_ps(rounded_to<scalar_t>(silu), roseinfer::load16(up + i)));
    }
#endif
    for (; i < width; ++i)
      roseinfer::store_float(dst + i, silu_rounded<scalar_t>(roseinfer::load_float(gate + i)) *
                                          roseinfer::load_float(up + i));
  }
}

}  // namespace

// x: [..., 2 * width], contiguous, gate then up in each row -> [..., width].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "x must be a contiguous CPU tensor [..., 2 * width]");
  const int64_t width = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, x.options());
  auto run = [&](auto* in) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      silu_and_mul_rows<scalar_t>(in, o, width, begin, end);
    });
  };
  switch (x.scalar_type()) {
    case torch::kFloat: run(x.data_ptr<float>()); break;
    case torch::kBFloat16: run(x.data_ptr<c10::BFloat16>()); break;
    case torch::kHalf: run(x.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "silu_and_mul takes float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return out;
}

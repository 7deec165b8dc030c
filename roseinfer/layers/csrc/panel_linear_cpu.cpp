// Float linear layers (float32 and bfloat16 weights) on a kernel of our own, for CPUs with AVX-512
// but no AMX tiles (AMD Zen 4/5 here). There, on 2 cores against the default model's layers (N =
// 576-3072 outputs, K = 576-1536 inputs) at a decode batch of 64, oneDNN reached 630-890 GFLOP/s in
// bfloat16 (AVX512-BF16 dot products; the CPU's peak is ~950-990): its split of so few output
// columns left one thread waiting, and it read each layer's weights from memory without hiding the
// wait. This kernel: 870-950 GFLOP/s there (1.07-1.41x oneDNN), float32 1.08-1.21x, and 1.4-2.6x
// oneDNN for a single row (panel_micro.py in the issue notes).
// Where AMX exists oneDNN is kept (its AMX kernels are far faster in bfloat16; float32 was not
// measured there): this file then builds to nothing, see panel_linear_dtypes.
//
// The weight is packed once into panels of kPanelColumns = 48 output columns, [panels][K / S][48][S]
// with S inputs a step (bfloat16: S = 2, the pair (k, k + 1) VDPBF16PS multiplies at once; float32:
// S = 1), so each step reads 3 whole vectors of the panel, each for 16 output columns. A tile of up
// to kTileRows batch rows keeps 8 x 3 float accumulators in registers; per step: 3 weight loads,
// one broadcast of each row's S inputs, 24 dot products or multiply-adds. Each thread takes a
// contiguous run of whole panels (the same work for both threads when the panel count is even, as
// it is for every layer of the default model), and while it computes one panel it prefetches the
// next, spread over the panel's row tiles, so the weights stream from memory under the arithmetic.
//
// Sums are float32 in input order; bfloat16 products are exact and the result is rounded once to
// bfloat16 at the end, as oneDNN's bfloat16 kernels do. Summation order differs from oneDNN's.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

#if defined(__AVX512F__) && !defined(__AMX_TILE__)
#define ROSEINFER_PANELS 1
#include <immintrin.h>
#else
#define ROSEINFER_PANELS 0
#endif
#if ROSEINFER_PANELS && defined(__AVX512BF16__)
#define ROSEINFER_BF16_PANELS 1
#else
#define ROSEINFER_BF16_PANELS 0
#endif

namespace {

constexpr int64_t kPanelColumns = 48;  // 3 vectors of 16 float outputs
constexpr int64_t kPanelVectors = kPanelColumns / 16;
constexpr int64_t kTileRows = 8;  // 8 x 3 accumulators of the 32 vector registers
// Batch rows per pass over the weights: a pass's rows of x (<= 768 KiB of bfloat16, 1.5 MiB of
// float32 at K = 1536) stay in the core's cache while every panel reads them.
constexpr int64_t kPassRows = 256;

// Inputs per step: a pair for bfloat16, one for float32 (32 bits of x either way).
template <typename T>
constexpr int64_t kStep = std::is_same_v<T, float> ? 1 : 2;

#if ROSEINFER_PANELS

// out[r][c] = bias[c] + sum_k x[r][k] w[c][k] for R rows of x and one panel's `columns` columns.
// Prefetches `prefetch_lines` cache lines from `prefetch` (a share of the next panel) on the way.
// O: the outputs' type, T (rounded once) or float32 (unrounded). Rows of x are ldx apart (ldx = K
// but for a slice of the inputs); Accumulate (float32 outputs): out += the product instead.
template <typename T, int R, typename O = T, bool Accumulate = false>
void panel_tile(const T* __restrict x, int64_t K, const T* __restrict panel, const float* __restrict bias,
                const char* prefetch, int64_t prefetch_lines, O* __restrict out, int64_t N, int64_t columns,
                int64_t ldx = 0) {
  constexpr int64_t S = kStep<T>;
  if (ldx == 0) ldx = K;
  __m512 acc[R][kPanelVectors];
  for (int v = 0; v < kPanelVectors; ++v) {
    const __m512 start = bias ? _mm512_loadu_ps(bias + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][v] = start;
  }
  if constexpr (Accumulate) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kPanelVectors && v * 16 < columns; ++v) {
        const __mmask16 mask = columns - v * 16 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (columns - v * 16)) - 1);
        acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_maskz_loadu_ps(mask, out + r * N + v * 16));
      }
  }
  const int64_t steps = K / S;
  for (int64_t s = 0; s < steps; ++s) {
    if (s < prefetch_lines) _mm_prefetch(prefetch + s * 64, _MM_HINT_T0);
    const T* w = panel + s * kPanelColumns * S;
    if constexpr (std::is_same_v<T, float>) {
      __m512 wv[kPanelVectors];
      for (int v = 0; v < kPanelVectors; ++v) wv[v] = _mm512_loadu_ps(w + v * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * ldx + s]);
        for (int v = 0; v < kPanelVectors; ++v) acc[r][v] = _mm512_fmadd_ps(xr, wv[v], acc[r][v]);
      }
    } else {
#if ROSEINFER_BF16_PANELS
      __m512bh wv[kPanelVectors];
      for (int v = 0; v < kPanelVectors; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * 32);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * s, sizeof(pair));
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int v = 0; v < kPanelVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVectors; ++v) {
      const int64_t first = v * 16;
      if (first >= columns) break;
      const __mmask16 mask = columns - first >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (columns - first)) - 1);
      if constexpr (std::is_same_v<O, float>) {
        _mm512_mask_storeu_ps(out + r * N + first, mask, acc[r][v]);
      } else {
#if ROSEINFER_BF16_PANELS
        _mm256_mask_storeu_epi16(out + r * N + first, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
#endif
      }
    }
}

template <typename T>
void panel_pass(const T* x, int64_t M, int64_t K, const T* panels, int64_t panel_count, const float* bias,
                int64_t N, T* out) {
  const int64_t panel_elements = K * kPanelColumns;
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t panel_lines = (panel_elements * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t lines_per_tile = (panel_lines + tiles - 1) / tiles;
  at::parallel_for(0, panel_count, 1, [&](int64_t first_panel, int64_t end_panel) {
    for (int64_t q = first_panel; q < end_panel; ++q) {
      const T* panel = panels + q * panel_elements;
      const bool has_next = q + 1 < end_panel;
      const int64_t column = q * kPanelColumns, columns = std::min(kPanelColumns, N - column);
      const float* panel_bias = bias ? bias + column : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kTileRows, rows = std::min(kTileRows, M - m0);
        const char* prefetch =
            has_next ? reinterpret_cast<const char*>(panel + panel_elements) + t * lines_per_tile * 64 : nullptr;
        const int64_t lines = has_next ? std::clamp<int64_t>(panel_lines - t * lines_per_tile, 0, lines_per_tile) : 0;
        const T* xt = x + m0 * K;
        T* ot = out + m0 * N + column;
        switch (rows) {
#define ROSEINFER_TILE(R) \
  case R: panel_tile<T, R>(xt, K, panel, panel_bias, prefetch, lines, ot, N, columns); break;
          ROSEINFER_TILE(1) ROSEINFER_TILE(2) ROSEINFER_TILE(3) ROSEINFER_TILE(4)
          ROSEINFER_TILE(5) ROSEINFER_TILE(6) ROSEINFER_TILE(7) ROSEINFER_TILE(8)
#undef ROSEINFER_TILE
        }
      }
    }
  });
}

// Every row of x against one packed panel, on the calling thread, float32 outputs: for callers
// that build panels as they go (blocked weights expanded a panel at a time, gguf_linear_cpu.cpp).
template <typename T, bool Accumulate>
void panel_rows_impl(const T* x, int64_t M, int64_t K, int64_t ldx, const T* panel, float* out, int64_t N,
                     int64_t columns) {
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const T* xt = x + m0 * ldx;
    float* ot = out + m0 * N;
    switch (std::min(kTileRows, M - m0)) {
#define ROSEINFER_TILE(R) \
  case R: panel_tile<T, R, float, Accumulate>(xt, K, panel, nullptr, nullptr, 0, ot, N, columns, ldx); break;
      ROSEINFER_TILE(1) ROSEINFER_TILE(2) ROSEINFER_TILE(3) ROSEINFER_TILE(4)
      ROSEINFER_TILE(5) ROSEINFER_TILE(6) ROSEINFER_TILE(7) ROSEINFER_TILE(8)
#undef ROSEINFER_TILE
    }
  }
}

#endif

bool has_panels(c10::ScalarType dtype) {
  return (dtype == torch::kFloat && ROSEINFER_PANELS) || (dtype == torch::kBFloat16 && ROSEINFER_BF16_PANELS);
}

int64_t step_of(c10::ScalarType dtype) { return dtype == torch::kFloat ? 1 : 2; }

}  // namespace

namespace roseinfer {

void panel_matmul([[maybe_unused]] const float* x, [[maybe_unused]] int64_t M, [[maybe_unused]] int64_t K,
                  [[maybe_unused]] const float* panels, [[maybe_unused]] int64_t panel_count,
                  [[maybe_unused]] const float* bias, [[maybe_unused]] int64_t N, [[maybe_unused]] float* out) {
  TORCH_CHECK(has_panels(torch::kFloat), "this build has no float32 panel kernel");
#if ROSEINFER_PANELS
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows)
    panel_pass(x + m0 * K, std::min(kPassRows, M - m0), K, panels, panel_count, bias, N, out + m0 * N);
#endif
}

void panel_matmul([[maybe_unused]] const c10::BFloat16* x, [[maybe_unused]] int64_t M, [[maybe_unused]] int64_t K,
                  [[maybe_unused]] const c10::BFloat16* panels, [[maybe_unused]] int64_t panel_count,
                  [[maybe_unused]] const float* bias, [[maybe_unused]] int64_t N,
                  [[maybe_unused]] c10::BFloat16* out) {
  TORCH_CHECK(has_panels(torch::kBFloat16), "this build has no bfloat16 panel kernel");
#if ROSEINFER_BF16_PANELS
  // bfloat16 as raw 16-bit values: the kernel only moves and converts them with intrinsics.
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* ws = reinterpret_cast<const uint16_t*>(panels);
  auto* os = reinterpret_cast<uint16_t*>(out);
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows)
    panel_pass(xs + m0 * K, std::min(kPassRows, M - m0), K, ws, panel_count, bias, N, os + m0 * N);
#endif
}

void panel_rows([[maybe_unused]] const float* x, [[maybe_unused]] int64_t M, [[maybe_unused]] int64_t K,
                [[maybe_unused]] int64_t ldx, [[maybe_unused]] const float* panel, [[maybe_unused]] float* out,
                [[maybe_unused]] int64_t N, [[maybe_unused]] int64_t columns, [[maybe_unused]] bool accumulate) {
  TORCH_CHECK(has_panels(torch::kFloat), "this build has no float32 panel kernel");
#if ROSEINFER_PANELS
  if (accumulate) {
    panel_rows_impl<float, true>(x, M, K, ldx, panel, out, N, columns);
  } else {
    panel_rows_impl<float, false>(x, M, K, ldx, panel, out, N, columns);
  }
#endif
}

void panel_rows([[maybe_unused]] const c10::BFloat16* x, [[maybe_unused]] int64_t M, [[maybe_unused]] int64_t K,
                [[maybe_unused]] int64_t ldx, [[maybe_unused]] const c10::BFloat16* panel,
                [[maybe_unused]] float* out, [[maybe_unused]] int64_t N, [[maybe_unused]] int64_t columns,
                [[maybe_unused]] bool accumulate) {
  TORCH_CHECK(has_panels(torch::kBFloat16), "this build has no bfloat16 panel kernel");
#if ROSEINFER_BF16_PANELS
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* ws = reinterpret_cast<const uint16_t*>(panel);
  if (accumulate) {
    panel_rows_impl<uint16_t, true>(xs, M, K, ldx, ws, out, N, columns);
  } else {
    panel_rows_impl<uint16_t, false>(xs, M, K, ldx, ws, out, N, columns);
  }
#endif
}

bool has_panel_kernel(c10::ScalarType dtype) { return has_panels(dtype); }

}  // namespace roseinfer

std::vector<std::string> panel_linear_dtypes() {
  std::vector<std::string> dtypes;
  if (has_panels(torch::kFloat)) dtypes.push_back("float32");
  if (has_panels(torch::kBFloat16)) dtypes.push_back("bfloat16");
  return dtypes;
}

// weight [N, K] -> [ceil(N / 48), K / S, 48, S] (S = 2 for bfloat16, K even; 1 for float32);
// columns past N are zeros.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && has_panels(weight.scalar_type()), "a 2-D weight of a dtype in panel_linear_dtypes() is needed, got ",
              weight.scalar_type());
  const int64_t S = step_of(weight.scalar_type());
  TORCH_CHECK(weight.size(1) % S == 0, "a bfloat16 weight's input size must be even, got ", weight.size(1));
  weight = weight.contiguous();
  const int64_t N = weight.size(0), steps = weight.size(1) / S;
  const int64_t panel_count = (N + kPanelColumns - 1) / kPanelColumns;
  auto packed = roseinfer::lasting_zeros({panel_count, steps, kPanelColumns, S}, weight.scalar_type());  // a weight
  // One step's inputs of one weight row are 32 contiguous bits in both layouts.
  const auto* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, panel_count, 1, [&](int64_t first_panel, int64_t end_panel) {
    for (int64_t q = first_panel; q < end_panel; ++q)
      for (int64_t c = 0; c < kPanelColumns && q * kPanelColumns + c < N; ++c) {
        const uint32_t* row = src + (q * kPanelColumns + c) * steps;
        uint32_t* column = dst + q * steps * kPanelColumns + c;
        for (int64_t s = 0; s < steps; ++s) column[s * kPanelColumns] = row[s];
      }
  });
  return packed;
}

// x [..., K]; panels from pack_panels of an [N, K] weight of x's dtype; bias None or float32 over the
// packed columns (ceil(N / 48) * 48, zeros past N) -> [..., N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(has_panels(x.scalar_type()) && panels.scalar_type() == x.scalar_type() && panels.dim() == 4,
              "x and the packed panels must share a dtype of panel_linear_dtypes()");
  const int64_t K = x.size(-1);
  TORCH_CHECK(panels.size(1) * panels.size(3) == K && panels.size(0) == (N + kPanelColumns - 1) / kPanelColumns,
              "x's last dimension (", K, ") or N (", N, ") does not match the packed weight");
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());
  const float* b = nullptr;  // float32, padded to whole panels: added before the one rounding
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                    bias->numel() == panels.size(0) * kPanelColumns,
                "the bias must be float32 with one value per packed column (", panels.size(0) * kPanelColumns,
                "), zeros past N");
    b = bias->data_ptr<float>();
  }
  if (x.scalar_type() == torch::kFloat) {
    roseinfer::panel_matmul(rows.data_ptr<float>(), M, K, panels.data_ptr<float>(), panels.size(0), b, N,
                            out.data_ptr<float>());
  } else {
    roseinfer::panel_matmul(rows.data_ptr<c10::BFloat16>(), M, K, panels.data_ptr<c10::BFloat16>(), panels.size(0),
                            b, N, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

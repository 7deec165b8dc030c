// bfloat16 linear layers on CPUs with AVX512-BF16 dot products but no AMX tiles (AMD Zen 4/5,
// Intel Cooper Lake). There oneDNN reached 630-800 GFLOP/s on 2 cores for a decode batch of 64
// against the default model's layers (N = 576-3072, K = 576-1536): its split of so few output
// columns left one thread waiting, and it read each layer's weights from memory without hiding
// the wait. This kernel reaches ~950 GFLOP/s on the same layers (where AMX exists oneDNN's AMX
// kernels are far faster, and this file builds to nothing: see bf16_panel_gemm).
//
// The weight is packed once into panels of kPanelColumns output columns: [panels][K / 2][48][2], so
// each step over a pair of inputs (k, k + 1) reads 3 whole vectors of the panel, each holding the
// pair for 16 output columns, as VDPBF16PS wants them. A tile of up to kTileRows batch rows keeps
// 8 x 3 float accumulators in registers; per pair: 3 weight loads, one 32-bit broadcast of each
// row's (x[k], x[k + 1]), 24 dot products. Each thread takes a contiguous run of panels (whole
// panels: both threads get the same work when the panel count is even, as it is for every layer of
// the default model), and while it computes one panel it prefetches the next, spread over the
// panel's row tiles, so the weights stream from memory under the arithmetic.
//
// Sums are float32 over exact bfloat16 products, rounded once to bfloat16 at the end (as oneDNN's
// bfloat16 kernels do); the summation order differs from oneDNN's.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define ROSEINFER_BF16_PANELS 1
#include <immintrin.h>
#else
#define ROSEINFER_BF16_PANELS 0
#endif

namespace {

constexpr int64_t kPanelColumns = 48;  // 3 vectors of 16 float outputs
constexpr int64_t kPanelVectors = kPanelColumns / 16;
constexpr int64_t kTileRows = 8;  // 8 x 3 accumulators of the 32 vector registers
// Batch rows per pass over the weights: x's rows in a pass (<= 768 KiB at K = 1536) stay in the
// core's L2 while every panel reads them.
constexpr int64_t kPassRows = 256;

#if ROSEINFER_BF16_PANELS

// out[r][c] = bias[c] + sum_k x[r][k] w[c][k] for R rows of x and one panel's `columns` columns.
// Prefetches `prefetch_lines` cache lines from `prefetch` (a share of the next panel) on the way.
template <int R>
void panel_tile(const uint16_t* __restrict x, int64_t K, const uint16_t* __restrict panel,
                const float* __restrict bias, const char* prefetch, int64_t prefetch_lines,
                uint16_t* __restrict out, int64_t N, int64_t columns) {
  __m512 acc[R][kPanelVectors];
  for (int v = 0; v < kPanelVectors; ++v) {
    const __m512 start = bias ? _mm512_loadu_ps(bias + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][v] = start;
  }
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    if (p < prefetch_lines) _mm_prefetch(prefetch + p * 64, _MM_HINT_T0);
    const uint16_t* w = panel + p * kPanelColumns * 2;
    __m512bh wv[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * 32);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < kPanelVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVectors; ++v) {
      const int64_t first = v * 16;
      if (first >= columns) break;
      const __mmask16 mask = columns - first >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (columns - first)) - 1);
      _mm256_mask_storeu_epi16(out + r * N + first, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
    }
}

void panel_pass(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels, int64_t panel_count,
                const float* bias, int64_t N, uint16_t* out) {
  const int64_t panel_elements = K * kPanelColumns;  // K / 2 pairs of 48 x 2
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t panel_lines = (panel_elements * 2 + 63) / 64;
  const int64_t lines_per_tile = (panel_lines + tiles - 1) / tiles;
  at::parallel_for(0, panel_count, 1, [&](int64_t first_panel, int64_t end_panel) {
    for (int64_t q = first_panel; q < end_panel; ++q) {
      const uint16_t* panel = panels + q * panel_elements;
      const bool has_next = q + 1 < end_panel;
      const int64_t column = q * kPanelColumns, columns = std::min(kPanelColumns, N - column);
      const float* panel_bias = bias ? bias + column : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kTileRows, rows = std::min(kTileRows, M - m0);
        const char* prefetch =
            has_next ? reinterpret_cast<const char*>(panel + panel_elements) + t * lines_per_tile * 64 : nullptr;
        const int64_t lines = has_next ? std::clamp<int64_t>(panel_lines - t * lines_per_tile, 0, lines_per_tile) : 0;
        const uint16_t* xt = x + m0 * K;
        uint16_t* ot = out + m0 * N + column;
        switch (rows) {
#define ROSEINFER_TILE(R) \
  case R: panel_tile<R>(xt, K, panel, panel_bias, prefetch, lines, ot, N, columns); break;
          ROSEINFER_TILE(1) ROSEINFER_TILE(2) ROSEINFER_TILE(3) ROSEINFER_TILE(4)
          ROSEINFER_TILE(5) ROSEINFER_TILE(6) ROSEINFER_TILE(7) ROSEINFER_TILE(8)
#undef ROSEINFER_TILE
        }
      }
    }
  });
}

#endif

}  // namespace

bool bf16_panel_gemm() { return ROSEINFER_BF16_PANELS; }

// weight [N, K] bfloat16, K even -> [ceil(N / 48), K / 2, 48, 2]; columns past N are zeros.
torch::Tensor bf16_pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "a 2-D bfloat16 weight is needed");
  TORCH_CHECK(weight.size(1) % 2 == 0, "the weight's input size must be even, got ", weight.size(1));
  weight = weight.contiguous();
  const int64_t N = weight.size(0), pairs = weight.size(1) / 2;
  const int64_t panel_count = (N + kPanelColumns - 1) / kPanelColumns;
  auto packed = torch::zeros({panel_count, pairs, kPanelColumns, 2}, weight.options());
  // A pair (k, k + 1) of one weight row is 32 contiguous bits in both layouts.
  const auto* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, panel_count, 1, [&](int64_t first_panel, int64_t end_panel) {
    for (int64_t q = first_panel; q < end_panel; ++q)
      for (int64_t c = 0; c < kPanelColumns && q * kPanelColumns + c < N; ++c) {
        const uint32_t* row = src + (q * kPanelColumns + c) * pairs;
        uint32_t* column = dst + q * pairs * kPanelColumns + c;
        for (int64_t p = 0; p < pairs; ++p) column[p * kPanelColumns] = row[p];
      }
  });
  return packed;
}

// x [..., K] bfloat16; panels from bf16_pack_panels of an [N, K] weight; bias [N] or None -> [..., N].
torch::Tensor bf16_panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(ROSEINFER_BF16_PANELS, "this build has no bfloat16 panel kernel (see bf16_panel_gemm)");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && panels.scalar_type() == torch::kBFloat16 && panels.dim() == 4,
              "bfloat16 x and packed panels are needed");
  const int64_t K = x.size(-1);
  TORCH_CHECK(panels.size(1) * 2 == K && panels.size(0) == (N + kPanelColumns - 1) / kPanelColumns,
              "x's last dimension (", K, ") or N (", N, ") does not match the packed weight");
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());
  // The bias, padded to whole panels, in float32: added before the one rounding.
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "the bias has ", bias->numel(), " values for ", N, " outputs");
    bias_f = torch::zeros({panels.size(0) * kPanelColumns}, x.options().dtype(torch::kFloat));
    bias_f.narrow(0, 0, N).copy_(bias->reshape({N}));
  }
#if ROSEINFER_BF16_PANELS
  const auto* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows)
    panel_pass(xp + m0 * K, std::min(kPassRows, M - m0), K, wp, panels.size(0), bp, N, op + m0 * N);
#endif
  return out;
}

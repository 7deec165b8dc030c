// Linear layers on GGUF-typed weights, in the file's own codes: one driver over the block traits of
// gguf_blocks.h, so a new type is a traits struct, not a new kernel.
//
// Two shapes of work:
//   - 8-bit products: with VNNI the activations are quantized once per call to 8 bits (a scale per
//     32 or per 256 values, stored in the weight type's order) and the traits' dot multiplies bytes,
//     as llama.cpp does, each weight row read once for a tile of up to 4 rows of x. This serves
//     decode batches (up to kDotRows rows) of every type, and batches of any size on the
//     interleaved layouts, whose products outrun bfloat16 panels. Without VNNI, or where exact
//     products are asked for, a weight row is expanded to float in cache and multiplied by float
//     activations.
//   - Panels (prefill and large batches of the other types): the weight is expanded a panel of 48
//     rows at a time (the exact values, then bfloat16 where the CPU has bfloat16 dot products and
//     exactness is not asked for) into the panel kernel's layout, and multiplied by every row at
//     the panel kernel's throughput (panel_linear_cpu.cpp); the weight is never whole in float.
//     Without AVX-512, blocks of rows are expanded to float32 and multiplied by PyTorch's matrix
//     product.
//
// Weights are in the kernels' layout (gguf_pack): the file's bytes for 256-value types, groups of 4
// blocks for the 32-value ones (see gguf_blocks.h), and for the hot types (Q4_0, Q8_0, MXFP4, Q4_K,
// Q5_K, Q6_K, IQ4_XS) on VNNI CPUs, 8 or 16 rows interleaved (gguf_interleaved.h): a layout has its own
// kernel type id.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "gguf_blocks.h"
#include "gguf_interleaved.h"

namespace {

using namespace roseinfer::gguf;

// Rows up to which the dot kernels serve the row layouts; past it their weight is expanded into
// panels (the interleaved layouts keep the dots at any batch: see dots_at_any_batch).
constexpr int64_t kDotRows = 32;
// Weight bytes of a task of the grouped block products, about (see gguf_matmul_group).
constexpr int64_t kTaskBytes = int64_t{512} << 10;
// Without panels: weight rows expanded to float32 at once for a matrix product (~2 MiB at K = 2048).
constexpr int64_t kExpandRows = 256;

// Rows a layout keeps side by side and groups of them a kernel call takes: the interleaved layouts
// (which name their Row layout) say, the row layouts keep 1 and take 1.
template <typename Tr, typename = void>
struct Together {
  static constexpr int64_t rows = 1, groups = 1;
};
template <typename Tr>
struct Together<Tr, std::void_t<typename Tr::Row>> {
  static constexpr int64_t rows = Tr::kRowsTogether, groups = Tr::kGroups;
};
template <typename Tr>
constexpr bool interleaved() {
  return Together<Tr>::rows > 1;
}
template <typename Tr>
constexpr int64_t rows_together() {
  return Together<Tr>::rows;
}

template <typename Tr>
int64_t units_of(int64_t K) {
  return Tr::kSuperAct ? K / 256 : (K / 32 + kGroupBlocks - 1) / kGroupBlocks;
}

// Bytes of one row (of rows_together() rows, the share of one).
template <typename Tr>
int64_t row_bytes(int64_t K) {
  return units_of<Tr>(K) * Tr::kBytes / rows_together<Tr>();
}

template <typename Tr>
void check_k(int64_t K) {
  const int64_t block = Tr::kSuperAct ? 256 : 32;
  TORCH_CHECK(K > 0 && K % block == 0, "a GGML type ", Tr::kType, " row needs a multiple of ", block,
              " values, got ", K);
}

// The position of each natural index within a unit, the inverse of Tr::native.
template <typename Tr>
const std::array<uint16_t, Tr::kValues>& positions() {
  static const auto table = [] {
    std::array<uint16_t, Tr::kValues> p{};
    for (int i = 0; i < Tr::kValues; ++i) p[Tr::native(i)] = static_cast<uint16_t>(i);
    return p;
  }();
  return table;
}

// Unit u of row n, exact, into out (kValues floats; padding blocks give zeros).
template <typename Tr>
inline void dequantize_unit(const uint8_t* w, int64_t n, int64_t u, int64_t units, float* out) {
  if constexpr (constexpr int64_t R = rows_together<Tr>(); R > 1) {
    uint8_t row[Tr::Row::kBytes];
    Tr::gather(w + ((n / R) * units + u) * Tr::kBytes, static_cast<int>(n % R), row);
    Tr::Row::dequantize(row, out);
  } else {
    Tr::dequantize(w + (n * units + u) * Tr::kBytes, out);
  }
}

// Row n's K values, exact, into out (units * kValues floats; padding blocks give zeros).
template <typename Tr>
inline void dequantize_row(const uint8_t* w, int64_t n, int64_t units, float* out) {
  for (int64_t u = 0; u < units; ++u) dequantize_unit<Tr>(w, n, u, units, out + u * Tr::kValues);
}

// ------------------------------------------------------------------------------------------------
// 8-bit activations
// ------------------------------------------------------------------------------------------------

struct ActivationBuffers {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sums32;
  std::vector<int16_t> sums, run_sums;
};

#if ROSEINFER_GGUF_VNNI
// Rounds x * inverse to the nearest integer (ties to even), as llama.cpp's nearest_int.
inline void quantize_run(const float* x, int64_t n, float inverse, int8_t* out) {
  int64_t i = 0;
  const __m512 inv = _mm512_set1_ps(inverse);
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv))));
  for (; i < n; ++i) out[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
}

inline float max_abs(const float* x, int64_t n) {
  __m512 lanes = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) lanes = _mm512_max_ps(lanes, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float m = _mm512_reduce_max_ps(lanes);
  for (; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// The sum of 16 int8 values.
inline int sum16(const int8_t* q) {
  return _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// Units of activations a parallel task quantizes: a decode row's few stay on the calling thread,
// a batch's are shared out (done by one thread, the others waited for it: ~4% of a 16-row step).
constexpr int64_t kQuantizeUnits = 16;

template <typename Tr>
Activations quantize_activations(const float* x, int64_t M, int64_t K, ActivationBuffers& buf) {
  const int64_t units = units_of<Tr>(K), padded = units * Tr::kValues;
  const auto& pos = positions<Tr>();
  if constexpr (Tr::kSuperAct) {
    // Every value is written below: sized, not cleared (clearing them was a memset a product).
    buf.q.resize(M * padded);
    buf.d.resize(M * units);
    buf.sums.resize(M * units * 16);
    buf.run_sums.resize(M * units * 8);
    at::parallel_for(0, M * units, kQuantizeUnits, [&](int64_t begin, int64_t end) {
      int8_t natural[256];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / units, u = i % units;
        const float* xu = x + m * K + u * 256;
        const float amax = max_abs(xu, 256);
        buf.d[i] = amax / 127.0f;
        int8_t* q = buf.q.data() + m * padded + u * 256;
        int16_t* sums = buf.sums.data() + i * 16;
        const float scale = amax > 0.0f ? 127.0f / amax : 0.0f;
        if constexpr (interleaved<Tr>()) {  // natural order: the codes go straight in place
          quantize_run(xu, 256, scale, q);
          for (int r = 0; r < 16; ++r) sums[r] = static_cast<int16_t>(sum16(q + 16 * r));
        } else {
          quantize_run(xu, 256, scale, natural);
          std::fill_n(sums, 16, int16_t{0});
          for (int v = 0; v < 256; ++v) {
            q[pos[v]] = natural[v];
            sums[v / 16] = static_cast<int16_t>(sums[v / 16] + natural[v]);
          }
        }
        int16_t* run_sums = buf.run_sums.data() + i * 8;
        for (int run = 0; run < 8; ++run) run_sums[run] = static_cast<int16_t>(sums[2 * run] + sums[2 * run + 1]);
      }
    });
    return {buf.q.data(), buf.d.data(), nullptr, nullptr, buf.sums.data(), buf.run_sums.data(), padded, units, units * 16};
  } else {
    const int64_t blocks = units * kGroupBlocks, filled = K / 32;  // (the padding's blocks stay 0)
    buf.q.assign(M * padded, 0);
    buf.d.assign(M * blocks, 0.0f);
    buf.s.assign(M * blocks, 0.0f);
    buf.sums32.assign(M * blocks, 0);
    at::parallel_for(0, M * filled, kQuantizeUnits * 8, [&](int64_t begin, int64_t end) {
      int8_t natural[32];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / filled, b = i % filled;
        const float* xb = x + m * K + b * 32;
        const float amax = max_abs(xb, 32);
        const float d = amax / 127.0f;
        int8_t* q = buf.q.data() + m * padded + b / kGroupBlocks * Tr::kValues;
        const int first = static_cast<int>(b % kGroupBlocks) * 32;
        int sum = 0;
        const float scale = amax > 0.0f ? 127.0f / amax : 0.0f;
        if constexpr (interleaved<Tr>()) {  // natural order: the codes go straight in place
          quantize_run(xb, 32, scale, q + first);
          sum = sum16(q + first) + sum16(q + first + 16);
        } else {
          quantize_run(xb, 32, scale, natural);
          for (int v = 0; v < 32; ++v) {
            q[pos[first + v]] = natural[v];
            sum += natural[v];
          }
        }
        buf.d[m * blocks + b] = d;
        buf.s[m * blocks + b] = d * static_cast<float>(sum);
        buf.sums32[m * blocks + b] = sum;
      }
    });
    return {buf.q.data(), buf.d.data(), buf.s.data(), buf.sums32.data(), nullptr, nullptr, padded, blocks, 0};
  }
}
#endif

// Weight rows per parallel task: enough to amortise a task, few enough to keep every core busy.
int64_t grain(int64_t N) { return std::max<int64_t>(8, N / (8 * at::get_num_threads())); }

// f(task) for tasks 0 .. tasks - 1, the threads taking them in turn from a shared counter: a
// thread that runs slower (a core the VM shares, memory further away) takes fewer, where equal
// shares fixed up front kept the others waiting for it at the end of every product.
template <typename F>
void run_tasks(int64_t tasks, F&& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks;
         t = next.fetch_add(1, std::memory_order_relaxed))
      f(t);
  });
}

// Tiles of 4, 2 and 1 rows of x over weight rows [n0, n1): f(tile, m, n, results); row m of the
// output starts at out + m * ldo.
template <typename F>
void over_rows(int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo, F&& f) {
  float results[4];
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      f(std::integral_constant<int, 4>{}, m, n, results);
      for (int t = 0; t < 4; ++t) out[(m + t) * ldo + n] = results[t];
    }
    for (; m + 2 <= M; m += 2) {
      f(std::integral_constant<int, 2>{}, m, n, results);
      for (int t = 0; t < 2; ++t) out[(m + t) * ldo + n] = results[t];
    }
    for (; m < M; ++m) {
      f(std::integral_constant<int, 1>{}, m, n, results);
      out[m * ldo + n] = results[0];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The paths
// ------------------------------------------------------------------------------------------------

#if ROSEINFER_GGUF_VNNI
// Weight rows [n0, n1) (whole groups of rows_together()) against every row of the quantized
// activations a: out[m * ldo + n].
template <typename Tr>
void dot_rows(const Activations& a, int64_t M, int64_t units, const uint8_t* w, int64_t n0, int64_t n1, float* out,
              int64_t ldo) {
  if constexpr (constexpr int64_t R = rows_together<Tr>(); R > 1) {
    // Groups of R weight rows, Tr::kGroups of them a call while as many are left; tiles of 4, 2, 1
    // rows of x each.
    const int64_t bytes = units * Tr::kBytes;
    auto groups = [&](auto count, int64_t g) {
      constexpr int G = decltype(count)::value;
      auto tile = [&](auto size, int64_t m) {
        constexpr int T = decltype(size)::value;
        // With 1 or 2 rows of x a broadcast has too few products to share: one group a call was
        // faster there (Zen 4: Q6_K 4.6 against 5.3 ns a super-block at one row).
        constexpr int g_call = T <= 2 ? 1 : G;
        float results[T][g_call * R];
        for (int i = 0; i < G; i += g_call) {
          Tr::template dot_groups<g_call, T>(w + (g + i) * bytes, bytes, units, a, m, results);
          for (int t = 0; t < T; ++t) std::copy_n(results[t], g_call * R, out + (m + t) * ldo + (g + i) * R);
        }
      };
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
      for (; m + 2 <= M; m += 2) tile(std::integral_constant<int, 2>{}, m);
      for (; m < M; ++m) tile(std::integral_constant<int, 1>{}, m);
    };
    int64_t g = n0 / R;
    for (; g + Tr::kGroups <= n1 / R; g += Tr::kGroups) groups(std::integral_constant<int, Tr::kGroups>{}, g);
    for (; g < n1 / R; ++g) groups(std::integral_constant<int, 1>{}, g);
  } else {
    const int64_t bytes = units * Tr::kBytes;
    over_rows(M, n0, n1, out, ldo, [&](auto tile, int64_t m, int64_t n, float* results) {
      Tr::template dot<decltype(tile)::value>(w + n * bytes, units, a, m, results);
    });
  }
}

template <typename Tr>
void dot_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int64_t ldo) {
  thread_local ActivationBuffers buffers;
  const Activations a = quantize_activations<Tr>(x, M, K, buffers);  // read by the pool's threads
  const int64_t units = units_of<Tr>(K), together = rows_together<Tr>() * Together<Tr>::groups;
  const int64_t step = std::max<int64_t>(1, grain(N) / together) * together, tasks = (N + step - 1) / step;
  run_tasks(tasks, [&](int64_t t) { dot_rows<Tr>(a, M, units, w, t * step, std::min(N, (t + 1) * step), out, ldo); });
}
#endif

// Float activations against each weight row expanded in cache: exact products.
template <typename Tr>
void float_rows_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int64_t ldo) {
  const int64_t units = units_of<Tr>(K);
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    std::vector<float> row(units * Tr::kValues);
    float* r = row.data();
    for (int64_t n = n0; n < n1; ++n) {
      dequantize_row<Tr>(w, n, units, r);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < K; ++k) sum += r[k] * xm[k];
        out[m * ldo + n] = sum;
      }
    }
  });
}

#if defined(__AVX512F__)
// 16 x 16 32-bit values transposed in registers: v[i] lane j <-> v[j] lane i.
inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    v[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    v[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    v[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// Columns [first, first + columns) of the weight (columns <= 48), units [u0, u1) of their inputs,
// into one panel of the panel kernel's layout, [inputs / S][48][S] of T (past `columns`: zeros):
// 16 weight rows at a time, one unit expanded exactly into `tile` (16 x kValues floats), then
// turned to the panel's order 16 x 16 values (bfloat16: value pairs) at a time in registers.
template <typename Tr, typename T>
void expand_panel(const uint8_t* w, int64_t first, int64_t columns, int64_t K, int64_t units, int64_t u0, int64_t u1,
                  T* panel, float* tile) {
  constexpr int64_t S = std::is_same_v<T, float> ? 1 : 2, P = roseinfer::kPanelWidth, V = Tr::kValues;
  for (int64_t c0 = 0; c0 < P; c0 += 16) {
    const int64_t rows = std::clamp<int64_t>(columns - c0, 0, 16);
    for (int64_t u = u0; u < u1; ++u) {
      for (int64_t r = 0; r < 16; ++r) {
        if (r < rows) {
          dequantize_unit<Tr>(w, first + c0 + r, u, units, tile + r * V);
        } else {
          std::fill(tile + r * V, tile + (r + 1) * V, 0.0f);
        }
      }
      const int64_t k0 = (u - u0) * V, count = std::min<int64_t>(V, K - u * V);
      for (int64_t k = 0; k < count; k += 16 * S) {
        __m512 v[16];
        for (int r = 0; r < 16; ++r) {
          const float* row = tile + r * V + k;
          if constexpr (S == 1) {
            v[r] = _mm512_loadu_ps(row);
          } else {
#if defined(__AVX512BF16__)
            // Value pairs (k, k + 1) as one 32-bit lane, rounded to nearest even like store_float.
            v[r] = _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row)));
#endif
          }
        }
        transpose16(v);
        T* step = panel + (k0 + k) / S * P * S + c0 * S;
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(step + j * P * S), v[j]);
      }
    }
  }
}
#endif

// The weight a panel of 48 rows at a time, expanded into the panel kernel's layout ([K / S][48][S]
// of T), against every row of x (already of type T). Inputs in slices of at most kPanelInputs, so
// that a panel (48 x 2048 bfloat16: 192 KiB) stays in the core's cache while every row reads it.
constexpr int64_t kPanelInputs = 2048;

template <typename Tr, typename T>
void panel_matmul_blocks([[maybe_unused]] const T* x, [[maybe_unused]] int64_t M, [[maybe_unused]] int64_t K,
                         [[maybe_unused]] const uint8_t* w, [[maybe_unused]] int64_t N, [[maybe_unused]] float* out,
                         [[maybe_unused]] int64_t ldo) {
#if defined(__AVX512F__)
  constexpr int64_t P = roseinfer::kPanelWidth;
  const int64_t units = units_of<Tr>(K), panels = (N + P - 1) / P;
  const int64_t slice_units = std::max<int64_t>(1, kPanelInputs / Tr::kValues);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> tile(16 * Tr::kValues);
    std::vector<T> panel(std::min(K, slice_units * Tr::kValues) * P);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t first = p * P, columns = std::min(P, N - first);
      for (int64_t u0 = 0; u0 < units; u0 += slice_units) {
        const int64_t u1 = std::min(units, u0 + slice_units), k0 = u0 * Tr::kValues;
        const int64_t inputs = std::min(K, u1 * Tr::kValues) - k0;
        expand_panel<Tr, T>(w, first, columns, K, units, u0, u1, panel.data(), tile.data());
        roseinfer::panel_rows(x + k0, M, inputs, K, panel.data(), out + first, ldo, columns, u0 > 0);
      }
    }
  });
#endif
}

// Without panels: runs of weight rows expanded to float32, multiplied by PyTorch's matrix product.
template <typename Tr>
void expanded_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int64_t ldo) {
  const int64_t units = units_of<Tr>(K), padded = units * Tr::kValues;
  auto xs = torch::from_blob(const_cast<float*>(x), {M, K});
  auto result = torch::from_blob(out, {M, N}, {ldo, 1});
  auto tile = torch::empty({std::min(kExpandRows, N), padded});
  for (int64_t n0 = 0; n0 < N; n0 += kExpandRows) {
    const int64_t rows = std::min(kExpandRows, N - n0);
    float* t = tile.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequantize_row<Tr>(w, n0 + r, units, t + r * padded);
    });
    result.narrow(1, n0, rows).copy_(at::mm(xs, tile.narrow(0, 0, rows).narrow(1, 0, K).t()));
  }
}

// The interleaved layouts' 8-bit products outrun the bfloat16 panels at every batch size (the
// panels' VDPBF16PS does half a VPDPBUSD's multiply-adds): prefill runs on them too.
template <typename Tr>
constexpr bool dots_at_any_batch(bool exact) {
  return ROSEINFER_GGUF_VNNI && rows_together<Tr>() > 1 && !exact;
}

template <typename Tr>
void matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int64_t ldo, bool exact) {
  if (M > kDotRows && !dots_at_any_batch<Tr>(exact)) {
    if (!exact && roseinfer::has_panel_kernel(torch::kBFloat16)) {
      std::vector<c10::BFloat16> xb(M * K);
      for (int64_t i = 0; i < M * K; ++i) roseinfer::store_float(xb.data() + i, x[i]);
      panel_matmul_blocks<Tr>(xb.data(), M, K, w, N, out, ldo);
    } else if (roseinfer::has_panel_kernel(torch::kFloat)) {
      panel_matmul_blocks<Tr>(x, M, K, w, N, out, ldo);
    } else {
      expanded_matmul<Tr>(x, M, K, w, N, out, ldo);
    }
    return;
  }
#if ROSEINFER_GGUF_VNNI
  if (!exact) {
    dot_matmul<Tr>(x, M, K, w, N, out, ldo);
    return;
  }
#endif
  float_rows_matmul<Tr>(x, M, K, w, N, out, ldo);
}

// Calls f with the traits of kernel type `type` (a GGML type id, or an interleaved layout's).
template <typename F>
void dispatch(int64_t type, F&& f) {
  const int t = static_cast<int>(type);
  TORCH_CHECK(with_block_traits(t, f) || with_interleaved_traits(t, f), "GGML type ", type,
              " has no kernel here (see gguf_types())");
}

// An interleaved layout holds whole groups of its rows.
void check_rows(int64_t type, int64_t N) {
  with_interleaved_traits(static_cast<int>(type), [&](auto traits) {
    constexpr int64_t R = rows_together<decltype(traits)>();
    TORCH_CHECK(N % R == 0, "an interleaved weight (kernel type ", type, ") has a multiple of ", R, " rows, not ", N);
  });
}

void check_weight(const torch::Tensor& w, int64_t bytes_per_row) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "a packed GGUF weight is a contiguous uint8 CPU matrix [N, row bytes]");
  TORCH_CHECK(w.size(1) == bytes_per_row, "the packed weight has ", w.size(1), " bytes a row, its type needs ",
              bytes_per_row);
}

}  // namespace

int64_t gguf_row_bytes(int64_t type, int64_t K);

namespace roseinfer {

void gguf_matmul(int type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out, int64_t ldo,
                 bool exact) {
  dispatch(type, [&](auto traits) { matmul<decltype(traits)>(x, M, K, w, N, out, ldo, exact); });
}

void gguf_matmul_group(const std::vector<GgufProduct>& products, bool exact) {
#if ROSEINFER_GGUF_VNNI
  const bool dots = !exact && std::all_of(products.begin(), products.end(),
                                          [](const GgufProduct& p) { return p.M <= kDotRows; });
  if (dots) {
    // Rows per task: about kTaskBytes of weights, a multiple of every layout's rows_together().
    // Tasks of 64 rows (~74 KB of an OLMoE expert) made one-stream decode 14-19% slower than
    // 256-2048 rows: every task starts a new stream through memory and a trip to the counter.
    thread_local std::vector<ActivationBuffers> buffers;
    if (buffers.size() < products.size()) buffers.resize(products.size());
    std::vector<Activations> activations(products.size());
    struct Task {
      size_t product;
      int64_t n0, n1;
    };
    std::vector<Task> tasks;
    for (size_t i = 0; i < products.size(); ++i) {
      const GgufProduct& p = products[i];
      // Products of one input and type (a decode row's experts) share its quantized activations.
      size_t same = i;
      for (size_t j = 0; j < i && same == i; ++j)
        if (products[j].x == p.x && products[j].M == p.M && products[j].K == p.K && products[j].type == p.type)
          same = j;
      int64_t rows = 0;
      dispatch(p.type, [&](auto traits) {
        using Tr = decltype(traits);
        activations[i] = same < i ? activations[same] : quantize_activations<Tr>(p.x, p.M, p.K, buffers[i]);
        rows = std::max<int64_t>(1, kTaskBytes / row_bytes<Tr>(p.K) / 64) * 64;
      });
      for (int64_t n0 = 0; n0 < p.N; n0 += rows) tasks.push_back({i, n0, std::min(p.N, n0 + rows)});
    }
    run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
      const Task& task = tasks[t];
      const GgufProduct& p = products[task.product];
      dispatch(p.type, [&](auto traits) {
        using Tr = decltype(traits);
        dot_rows<Tr>(activations[task.product], p.M, units_of<Tr>(p.K), p.w, task.n0, task.n1, p.out, p.ldo);
      });
    });
    return;
  }
#endif
  for (const GgufProduct& p : products) gguf_matmul(p.type, p.x, p.M, p.K, p.w, p.N, p.out, p.ldo, exact);
}

void gguf_check(const torch::Tensor& part, int64_t type, int64_t K) {
  check_weight(part, gguf_row_bytes(type, K));
  check_rows(type, part.size(0));
}

}  // namespace roseinfer

// The types this build runs, as GGML type ids.
std::vector<int64_t> gguf_types() {
  std::vector<int64_t> types;
  for (int t = 0; t < 64; ++t)
    if (with_block_traits(t, [](auto) {})) types.push_back(t);
  return types;
}

// "vnni" where the 8-bit dot products run, else "float" (exact products everywhere).
std::string gguf_kernel_isa() { return ROSEINFER_GGUF_VNNI ? "avx512-vnni" : "float"; }

int64_t gguf_row_bytes(int64_t type, int64_t K) {
  int64_t bytes = 0;
  dispatch(type, [&](auto traits) {
    using Tr = decltype(traits);
    check_k<Tr>(K);
    bytes = row_bytes<Tr>(K);
  });
  return bytes;
}

namespace {

// The file's rows -> the row layout (the same tensor for 256-value types).
torch::Tensor pack_rows(const torch::Tensor& raw, int64_t type, int64_t K, bool lasting) {
  torch::Tensor packed;
  TORCH_CHECK(with_block_traits(static_cast<int>(type), [&](auto traits) {
    using Tr = decltype(traits);
    check_k<Tr>(K);
    TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2, "raw GGUF rows are a uint8 matrix");
    if constexpr (Tr::kSuperAct) {
      check_weight(raw.contiguous(), row_bytes<Tr>(K));
      packed = raw.contiguous();
    } else {
      const int64_t blocks = K / 32, N = raw.size(0);
      TORCH_CHECK(raw.size(1) == blocks * Tr::kRawBlockBytes, "raw rows of ", K, " values take ",
                  blocks * Tr::kRawBlockBytes, " bytes, got ", raw.size(1));
      auto src = raw.contiguous();
      packed = lasting ? roseinfer::lasting_zeros({N, row_bytes<Tr>(K)}, torch::kUInt8)
                       : torch::zeros({N, row_bytes<Tr>(K)}, raw.options());
      const uint8_t* s = src.data_ptr<uint8_t>();
      uint8_t* d = packed.data_ptr<uint8_t>();
      const int64_t in_row = src.size(1), out_row = row_bytes<Tr>(K);
      at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t b = 0; b < blocks; ++b)
            Tr::pack_block(s + n * in_row + b * Tr::kRawBlockBytes, d + n * out_row + b / kGroupBlocks * Tr::kBytes,
                           static_cast<int>(b % kGroupBlocks));
      });
    }
  }), "GGML type ", type, " has no kernel here (see gguf_types())");
  return packed;
}

// The row layout -> the file's rows.
torch::Tensor unpack_rows(const torch::Tensor& packed, int64_t type, int64_t K) {
  torch::Tensor raw;
  with_block_traits(static_cast<int>(type), [&](auto traits) {
    using Tr = decltype(traits);
    check_weight(packed, row_bytes<Tr>(K));
    if constexpr (Tr::kSuperAct) {
      raw = packed.clone();
    } else {
      const int64_t blocks = K / 32, N = packed.size(0);
      raw = torch::empty({N, blocks * Tr::kRawBlockBytes}, packed.options());
      const uint8_t* s = packed.data_ptr<uint8_t>();
      uint8_t* d = raw.data_ptr<uint8_t>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < blocks; ++b)
          Tr::unpack_block(s + n * packed.size(1) + b / kGroupBlocks * Tr::kBytes,
                           d + (n * blocks + b) * Tr::kRawBlockBytes, static_cast<int>(b % kGroupBlocks));
    }
  });
  return raw;
}

}  // namespace

// The file's rows [N, bytes of a row] of GGML type `type` -> (the kernels' layout, its kernel type
// id): the row layout, or on VNNI builds, for the hot types and N a multiple of the layout's rows,
// the same rows 8 or 16 at a time interleaved.
std::tuple<torch::Tensor, int64_t> gguf_pack(torch::Tensor raw, int64_t type, int64_t K, bool lasting) {
  bool interleaves = false;
#if ROSEINFER_GGUF_VNNI
  with_interleaved_traits(static_cast<int>(type) + kInterleaved, [&](auto traits) {
    interleaves = raw.dim() == 2 && raw.size(0) % rows_together<decltype(traits)>() == 0;
  });
#endif
  // A lasting weight's final copy goes to weight memory (lasting_zeros); a row layout that is only
  // a step before interleaving is a temporary.
  torch::Tensor rows = pack_rows(raw, type, K, lasting && !interleaves), packed = rows;
  int64_t kernel_type = type;
#if ROSEINFER_GGUF_VNNI
  with_interleaved_traits(static_cast<int>(type) + kInterleaved, [&](auto traits) {
    using Tr = decltype(traits);
    constexpr int64_t R = rows_together<Tr>();
    if (!interleaves) return;
    const int64_t units = units_of<Tr>(K), groups = rows.size(0) / R, in_row = rows.size(1);
    packed = lasting ? roseinfer::lasting_zeros({rows.size(0), row_bytes<Tr>(K)}, torch::kUInt8)
                     : torch::empty({rows.size(0), row_bytes<Tr>(K)}, rows.options());
    const uint8_t* s = rows.data_ptr<uint8_t>();
    uint8_t* d = packed.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t u = 0; u < units; ++u) {
          const uint8_t* unit_rows[R];
          for (int r = 0; r < R; ++r) unit_rows[r] = s + (g * R + r) * in_row + u * Tr::Row::kBytes;
          Tr::interleave(unit_rows, d + (g * units + u) * Tr::kBytes);
        }
    });
    kernel_type = Tr::kType;
  });
#endif
  return {packed, kernel_type};
}

// The kernels' layout (of kernel type `type`) back to the file's bytes.
torch::Tensor gguf_unpack(torch::Tensor packed, int64_t type, int64_t K) {
  torch::Tensor raw;
  if (with_interleaved_traits(static_cast<int>(type), [&](auto traits) {
        using Tr = decltype(traits);
        check_weight(packed, row_bytes<Tr>(K));
        check_rows(type, packed.size(0));
        constexpr int64_t R = rows_together<Tr>();
        const int64_t units = units_of<Tr>(K), N = packed.size(0), out_row = units * Tr::Row::kBytes;
        auto rows = torch::empty({N, out_row}, packed.options());
        const uint8_t* s = packed.data_ptr<uint8_t>();
        uint8_t* d = rows.data_ptr<uint8_t>();
        for (int64_t n = 0; n < N; ++n)
          for (int64_t u = 0; u < units; ++u)
            Tr::gather(s + ((n / R) * units + u) * Tr::kBytes, static_cast<int>(n % R),
                       d + n * out_row + u * Tr::Row::kBytes);
        raw = unpack_rows(rows, Tr::Row::kType, K);
      })) {
    return raw;
  }
  return unpack_rows(packed, type, K);
}

// Rows `ids` (int64) of a packed [N, K] weight, exact, as float32 or bfloat16 (rounded once):
// embedding lookups; with no ids, every row (the whole weight, --quantization none).
torch::Tensor gguf_dequantize(torch::Tensor packed, int64_t type, int64_t K, c10::optional<torch::Tensor> ids,
                              c10::ScalarType dtype) {
  torch::Tensor out;
  dispatch(type, [&](auto traits) {
    using Tr = decltype(traits);
    check_k<Tr>(K);
    check_weight(packed, row_bytes<Tr>(K));
    check_rows(type, packed.size(0));
    const int64_t N = packed.size(0), units = units_of<Tr>(K);
    torch::Tensor index;
    if (ids.has_value() && ids->defined()) {
      index = ids->to(torch::kLong).contiguous();
      TORCH_CHECK(index.numel() == 0 || (index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < N),
                  "row ids out of range [0, ", N, ")");
    } else {
      index = torch::arange(N, torch::kLong);
    }
    const int64_t rows = index.numel();
    TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf,
                "dequantize to float32, bfloat16 or float16");
    out = torch::empty({rows, K}, torch::TensorOptions().dtype(dtype));
    const int64_t* id = index.data_ptr<int64_t>();
    const uint8_t* w = packed.data_ptr<uint8_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "gguf_dequantize", [&] {
      scalar_t* o = out.data_ptr<scalar_t>();
      at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> row(units * Tr::kValues);
        for (int64_t r = r0; r < r1; ++r) {
          dequantize_row<Tr>(w, id[r], units, row.data());
          if constexpr (std::is_same_v<scalar_t, float>) {
            std::copy_n(row.data(), K, o + r * K);
          } else {
            for (int64_t k = 0; k < K; ++k) roseinfer::store_float(o + r * K + k, row[k]);
          }
        }
      });
    });
  });
  return out;
}

// x [..., K] (float32 or bfloat16) @ w.T (+ bias) for a weight in packed parts of GGML types, each
// [N_i, K], stacked along N -> [..., sum N_i] of x's dtype.
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias, bool exact) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one GGML type per packed part");
  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    roseinfer::gguf_check(parts[i], types[i], K);
    N += parts[i].size(0);
  }
  auto rows = x.reshape({-1, K}).to(torch::kFloat).contiguous();
  const int64_t M = rows.size(0);
  auto out = torch::empty({M, N}, rows.options());
  int64_t first = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    roseinfer::gguf_matmul(static_cast<int>(types[i]), rows.data_ptr<float>(), M, K, parts[i].data_ptr<uint8_t>(),
                           parts[i].size(0), out.data_ptr<float>() + first, N, exact);
    first += parts[i].size(0);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "the bias has ", bias->numel(), " values for ", N, " outputs");
    out.add_(bias->to(torch::kFloat));
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return out.reshape(sizes).to(x.scalar_type());
}

// Interleaved layouts for the common GGUF types (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4): the same
// blocks, a group of weight rows side by side, so that one VPDPBUSD multiplies every row of the
// group by the same activation bytes (broadcast). Against the row layout (gguf_blocks.h) this
// shares the activation loads, the unpacking of codes and the float work of scales across the
// rows, and needs no horizontal sum per output. llama.cpp repacks Q4_0 / Q4_K / IQ4_NL the same way
// on x86 ("8x8"); these are AVX-512 kernels of our own over that idea. Two shapes:
//   - 8 rows, 8 bytes of each in a 64-byte load (IQ4_XS): row r in lanes 2r and 2r + 1 of a result
//     vector, summed at the end;
//   - 16 rows, 4 bytes of each (Q4_0, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K): one lane a row, and a kernel call
//     takes two groups so that each broadcast serves 32 rows (see KQuantX16).
//
// A unit is a group's unit of the row layout (`Row`); `gather` gives one row's unit back in the row
// layout, so exact expansion (embedding rows, prefill panels) reuses Row::dequantize. Activations
// are in natural order. A layout's kernel type id is the GGML type id + kInterleaved (see
// gguf_linear_cpu.cpp), and it says its rows (kRowsTogether) and groups a call (kGroups).

#pragma once

#include <utility>

#include "gguf_blocks.h"

namespace roseinfer::gguf {

constexpr int kInterleaved = 256;  // kernel type id = GGML type + this
constexpr int kRows = 8;           // rows side by side

// f(std::integral_constant<int, i>{}) for i = 0 .. N - 1, unrolled: the kernels index registers
// by these, which only stay registers where the index is a constant (GCC gives up unrolling
// loops this large on its own).
template <typename F, int... I>
__attribute__((always_inline)) inline void static_for_each(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__attribute__((always_inline)) inline void static_for(F&& f) {
  static_for_each(f, std::make_integer_sequence<int, N>{});
}

#if ROSEINFER_GGUF_VNNI
inline __m512i broadcast8(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// 8 float16 values (one per row) as 16 lanes, each row's value in its two lanes.
inline __m512 row_pairs(const uint8_t* halves) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                               _mm512_castps256_ps512(v));
}

// The 8 row results of lanes (2r, 2r + 1) summed, stored to out[0..7].
inline void store_rows(__m512 acc, float* out) {
  const __m512 sum = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));  // each lane + its pair
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_maskz_compress_ps(0x5555, sum)));
}

// 16 float16 values (one per row of a 16-row group) as floats.
inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// p[g][t] += codes[g] . (row m0 + t's 4 activation codes at `value`, broadcast to every lane), for
// each row of x and group: the step of the 16-row kernels (one broadcast serves the G groups).
template <int G, int T>
__attribute__((always_inline)) inline void broadcast_products(const __m512i (&codes)[G], const Activations& a,
                                                              int64_t m0, int64_t value, __m512i (&p)[G][T]) {
  for (int t = 0; t < T; ++t) {
    int32_t four;
    std::memcpy(&four, a.q + (m0 + t) * a.q_stride + value, 4);
    const __m512i x = _mm512_set1_epi32(four);
    for (int g = 0; g < G; ++g) p[g][t] = _mm512_dpbusd_epi32(p[g][t], codes[g], x);
  }
}

template <int G, int T>
__attribute__((always_inline)) inline void set_zero(__m512i (&v)[G][T]) {
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < T; ++t) v[g][t] = _mm512_setzero_si512();
}

// The frame of the 16-row kernels: float sums acc[g][t] (lane r: row r of group g . x[m0 + t])
// over the units of G groups of rows (group g at rows + g * group_bytes), unit(its G units, u,
// acc) adding each unit's products; out[t][16 g + r] at the end.
template <int G, int T, int Bytes, typename Unit>
__attribute__((always_inline)) inline void over_units16(const uint8_t* rows, int64_t group_bytes, int64_t units,
                                                        float out[][G * 16], Unit&& unit) {
  __m512 acc[G][T];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < T; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* at[G];
    for (int g = 0; g < G; ++g) at[g] = rows + g * group_bytes + u * Bytes;
    unit(at, u, acc);
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out[t] + g * 16, acc[g][t]);
}

// out[t] = the sum over pairs p < Pairs of (each row's two bytes at bytes + 32 p, widened to words,
// signed or not) . (the two int16 activation sums at sums_of(t) + 2 p): the per-run terms of the
// 16-row layouts (Q4_K's minimums, Q6_K's +32 offsets), two runs a VPDPWSSD.
template <bool Signed, int Pairs, int T, typename SumsOf>
inline void paired_run_terms(const uint8_t* bytes, SumsOf&& sums_of, __m512i out[T]) {
  for (int t = 0; t < T; ++t) out[t] = _mm512_setzero_si512();
  for (int p = 0; p < Pairs; ++p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + p * 32));
    const __m512i words = Signed ? _mm512_cvtepi8_epi16(raw) : _mm512_cvtepu8_epi16(raw);
    for (int t = 0; t < T; ++t) {
      int32_t two;
      std::memcpy(&two, sums_of(t) + 2 * p, 4);
      out[t] = _mm512_dpwssd_epi32(out[t], words, _mm512_set1_epi32(two));
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// Q4_0, Q8_0 and MXFP4: 16 rows side by side in groups of 4 blocks of 32, one VPDPBUSD lane a row
// as in KQuantX16 (two groups a kernel call, so that each 4-byte activation broadcast serves 32
// rows). Per block: the 16 rows' scales (float16; MXFP4: E8M0 bytes), then the codes in chunks of
// 64 bytes, chunk c holding bytes 4 c .. + 3 of each row's block codes (4-bit: 4 chunks, low
// nibbles values 4 c .., high nibbles 16 + 4 c .., MXFP4's through its table; Q8_0: 8 chunks,
// values 4 c ..). The bytes of the file, reordered.
// Against 8 rows of 8 bytes in a load (a lane pair a row), the float work of a block (offset,
// convert, scale) is shared by twice the products: in cache, 16 rows of x, one thread, Q4_0 went
// from 2.0-2.4 to 1.5-1.6 ns per 256 values (Q8_0 2.0-2.5 to 1.5-1.6; Q4_K's kernel: 1.6-1.9).
// ------------------------------------------------------------------------------------------------

template <typename R>
struct GroupX16 {
  using Row = R;
  static constexpr int kType = Row::kType + kInterleaved;
  static constexpr int kRowsTogether = 16, kGroups = 2;
  static constexpr int kValues = Row::kValues;
  static constexpr int kBytes = kRowsTogether * Row::kBytes;
  static constexpr bool kSuperAct = false;
  static constexpr bool kInt8 = Row::kCodeBytes == 128;
  static constexpr int kChunks = kInt8 ? 8 : 4;  // chunks of 64 bytes a block
  static constexpr bool kLookup = Row::kTableOffset >= 0;  // 4-bit indices into a table of values
  static constexpr int kScaleBytes = Row::kScaleBytes;
  static constexpr int kBlockBytes = kRowsTogether * kScaleBytes + kChunks * 64;
  static_assert(kBytes == kGroupBlocks * kBlockBytes, "a unit is its rows' bytes, reordered");

  static int native(int p) { return p; }

  static constexpr int chunk(int b, int c) { return b * kBlockBytes + kRowsTogether * kScaleBytes + c * 64; }

  static void interleave(const uint8_t* const rows[kRowsTogether], uint8_t* unit) {
    for (int r = 0; r < kRowsTogether; ++r)
      for (int b = 0; b < kGroupBlocks; ++b) {
        std::memcpy(unit + b * kBlockBytes + kScaleBytes * r, rows[r] + Row::kScaleOffset + kScaleBytes * b,
                    kScaleBytes);
        for (int c = 0; c < kChunks; ++c)
          std::memcpy(unit + chunk(b, c) + 4 * r, rows[r] + b * (Row::kCodeBytes / kGroupBlocks) + 4 * c, 4);
      }
  }
  static void gather(const uint8_t* unit, int r, uint8_t* row) {
    for (int b = 0; b < kGroupBlocks; ++b) {
      std::memcpy(row + Row::kScaleOffset + kScaleBytes * b, unit + b * kBlockBytes + kScaleBytes * r,
                  kScaleBytes);
      for (int c = 0; c < kChunks; ++c)
        std::memcpy(row + b * (Row::kCodeBytes / kGroupBlocks) + 4 * c, unit + chunk(b, c) + 4 * r, 4);
    }
  }

#if ROSEINFER_GGUF_VNNI
  // The 16 rows' scales of a block, as floats.
  static __m512 scales16(const uint8_t* p) {
    if constexpr (kScaleBytes == 1) {  // E8M0 at half (e8m0_half), 16 at a time
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      return _mm512_castsi512_ps(
          _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
    } else {
      return halves16(p);
    }
  }

  // out[t][16 g + r] = row r of group g . x[m0 + t], for T rows of x and G groups of 16 rows
  // (group g at rows + g * group_bytes).
  template <int G, int T>
  static void dot_groups(const uint8_t* rows, int64_t group_bytes, int64_t units, const Activations& a, int64_t m0,
                         float out[][G * kRowsTogether]) {
    // Independent VPDPBUSD chains: G * T, or two a pair (g, t) where that is fewer than 8 (see
    // KQuantX16): the second takes the high nibbles (Q4_0) or the odd chunks (Q8_0).
    constexpr int kHalves = G * T >= 8 ? 1 : 2;
    const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i table = nibble;  // (unused but by the table types)
    if constexpr (kLookup) table = shifted_values<Row::kTable, Row::kOffset>();
    over_units16<G, T, kBytes>(rows, group_bytes, units, out,
                               [&](const uint8_t* const (&unit)[G], int64_t u, __m512 (&acc)[G][T])
                                   __attribute__((always_inline)) {
      for (int b = 0; b < kGroupBlocks; ++b) {
        const int64_t block = u * kGroupBlocks + b;
        __m512i p[kHalves][G][T];
        // The codes carry +offset: offset * (the sum of the block's activation codes) comes
        // off, by starting the sums there.
        for (int t = 0; t < T; ++t) {
          const __m512i start = _mm512_set1_epi32(-Row::kOffset * a.sums32[(m0 + t) * a.d_stride + block]);
          for (int g = 0; g < G; ++g) {
            p[0][g][t] = start;
            if constexpr (kHalves == 2) p[1][g][t] = _mm512_setzero_si512();
          }
        }
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          __m512i low[G], high[G];
          for (int g = 0; g < G; ++g) {
            const __m512i packed = _mm512_loadu_si512(unit[g] + chunk(b, c));
            if constexpr (kInt8) {
              low[g] = _mm512_xor_si512(packed, flip);
            } else {
              low[g] = _mm512_and_si512(packed, nibble);
              high[g] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
              if constexpr (kLookup) {
                low[g] = _mm512_shuffle_epi8(table, low[g]);
                high[g] = _mm512_shuffle_epi8(table, high[g]);
              }
            }
          }
          if constexpr (kInt8) {
            broadcast_products<G, T>(low, a, m0, block * 32 + 4 * c, p[(c % 2) * (kHalves - 1)]);
          } else {
            broadcast_products<G, T>(low, a, m0, block * 32 + 4 * c, p[0]);
            broadcast_products<G, T>(high, a, m0, block * 32 + 16 + 4 * c, p[kHalves - 1]);
          }
        }
        for (int g = 0; g < G; ++g) {
          const __m512 d = scales16(unit[g] + b * kBlockBytes);
          for (int t = 0; t < T; ++t) {
            __m512i sum = p[0][g][t];
            if constexpr (kHalves == 2) sum = _mm512_add_epi32(sum, p[1][g][t]);
            const __m512 dx = _mm512_set1_ps(a.d[(m0 + t) * a.d_stride + block]);
            acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), acc[g][t]);
          }
        }
      }
    });
  }
#endif
};

using Q4_0x16 = GroupX16<Q4_0>;
using Q8_0x16 = GroupX16<Q8_0>;
using MXFP4x16 = GroupX16<MXFP4>;

// ------------------------------------------------------------------------------------------------
// Q4_K and Q5_K: 16 rows side by side, 4 bytes of each in a 64-byte chunk, so that a VPDPBUSD lane
// is one row and the 4 activation bytes it multiplies are one broadcast, which serves two such
// groups of rows (a kernel call takes 32 rows). A super-block: the 16 rows' d, then dmin (float16),
// the scales decoded to bytes ([run][row], 8 runs of 32), the minimums decoded to bytes in pairs
// of runs ([pair][row][run 2 pair, 2 pair + 1]), then the codes: chunk (j, c), j < 4, c < 8, holds
// bytes 32 j + 4 c .. + 3 of each row's qs (low nibbles: values 64 j + 4 c.., run 2j; high: 64 j +
// 32 + 4 c.., run 2j + 1); Q5_K then its fifth bits, chunk c holding bytes 4 c .. + 3 of each row's
// qh (bit r: value 32 r + 4 c ..). 4 bytes a row more than the file (the scales stored decoded).
//
// Zen 4 starts two 512-bit operations a cycle, one of them a VPDPBUSD at most: the instructions
// around the VPDPBUSDs set the speed, so the kernel keeps them few: per run and row of x, 8
// VPDPBUSD, 4 broadcasts (half of 8: each serves both groups) and the run's scale applied in
// integers (VPMULLD, VPADDD); the minimums once a super-block, two runs a VPDPWSSD.
// ------------------------------------------------------------------------------------------------

template <typename R, bool HighBit>
struct KQuantX16 {
  using Row = R;
  static constexpr int kType = Row::kType + kInterleaved;
  static constexpr int kRowsTogether = 16, kGroups = 2;
  static constexpr int kValues = 256;
  static constexpr int kScales = 64, kMins = kScales + 128, kCodes = kMins + 128, kHigh = kCodes + 32 * 64;
  static constexpr int kBytes = kHigh + (HighBit ? 8 * 64 : 0);  // 2368 (Q4_K), 2880 (Q5_K)
  static constexpr int kRowQs = HighBit ? 48 : 16;               // where a row unit's qs start
  static constexpr bool kSuperAct = true;

  static int native(int p) { return p; }

  // Where run `run`'s minimum of row r sits.
  static constexpr int min_place(int run, int r) { return kMins + (run / 2) * 2 * kRowsTogether + 2 * r + run % 2; }

  static void interleave(const uint8_t* const rows[kRowsTogether], uint8_t* unit) {
    for (int r = 0; r < kRowsTogether; ++r) {
      std::memcpy(unit + 2 * r, rows[r], 2);
      std::memcpy(unit + 32 + 2 * r, rows[r] + 2, 2);
      uint8_t sc[8], mn[8];
      k_scale_min(rows[r] + 4, sc, mn);
      for (int run = 0; run < 8; ++run) {
        unit[kScales + run * kRowsTogether + r] = sc[run];
        unit[min_place(run, r)] = mn[run];
      }
      for (int ch = 0; ch < 32; ++ch) std::memcpy(unit + kCodes + ch * 64 + r * 4, rows[r] + kRowQs + ch * 4, 4);
      if constexpr (HighBit)
        for (int ch = 0; ch < 8; ++ch) std::memcpy(unit + kHigh + ch * 64 + r * 4, rows[r] + 16 + ch * 4, 4);
    }
  }
  static void gather(const uint8_t* unit, int r, uint8_t* row) {
    std::memcpy(row, unit + 2 * r, 2);
    std::memcpy(row + 2, unit + 32 + 2 * r, 2);
    uint8_t* packed = row + 4;  // the 12 bytes of 6-bit scales and minimums, as k_scale_min reads them
    for (int j = 0; j < 4; ++j) {
      const uint8_t sc0 = unit[kScales + j * kRowsTogether + r], sc1 = unit[kScales + (j + 4) * kRowsTogether + r];
      const uint8_t mn0 = unit[min_place(j, r)], mn1 = unit[min_place(j + 4, r)];
      packed[j] = static_cast<uint8_t>((sc0 & 63) | ((sc1 >> 4) << 6));
      packed[j + 4] = static_cast<uint8_t>((mn0 & 63) | ((mn1 >> 4) << 6));
      packed[j + 8] = static_cast<uint8_t>((sc1 & 0x0F) | ((mn1 & 0x0F) << 4));
    }
    for (int ch = 0; ch < 32; ++ch) std::memcpy(row + kRowQs + ch * 4, unit + kCodes + ch * 64 + r * 4, 4);
    if constexpr (HighBit)
      for (int ch = 0; ch < 8; ++ch) std::memcpy(row + 16 + ch * 4, unit + kHigh + ch * 64 + r * 4, 4);
  }

#if ROSEINFER_GGUF_VNNI
  // out[t][16 g + r] = row r of group g . x[m0 + t], for T rows of x and G groups of 16 rows
  // (group g at rows + g * group_bytes).
  template <int G, int T>
  static void dot_groups(const uint8_t* rows, int64_t group_bytes, int64_t units, const Activations& a, int64_t m0,
                         float out[][G * kRowsTogether]) {
    // Independent VPDPBUSD chains: G * T, or each run in two halves where that is fewer than 8
    // (a VPDPBUSD takes 4 cycles to its result and the core starts one a cycle).
    constexpr int kHalves = G * T >= 8 ? 1 : 2;
    const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    over_units16<G, T, kBytes>(rows, group_bytes, units, out,
                               [&](const uint8_t* const (&unit)[G], int64_t u, __m512 (&acc)[G][T])
                                   __attribute__((always_inline)) {
      __m512i sums[G][T];  // the unit's sum over runs of scale * (codes . x codes)
      set_zero(sums);
#pragma GCC unroll 8
      for (int run = 0; run < 8; ++run) {
        __m512i p[kHalves][G][T];
        for (int h = 0; h < kHalves; ++h)
          for (int g = 0; g < G; ++g)
            for (int t = 0; t < T; ++t) p[h][g][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          __m512i codes[G];  // values 32 run + 4 c .. + 3 of the group's 16 rows
          for (int g = 0; g < G; ++g) {
            const __m512i packed = _mm512_loadu_si512(unit[g] + kCodes + ((run / 2) * 8 + c) * 64);
            codes[g] = _mm512_and_si512(run % 2 ? _mm512_srli_epi16(packed, 4) : packed, nibble);
            if constexpr (HighBit) {
              const __m512i qh = _mm512_loadu_si512(unit[g] + kHigh + c * 64);
              codes[g] = _mm512_mask_add_epi8(
                  codes[g], _mm512_test_epi8_mask(qh, _mm512_set1_epi8(static_cast<char>(1 << run))), codes[g], bit4);
            }
          }
          broadcast_products<G, T>(codes, a, m0, u * 256 + run * 32 + 4 * c, p[c * kHalves / 8]);
        }
        for (int g = 0; g < G; ++g) {
          const __m512i scale = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit[g] + kScales + run * kRowsTogether)));
          for (int t = 0; t < T; ++t) {
            __m512i sum = p[0][g][t];
            if constexpr (kHalves == 2) sum = _mm512_add_epi32(sum, p[1][g][t]);
            // |sum| <= 32 * 31 * 127 and the scale < 64: 8 runs stay far inside 31 bits.
            sums[g][t] = _mm512_add_epi32(sums[g][t], _mm512_mullo_epi32(sum, scale));
          }
        }
      }
      // Minimums: a pair of runs' minimums as words (each lane: one row's two), against the two
      // runs' activation code sums: one VPDPWSSD per pair.
      for (int g = 0; g < G; ++g) {
        const __m512 d = halves16(unit[g]), dmin = halves16(unit[g] + 32);
        __m512i mins[T];
        paired_run_terms<false, 4, T>(
            unit[g] + kMins, [&](int t) { return a.run_sums + ((m0 + t) * a.d_stride + u) * 8; }, mins);
        for (int t = 0; t < T; ++t) {
          const __m512 dx = _mm512_set1_ps(a.d[(m0 + t) * a.d_stride + u]);
          acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][t]), _mm512_mul_ps(d, dx), acc[g][t]);
          acc[g][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dmin, dx), acc[g][t]);
        }
      }
    });
  }
#endif
};

using Q4_Kx16 = KQuantX16<Q4_K, false>;
using Q5_Kx16 = KQuantX16<Q5_K, true>;

// ------------------------------------------------------------------------------------------------
// IQ4_XS: per super-block, the 8 rows' d (float16), the run scales decoded ([run][row] int8, the
// 6-bit value - 32, 8 runs of 32), then the codes: chunk (run, c) of rows 0..7 holds bytes 16 run +
// 8 c .. of each row's qs (low nibbles: values 32 run + 8 c.., high: 32 run + 16 + 8 c..).
// ------------------------------------------------------------------------------------------------

struct IQ4_XSx8 {
  using Row = IQ4_XS;
  static constexpr int kType = Row::kType + kInterleaved;
  static constexpr int kRowsTogether = kRows, kGroups = 1;
  static constexpr int kValues = 256;
  static constexpr int kScales = 16, kCodes = kScales + 64;
  static constexpr int kBytes = kCodes + 16 * 64;  // 1104: 2 bytes a row more than the file
  static constexpr bool kSuperAct = true;

  static int native(int p) { return p; }

  static void interleave(const uint8_t* const rows[kRows], uint8_t* unit) {
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(unit + 2 * r, rows[r], 2);
      for (int run = 0; run < 8; ++run) unit[kScales + run * kRows + r] = static_cast<uint8_t>(Row::scale(rows[r], run));
      for (int ch = 0; ch < 16; ++ch) std::memcpy(unit + kCodes + ch * 64 + r * 8, rows[r] + 8 + ch * 8, 8);
    }
  }
  static void gather(const uint8_t* unit, int r, uint8_t* row) {
    std::memcpy(row, unit + 2 * r, 2);
    uint16_t high = 0;
    for (int run = 0; run < 8; ++run) {
      const int ls = static_cast<int8_t>(unit[kScales + run * kRows + r]) + 32;
      high = static_cast<uint16_t>(high | ((ls >> 4) & 3) << (2 * run));
      uint8_t& low = row[4 + run / 2];
      low = static_cast<uint8_t>(run % 2 ? (low & 0x0F) | ((ls & 0x0F) << 4) : (ls & 0x0F));
    }
    std::memcpy(row + 2, &high, 2);
    for (int ch = 0; ch < 16; ++ch) std::memcpy(row + 8 + ch * 8, unit + kCodes + ch * 64 + r * 8, 8);
  }

#if ROSEINFER_GGUF_VNNI
  template <int G, int T>
  static void dot_groups(const uint8_t* rows, int64_t, int64_t units, const Activations& a, int64_t m0,
                         float out[][kRows]) {
    static_assert(G == 1, "one group of 8 rows a call");
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i table = shifted_values<kIQ4Values, 128>();
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* unit = rows + u * kBytes;
      const __m512 d = row_pairs(unit);
      for (int run = 0; run < 8; ++run) {
        __m512i codes[4];  // values 32 run + 8 i ..: unsigned, the value + 128
        for (int c = 0; c < 2; ++c) {
          const __m512i packed = _mm512_loadu_si512(unit + kCodes + (run * 2 + c) * 64);
          codes[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(packed, nibble));
          codes[c + 2] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble));
        }
        const __m128i ls = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + kScales + run * kRows));
        const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(ls, ls))));
        for (int t = 0; t < T; ++t) {
          const int8_t* xq = a.q + (m0 + t) * a.q_stride + u * 256 + run * 32;
          __m512i p = _mm512_setzero_si512();
          for (int i = 0; i < 4; ++i) p = _mm512_dpbusd_epi32(p, codes[i], broadcast8(xq + 8 * i));
          const int16_t* s16 = a.sums + (m0 + t) * a.sums_stride + u * 16 + 2 * run;
          p = _mm512_sub_epi32(p, _mm512_set1_epi32(64 * (s16[0] + s16[1])));  // the +128, half a lane each
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                   _mm512_mul_ps(scale, _mm512_set1_ps(a.d[(m0 + t) * a.d_stride + u])), acc[t]);
        }
      }
    }
    for (int t = 0; t < T; ++t) store_rows(acc[t], out[t]);
  }
#endif
};

// ------------------------------------------------------------------------------------------------
// Q6_K: 16 rows side by side as Q4_K's (see KQuantX16), two groups a kernel call. A super-block:
// the 16 rows' d (float16), the scales in pairs of runs ([pair][row][runs 2 pair, 2 pair + 1],
// int8, 16 runs of 16 values), then for each half h < 2 of the values, in the order the kernel
// first reads them: the low-nibble chunks (h, 0, c), c < 8, the high-bit chunks (h, c), the
// low-nibble chunks (h, 1, c). Chunk (h, k, c): bytes 64 h + 32 k + 4 c .. + 3 of each row's ql;
// high-bit chunk (h, c): bytes 32 h + 4 c .. + 3 of each row's qh. Value 128 h + 32 s + l (l < 32)
// is ql[64 h + 32 (s % 2) + l]'s low (s < 2) or high nibble, with bits 2s, 2s + 1 of qh[32 h + l]
// above it, under run 8 h + 2 s + l / 16's scale. 210 bytes a row, as the file. (In the file's
// order, ql then qh, one stream of weights from memory ran at 7.7 GB/s on one core, against 14 for
// the 8-row layout: the order of first reads is what the prefetchers follow.)
// ------------------------------------------------------------------------------------------------

struct Q6_Kx16 {
  using Row = Q6_K;
  static constexpr int kType = Row::kType + kInterleaved;
  static constexpr int kRowsTogether = 16, kGroups = 2;
  static constexpr int kValues = 256;
  static constexpr int kScales = 32, kCodes = kScales + 256;
  static constexpr int kBytes = kCodes + 48 * 64;  // 3360

  static constexpr int low_chunk(int h, int k, int c) { return kCodes + (h * 24 + k * 16 + c) * 64; }
  static constexpr int high_chunk(int h, int c) { return kCodes + (h * 24 + 8 + c) * 64; }
  static constexpr bool kSuperAct = true;

  static int native(int p) { return p; }

  // Where run `run`'s scale of row r sits.
  static constexpr int scale_place(int run, int r) { return kScales + (run / 2) * 2 * kRowsTogether + 2 * r + run % 2; }

  static void interleave(const uint8_t* const rows[kRowsTogether], uint8_t* unit) {
    for (int r = 0; r < kRowsTogether; ++r) {
      std::memcpy(unit + 2 * r, rows[r] + 208, 2);
      for (int run = 0; run < 16; ++run) unit[scale_place(run, r)] = rows[r][192 + run];
      for (int ch = 0; ch < 32; ++ch) std::memcpy(unit + low_chunk(ch / 16, ch / 8 % 2, ch % 8) + r * 4, rows[r] + ch * 4, 4);
      for (int ch = 0; ch < 16; ++ch) std::memcpy(unit + high_chunk(ch / 8, ch % 8) + r * 4, rows[r] + 128 + ch * 4, 4);
    }
  }
  static void gather(const uint8_t* unit, int r, uint8_t* row) {
    std::memcpy(row + 208, unit + 2 * r, 2);
    for (int run = 0; run < 16; ++run) row[192 + run] = unit[scale_place(run, r)];
    for (int ch = 0; ch < 32; ++ch) std::memcpy(row + ch * 4, unit + low_chunk(ch / 16, ch / 8 % 2, ch % 8) + r * 4, 4);
    for (int ch = 0; ch < 16; ++ch) std::memcpy(row + 128 + ch * 4, unit + high_chunk(ch / 8, ch % 8) + r * 4, 4);
  }

#if ROSEINFER_GGUF_VNNI
  // out[t][16 g + r] = row r of group g . x[m0 + t], for T rows of x and G groups of 16 rows
  // (group g at rows + g * group_bytes). Codes carry +32 (0..63, unsigned for VPDPBUSD): 32 *
  // scale * (the run's activation code sum) comes off once a super-block, two runs a VPDPWSSD.
  template <int G, int T>
  static void dot_groups(const uint8_t* rows, int64_t group_bytes, int64_t units, const Activations& a, int64_t m0,
                         float out[][G * kRowsTogether]) {
    constexpr int kHalves = G * T >= 8 ? 1 : 2;  // independent VPDPBUSD chains (see KQuantX16)
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits = _mm512_set1_epi8(0x30);
    over_units16<G, T, kBytes>(rows, group_bytes, units, out,
                               [&](const uint8_t* const (&unit)[G], int64_t u, __m512 (&acc)[G][T])
                                   __attribute__((always_inline)) {
      __m512i sums[G][T];  // the unit's sum over runs of scale * (codes . x codes)
      set_zero(sums);
      static_for<8>([&](auto q) __attribute__((always_inline)) {  // values 32 q ..: runs 2 q, 2 q + 1
        constexpr int quarter = decltype(q)::value, h = quarter / 4, s = quarter % 4;
        __m512i scale[2][G];  // the runs' scales, dwords (lane r: row r's)
        for (int g = 0; g < G; ++g) {
          const __m512i pair = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit[g] + kScales + quarter * 2 * kRowsTogether)));
          scale[0][g] = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
          scale[1][g] = _mm512_srai_epi32(pair, 16);
        }
        static_for<2>([&](auto r) __attribute__((always_inline)) {  // values 32 quarter + 16 run ..
          constexpr int run = decltype(r)::value;
          __m512i p[kHalves][G][T];
          for (int i = 0; i < kHalves; ++i)
            for (int g = 0; g < G; ++g)
              for (int t = 0; t < T; ++t) p[i][g][t] = _mm512_setzero_si512();
          static_for<4>([&](auto i) __attribute__((always_inline)) {
            constexpr int c = 4 * run + decltype(i)::value, half = decltype(i)::value * kHalves / 4;
            __m512i codes[G];  // values 32 quarter + 4 c .. + 3 of the group's 16 rows
            for (int g = 0; g < G; ++g) {
              const __m512i low = _mm512_loadu_si512(unit[g] + low_chunk(h, s % 2, c));
              const __m512i high = _mm512_loadu_si512(unit[g] + high_chunk(h, c));
              __m512i nib, up;
              if constexpr (s < 2) {
                nib = _mm512_and_si512(low, nibble);
              } else {
                nib = _mm512_and_si512(_mm512_srli_epi16(low, 4), nibble);
              }
              if constexpr (s == 0) {
                up = _mm512_slli_epi16(high, 4);
              } else if constexpr (s == 1) {
                up = _mm512_slli_epi16(high, 2);
              } else if constexpr (s == 2) {
                up = high;
              } else {
                up = _mm512_srli_epi16(high, 2);
              }
              codes[g] = _mm512_ternarylogic_epi32(nib, up, bits, 0xF8);  // nib | (up & 0x30)
            }
            broadcast_products<G, T>(codes, a, m0, u * 256 + quarter * 32 + 4 * c, p[half]);
          });
          for (int g = 0; g < G; ++g)
            for (int t = 0; t < T; ++t) {
              __m512i sum = p[0][g][t];
              if constexpr (kHalves == 2) sum = _mm512_add_epi32(sum, p[1][g][t]);
              // |sum| <= 16 * 63 * 127, |scale| <= 128: 16 runs stay inside 31 bits.
              sums[g][t] = _mm512_add_epi32(sums[g][t], _mm512_mullo_epi32(sum, scale[run][g]));
            }
        });
      });
      for (int g = 0; g < G; ++g) {
        const __m512 d = halves16(unit[g]);
        __m512i offsets[T];
        paired_run_terms<true, 8, T>(
            unit[g] + kScales, [&](int t) { return a.sums + (m0 + t) * a.sums_stride + u * 16; }, offsets);
        for (int t = 0; t < T; ++t) {
          const __m512i total = _mm512_sub_epi32(sums[g][t], _mm512_slli_epi32(offsets[t], 5));
          acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total),
                                      _mm512_mul_ps(d, _mm512_set1_ps(a.d[(m0 + t) * a.d_stride + u])), acc[g][t]);
        }
      }
    });
  }
#endif
};

// Calls f with the interleaved traits of kernel type `type`; false if it has none.
template <typename F>
bool with_interleaved_traits(int type, F&& f) {
  switch (type) {
    case Q4_0x16::kType: f(Q4_0x16{}); return true;
    case Q8_0x16::kType: f(Q8_0x16{}); return true;
    case MXFP4x16::kType: f(MXFP4x16{}); return true;
    case Q4_Kx16::kType: f(Q4_Kx16{}); return true;
    case Q5_Kx16::kType: f(Q5_Kx16{}); return true;
    case Q6_Kx16::kType: f(Q6_Kx16{}); return true;
    case IQ4_XSx8::kType: f(IQ4_XSx8{}); return true;
    default: return false;
  }
}

}  // namespace roseinfer::gguf

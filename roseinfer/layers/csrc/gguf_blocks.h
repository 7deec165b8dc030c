// GGUF block types as the kernels hold them: one traits struct per type (ggml-cpu's type traits in
// spirit), read by the one driver in gguf_linear_cpu.cpp. Adding a type is one struct here and one
// entry in with_block_traits.
//
// A traits struct says:
//   kType, kValues, kBytes   the GGML type id; values and bytes of one unit of a row. A unit is a
//                            super-block for the K-quants and IQ4_XS (256 values, the file's own
//                            bytes), and for the 32-value types a group of 4 blocks repacked once
//                            at load (pack_group): the 4 blocks' codes side by side, then their
//                            scales, so one 64-byte load reads codes of 4 blocks (the same bytes as
//                            the file, reordered; a row's last group is padded with zero blocks).
//   kSuperAct                the activations' 8-bit format: one scale per 256 values with sums of
//                            the codes per 16 (llama.cpp's Q8_K), or one scale per 32 (Q8_0).
//   native(p)                which value of a unit sits at position p of the unit's codes as the
//                            dot unpacks them: the activations are stored in that order, once per
//                            call, so unpacking a weight never shuffles.
//   dequantize(unit, out)    the unit's values in natural order, exactly as gguf's numpy
//                            `dequantize` computes them (same operations, same order, no fused
//                            multiply-adds: the functions are built without fast-math).
//   dot<T>(row, units, ...)  AVX-512 VNNI: one weight row against T rows of 8-bit activations.
//
// Every type's codes are unpacked to unsigned bytes c with w = a * (c - offset) + b per run of 16
// or 32 values, so one kind of integer product serves all: VPDPBUSD (bytes times signed bytes,
// summed in int32 without saturation) where scales are floats per 32 values, VPMADDUBSW then
// VPDPWSSD where they are small integers under one float scale per 256 (K-quants), as llama.cpp.

#pragma once

#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ROSEINFER_GGUF_VNNI 1
#else
#define ROSEINFER_GGUF_VNNI 0
#endif

// Exact dequantization: no fast-math reassociation, no contraction into fused multiply-adds.
#define ROSEINFER_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace roseinfer::gguf {

constexpr int kGroupBlocks = 4;  // 32-value blocks per unit of the repacked types

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}
inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr std::array<int8_t, 16> kIQ4Values = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
// MXFP4's E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled, so integers, as
// gguf-py and ggml keep them; the block's scale is taken at half (e8m0_half) to match.
constexpr std::array<int8_t, 16> kMXFP4Values = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 scale byte e (the scale 2^(e - 127)) at half: 2^(e - 128), bit for bit as gguf-py's
// e8m0_to_fp32_half and ggml's ggml_e8m0_to_fp32_half (a subnormal below e = 2).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

#if ROSEINFER_GGUF_VNNI
// A table of 16 signed values + Offset as unsigned bytes, in every 128-bit lane: VPSHUFB turns
// 4-bit codes into the unsigned bytes VPDPBUSD multiplies (the dot takes Offset times the
// activations' sum off).
template <const std::array<int8_t, 16>& Values, int Offset>
inline __m512i shifted_values() {
  alignas(16) static constexpr std::array<uint8_t, 16> bytes = [] {
    std::array<uint8_t, 16> b{};
    for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(Values[i] + Offset);
    return b;
  }();
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes.data())));
}
#endif

// Native orders. Nibbles: within each 128 values (4 runs of 32), a 64-byte load of packed nibbles
// holds the first 16 values of each run in its low nibbles and the last 16 in its high ones.
inline int nibbles_native(int p) {
  const int base = p / 128 * 128, q = p % 128, half_ = q / 64, run = (q % 64) / 16;
  return base + run * 32 + half_ * 16 + q % 16;
}
// Q4_K / Q5_K: 32 bytes of codes hold 32 values in low nibbles and the next 32 in high nibbles, so
// a 64-byte load gives runs 0 and 2 (low), 1 and 3 (high) of each 128 values.
inline int q4k_native(int p) {
  constexpr int runs[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  return runs[p / 32] * 32 + p % 32;
}

// The 8-bit activations of `rows` rows, in the weight type's native order: codes per row, scales
// per 32 (Q8_0-like) or per 256 (Q8_K-like), and per-run sums of the codes.
struct Activations {
  const int8_t* q;
  const float* d;         // per scale unit
  const float* s;         // per 32 values (Q8_0-like): d * sum of the block's codes
  const int32_t* sums32;  // per 32 values (Q8_0-like): sum of the block's codes
  const int16_t* sums;    // per 16 values, natural order (Q8_K-like)
  // Per 32 values (Q8_K-like), 8 a scale unit: the sums of the runs' codes, two of them what the
  // 16-row K-quant kernel broadcasts against a pair of runs' minimums (see KQuantX16).
  const int16_t* run_sums;
  int64_t q_stride, d_stride, sums_stride;
};

// ------------------------------------------------------------------------------------------------
// The repacked 32-value types. A group: codes (16 bytes a block for 4-bit types, 32 for Q8_0),
// then for 5-bit types the high bits as two 64-bit masks (bit 16 b + j: value j, then value 16 + j,
// of block b), then the 4 blocks' scales (fp16; MXFP4: one E8M0 byte each), then their fp16
// minimums where the type has them.
// ------------------------------------------------------------------------------------------------

// Codes: 4-bit (Q4_0, Q4_1), 5-bit (Q5_0, Q5_1), int8 (Q8_0), 4-bit indices into a table of
// values (IQ4_NL: kIQ4Values; MXFP4: kMXFP4Values, under an E8M0 scale).
enum class Codes { kNibbles, kNibblesHigh, kInt8, kIQ4, kMXFP4 };

template <int Type, Codes C, bool Min, int RawBytes>
struct GroupTraits {
  static constexpr int kType = Type;
  static constexpr int kValues = kGroupBlocks * 32;
  static constexpr int kCodeBytes = C == Codes::kInt8 ? 128 : 64;
  static constexpr int kMaskOffset = kCodeBytes;
  static constexpr int kScaleOffset = kMaskOffset + (C == Codes::kNibblesHigh ? 16 : 0);
  static constexpr int kScaleBytes = C == Codes::kMXFP4 ? 1 : 2;  // E8M0, or fp16
  static constexpr int kMinOffset = kScaleOffset + kGroupBlocks * kScaleBytes;
  static constexpr int kBytes = kMinOffset + (Min ? 8 : 0);
  static constexpr int kRawBlockBytes = RawBytes;
  static constexpr bool kSuperAct = false;
  static_assert(kBytes == kGroupBlocks * RawBytes, "a group is its 4 blocks' bytes, reordered");
  // Unsigned code = w / scale (- minimum) + offset. (MXFP4's values are in -12..12: an offset of
  // 12 keeps the float correction of the dot as small as Q4_0's, where 128 made it 10x the sum.)
  static constexpr int kOffset = C == Codes::kNibbles ? (Min ? 0 : 8)
                                 : C == Codes::kNibblesHigh ? (Min ? 0 : 16)
                                 : C == Codes::kMXFP4       ? 12
                                                            : 128;  // int8 and IQ4 values, shifted
  static constexpr const std::array<int8_t, 16>& kTable = C == Codes::kMXFP4 ? kMXFP4Values : kIQ4Values;
  // kOffset where the codes index kTable (IQ4_NL, MXFP4), else -1.
  static constexpr int kTableOffset = C == Codes::kIQ4 || C == Codes::kMXFP4 ? kOffset : -1;

  // Block b's scale.
  static float scale(const uint8_t* group, int b) {
    if constexpr (C == Codes::kMXFP4) {
      return e8m0_half(group[kScaleOffset + b]);
    } else {
      return half(group + kScaleOffset + 2 * b);
    }
  }

  static int native(int p) { return C == Codes::kInt8 ? p : nibbles_native(p); }

  // One file block (raw) into slot b of a group.
  static void pack_block(const uint8_t* raw, uint8_t* group, int b) {
    std::memcpy(group + kScaleOffset + kScaleBytes * b, raw, kScaleBytes);  // d
    int at = kScaleBytes;
    if (Min) {
      std::memcpy(group + kMinOffset + 2 * b, raw + at, 2);
      at += 2;
    }
    if (C == Codes::kNibblesHigh) {
      const uint32_t qh = u32(raw + at);
      uint64_t lo, hi;
      std::memcpy(&lo, group + kMaskOffset, 8);
      std::memcpy(&hi, group + kMaskOffset + 8, 8);
      lo |= static_cast<uint64_t>(qh & 0xFFFF) << (16 * b);
      hi |= static_cast<uint64_t>(qh >> 16) << (16 * b);
      std::memcpy(group + kMaskOffset, &lo, 8);
      std::memcpy(group + kMaskOffset + 8, &hi, 8);
      at += 4;
    }
    const int code_bytes = kCodeBytes / kGroupBlocks;
    std::memcpy(group + b * code_bytes, raw + at, code_bytes);
  }
  // Slot b of a group back to a file block.
  static void unpack_block(const uint8_t* group, uint8_t* raw, int b) {
    std::memcpy(raw, group + kScaleOffset + kScaleBytes * b, kScaleBytes);
    int at = kScaleBytes;
    if (Min) {
      std::memcpy(raw + at, group + kMinOffset + 2 * b, 2);
      at += 2;
    }
    if (C == Codes::kNibblesHigh) {
      uint64_t lo, hi;
      std::memcpy(&lo, group + kMaskOffset, 8);
      std::memcpy(&hi, group + kMaskOffset + 8, 8);
      const uint32_t qh = static_cast<uint32_t>((lo >> (16 * b)) & 0xFFFF) |
                          (static_cast<uint32_t>((hi >> (16 * b)) & 0xFFFF) << 16);
      std::memcpy(raw + at, &qh, 4);
      at += 4;
    }
    const int code_bytes = kCodeBytes / kGroupBlocks;
    std::memcpy(raw + at, group + b * code_bytes, code_bytes);
  }

  // Value j (0..31) of block b as the file's integer code, before scale and minimum.
  static int code(const uint8_t* group, int b, int j) {
    if (C == Codes::kInt8) return static_cast<int8_t>(group[b * 32 + j]);
    const uint8_t byte = group[b * 16 + j % 16];
    int q = j < 16 ? (byte & 0x0F) : (byte >> 4);
    if (C == Codes::kIQ4 || C == Codes::kMXFP4) return kTable[q];
    if (C == Codes::kNibblesHigh) {
      uint64_t mask;
      std::memcpy(&mask, group + kMaskOffset + (j < 16 ? 0 : 8), 8);
      q |= static_cast<int>((mask >> (16 * b + j % 16)) & 1) << 4;
    }
    return Min ? q : q - kOffset;  // Q4_0 / Q5_0 centre their codes
  }

  // Loops of 16 values under one scale, which the compiler vectorises.
  ROSEINFER_EXACT static void dequantize(const uint8_t* group, float* out) {
    for (int b = 0; b < kGroupBlocks; ++b) {
      const float d = scale(group, b);
      const float m = Min ? half(group + kMinOffset + 2 * b) : 0.0f;
      float* o = out + b * 32;
      if constexpr (C == Codes::kInt8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(group) + b * 32;
        for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
      } else if constexpr (C == Codes::kIQ4 || C == Codes::kMXFP4) {
        const uint8_t* q = group + b * 16;
        for (int j = 0; j < 16; ++j) {
          o[j] = d * static_cast<float>(kTable[q[j] & 0x0F]);
          o[j + 16] = d * static_cast<float>(kTable[q[j] >> 4]);
        }
      } else {
        const uint8_t* q = group + b * 16;
        uint32_t high_lo = 0, high_hi = 0;  // 5-bit types: bit j of each is value j's (j + 16's) fifth bit
        if constexpr (C == Codes::kNibblesHigh) {
          uint64_t lo, hi;
          std::memcpy(&lo, group + kMaskOffset, 8);
          std::memcpy(&hi, group + kMaskOffset + 8, 8);
          high_lo = static_cast<uint32_t>(lo >> (16 * b)) & 0xFFFF;
          high_hi = static_cast<uint32_t>(hi >> (16 * b)) & 0xFFFF;
        }
        for (int j = 0; j < 16; ++j) {
          int low = q[j] & 0x0F, high = q[j] >> 4;
          if constexpr (C == Codes::kNibblesHigh) {
            low |= static_cast<int>((high_lo >> j) & 1) << 4;
            high |= static_cast<int>((high_hi >> j) & 1) << 4;
          }
          if constexpr (Min) {
            o[j] = d * static_cast<float>(low) + m;
            o[j + 16] = d * static_cast<float>(high) + m;
          } else {
            o[j] = d * static_cast<float>(low - kOffset);
            o[j + 16] = d * static_cast<float>(high - kOffset);
          }
        }
      }
    }
  }

#if ROSEINFER_GGUF_VNNI
  // The group's codes as unsigned bytes (positions 0-63 and 64-127 of the native order).
  static void unpack(const uint8_t* group, __m512i& c0, __m512i& c1) {
    if constexpr (C == Codes::kInt8) {
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      c0 = _mm512_xor_si512(_mm512_loadu_si512(group), flip);
      c1 = _mm512_xor_si512(_mm512_loadu_si512(group + 64), flip);
    } else {
      const __m512i nibble = _mm512_set1_epi8(0x0F);
      const __m512i packed = _mm512_loadu_si512(group);
      c0 = _mm512_and_si512(packed, nibble);
      c1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      if constexpr (C == Codes::kNibblesHigh) {
        uint64_t lo, hi;
        std::memcpy(&lo, group + kMaskOffset, 8);
        std::memcpy(&hi, group + kMaskOffset + 8, 8);
        const __m512i bit = _mm512_set1_epi8(0x10);
        c0 = _mm512_mask_add_epi8(c0, lo, c0, bit);
        c1 = _mm512_mask_add_epi8(c1, hi, c1, bit);
      } else if constexpr (C == Codes::kIQ4 || C == Codes::kMXFP4) {
        const __m512i table = shifted_values<kTable, kOffset>();
        c0 = _mm512_shuffle_epi8(table, c0);
        c1 = _mm512_shuffle_epi8(table, c1);
      }
    }
  }

  // The 4 blocks' scales.
  static __m128 scales4(const uint8_t* group) {
    if constexpr (C == Codes::kMXFP4) {  // e8m0_half, 4 at a time
      const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(u32(group + kScaleOffset))));
      const __m128i normal = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
      const __m128i tiny = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);
      return _mm_castsi128_ps(_mm_blendv_epi8(normal, tiny, _mm_cmplt_epi32(e, _mm_set1_epi32(2))));
    } else {
      return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + kScaleOffset)));
    }
  }

  // out[t] = row . x[m0 + t] for T rows.
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    // Per block b of a group, 4 int32 lanes (nibble types: lanes 4b..4b+3 of c0 and of c1) or 8
    // (int8: block b in lanes 8(b%2).. of c(b/2)) hold its products; spread maps scales to lanes.
    const __m512i spread4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i spread01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i spread23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 acc[T];
    __m128 corr[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      corr[t] = _mm_setzero_ps();
    }
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* group = row + u * kBytes;
      __m512i c0, c1;
      unpack(group, c0, c1);
      const __m128 dw = scales4(group);
      // Per block: minimum - offset * scale, which multiplies the sum of the block's activations.
      __m128 shift = _mm_mul_ps(dw, _mm_set1_ps(-static_cast<float>(kOffset)));
      if constexpr (Min)
        shift = _mm_add_ps(shift, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + kMinOffset))));
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.q + (m0 + t) * a.q_stride + u * kValues;
        const float* xd = a.d + (m0 + t) * a.d_stride + u * kGroupBlocks;
        const float* xs = a.s + (m0 + t) * a.d_stride + u * kGroupBlocks;
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, _mm512_loadu_si512(xq));
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c1, _mm512_loadu_si512(xq + 64));
        const __m512 scale = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(xd)));
        if constexpr (C == Codes::kInt8) {
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(spread01, scale), acc[t]);
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(spread23, scale), acc[t]);
        } else {
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(p0, p1)), _mm512_permutexvar_ps(spread4, scale),
                                   acc[t]);
        }
        corr[t] = _mm_fmadd_ps(shift, _mm_loadu_ps(xs), corr[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      __m128 c = _mm_add_ps(corr[t], _mm_movehl_ps(corr[t], corr[t]));
      c = _mm_add_ss(c, _mm_movehdup_ps(c));
      out[t] = _mm512_reduce_add_ps(acc[t]) + _mm_cvtss_f32(c);
    }
  }
#endif
};

using Q4_0 = GroupTraits<2, Codes::kNibbles, false, 18>;
using Q4_1 = GroupTraits<3, Codes::kNibbles, true, 20>;
using Q5_0 = GroupTraits<6, Codes::kNibblesHigh, false, 22>;
using Q5_1 = GroupTraits<7, Codes::kNibblesHigh, true, 24>;
using Q8_0 = GroupTraits<8, Codes::kInt8, false, 34>;
using IQ4_NL = GroupTraits<20, Codes::kIQ4, false, 18>;
using MXFP4 = GroupTraits<39, Codes::kMXFP4, false, 17>;

// ------------------------------------------------------------------------------------------------
// Super-block types: 256 values in the file's own bytes.
// ------------------------------------------------------------------------------------------------

struct SuperTraits {
  static constexpr int kValues = 256;
  static constexpr bool kSuperAct = true;
};

#if ROSEINFER_GGUF_VNNI
// Integer scales, one int16 per 16 values (`scales16`, 16 words), as four vectors of 32 words:
// vector k serves positions 64k..64k+63 of natural order, where a VPMADDUBSW word covers 2
// positions and a VPDPWSSD lane 4.
inline void spread_scales16(__m512i scales16, __m512i out[4]) {
  for (int k = 0; k < 4; ++k) {
    const __m512i index = _mm512_set_epi16(4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3,
                                           4 * k + 3, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2,
                                           4 * k + 2, 4 * k + 2, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1,
                                           4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k, 4 * k, 4 * k, 4 * k, 4 * k, 4 * k,
                                           4 * k, 4 * k);
    out[k] = _mm512_permutexvar_epi16(index, scales16);
  }
}
// Scales per 32 values for the Q4_K order (runs 0 and 2, 1 and 3, 4 and 6, 5 and 7 per vector).
inline void spread_scales32_q4k(__m512i scales8, __m512i out[4]) {
  constexpr int first[4] = {0, 1, 4, 5};
  for (int k = 0; k < 4; ++k) {
    const short a = static_cast<short>(first[k]), b = static_cast<short>(first[k] + 2);
    const __m256i lo = _mm256_set1_epi16(a), hi = _mm256_set1_epi16(b);
    out[k] = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), scales8);
  }
}

inline float reduce_half(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The integer part shared by the K-quants: sum over k of scales[k] . (codes[k] x activations).
template <int T>
inline void ksum(const __m512i codes[4], const __m512i scales[4], const Activations& a, int64_t m0, int64_t u,
                 __m512i out[T]) {
  for (int t = 0; t < T; ++t) {
    const int8_t* xq = a.q + (m0 + t) * a.q_stride + u * 256;
    __m512i s = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k)
      s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(codes[k], _mm512_loadu_si512(xq + 64 * k)), scales[k]);
    out[t] = s;
  }
}

// sum over the 16 runs of 16 values of weights[j] * (activation code sums)[j], as 8 int32 lanes.
inline __m256i run_sums(__m256i weights16, const int16_t* sums) {
  return _mm256_madd_epi16(weights16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)));
}

// The dot of the K-quants whose codes are stored + (1 << Shift) under signed integer scales per 16
// values and one float16 scale (Q3_K: +4, Q6_K: +32): unpack(b, sc16, codes) gives a super-block's
// 16 scales as words and its codes (4 vectors of 64, natural order), and returns its d.
template <int Shift, int T, typename Unpack>
__attribute__((always_inline)) inline void offset_kquant_dot(const uint8_t* row, int64_t units, int64_t bytes,
                                                             const Activations& a, int64_t m0, float* out,
                                                             Unpack&& unpack) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    __m256i sc16;
    __m512i scales[4], codes[4];
    const float d = unpack(row + u * bytes, sc16, codes);
    spread_scales16(_mm512_castsi256_si512(sc16), scales);
    __m512i s[T];
    ksum<T>(codes, scales, a, m0, u, s);
    for (int t = 0; t < T; ++t) {
      const float dx = a.d[(m0 + t) * a.d_stride + u];
      // Take (1 << Shift) * scale * (run sum) off, in the lower 8 lanes.
      const __m256i offset = _mm256_slli_epi32(run_sums(sc16, a.sums + (m0 + t) * a.sums_stride + u * 16), Shift);
      const __m512i total = _mm512_sub_epi32(s[t], _mm512_zextsi256_si512(offset));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d * dx), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}
#endif

// Q4_K / Q5_K scales and minimums: 8 six-bit values each, packed in 12 bytes; returned as 8 bytes of
// scales (low 64 bits) and 8 of minimums (high), all in 32-bit words (no byte stores to reload).
inline void k_scale_min_words(const uint8_t* packed, uint64_t& scales, uint64_t& mins) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t s0 = w[0] & low6, m0 = w[1] & low6;
  const uint32_t s1 = (w[2] & low4) | (((w[0] >> 6) & low2) << 4);
  const uint32_t m1 = ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4);
  scales = s0 | (static_cast<uint64_t>(s1) << 32);
  mins = m0 | (static_cast<uint64_t>(m1) << 32);
}
inline void k_scale_min(const uint8_t* packed, uint8_t scales[8], uint8_t mins[8]) {
  uint64_t s, m;
  k_scale_min_words(packed, s, m);
  std::memcpy(scales, &s, 8);
  std::memcpy(mins, &m, 8);
}

struct Q2_K : SuperTraits {
  static constexpr int kType = 10, kBytes = 84;
  static int native(int p) { return p; }
  ROSEINFER_EXACT static void dequantize(const uint8_t* b, float* out) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = half(b + 80), dmin = half(b + 82);
    for (int run = 0; run < 16; ++run) {  // runs of 16 values under one scale
      const int h = run / 8, s = (run % 8) / 2, first = (run % 2) * 16;
      const float dl = d * static_cast<float>(scales[run] & 0xF);
      const float ml = dmin * static_cast<float>(scales[run] >> 4);
      const uint8_t* q = qs + h * 32 + first;
      for (int l = 0; l < 16; ++l) out[run * 16 + l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
    }
  }
#if ROSEINFER_GGUF_VNNI
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    const __m512i three = _mm512_set1_epi8(3);
    // Chunk k = 2h + s2 covers shifts 2*s2*... : values h*128 + s*32 + l, s = 2(k%2) and 2(k%2) + 1.
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m512 acc[T];
    __m256 macc[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* b = row + u * kBytes;
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, _mm_set1_epi8(0x0F)));
      const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F)));
      __m512i scales[4], codes[4];
      spread_scales16(_mm512_castsi256_si512(sc16), scales);
      for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * h)));
        codes[2 * h] = _mm512_and_si512(_mm512_srlv_epi16(q, shift_lo), three);
        codes[2 * h + 1] = _mm512_and_si512(_mm512_srlv_epi16(q, shift_hi), three);
      }
      const float d = half(b + 80), dmin = half(b + 82);
      __m512i s[T];
      ksum<T>(codes, scales, a, m0, u, s);
      for (int t = 0; t < T; ++t) {
        const float dx = a.d[(m0 + t) * a.d_stride + u];
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_set1_ps(d * dx), acc[t]);
        const __m256i m = run_sums(mn16, a.sums + (m0 + t) * a.sums_stride + u * 16);
        macc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-dmin * dx), macc[t]);
      }
    }
    for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + reduce_half(macc[t]);
  }
#endif
};

struct Q3_K : SuperTraits {
  static constexpr int kType = 11, kBytes = 110;
  static int native(int p) { return p; }
  static void scales(const uint8_t* packed, int8_t out[16]) {
    for (int i = 0; i < 16; ++i) {
      const int low = (packed[i % 8] >> (4 * (i / 8))) & 0x0F;
      const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
      out[i] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
  }
  ROSEINFER_EXACT static void dequantize(const uint8_t* b, float* out) {
    const uint8_t *hmask = b, *qs = b + 32;
    int8_t sc[16];
    scales(b + 96, sc);
    const float d = half(b + 108);
    for (int run = 0; run < 16; ++run) {  // runs of 16 values under one scale
      const int h = run / 8, s = (run % 8) / 2, first = (run % 2) * 16, bit = run / 2;
      const float dl = d * static_cast<float>(sc[run]);
      const uint8_t *q = qs + h * 32 + first, *hm = hmask + first;
      for (int l = 0; l < 16; ++l) {
        const int low = (q[l] >> (2 * s)) & 3, high = (hm[l] >> bit) & 1;
        out[run * 16 + l] = dl * static_cast<float>(low - 4 + 4 * high);
      }
    }
  }
#if ROSEINFER_GGUF_VNNI
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    offset_kquant_dot<2, T>(row, units, kBytes, a, m0, out,
                            [&](const uint8_t* b, __m256i& sc16, __m512i codes[4]) __attribute__((always_inline)) {
      int8_t sc[16];
      scales(b + 96, sc);
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      const __m512i hmask = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      for (int k = 0; k < 4; ++k) {
        const int h = k / 2;
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * h)));
        const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(q, k % 2 ? shift_hi : shift_lo), three);
        // Bit 2k of hmask[l] for values 64k + l, bit 2k + 1 for 64k + 32 + l: set means no -4.
        const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * k))),
                                                _mm256_set1_epi8(static_cast<char>(1 << (2 * k + 1))), 1);
        codes[k] = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hmask, bits), low, four);  // q + 4
      }
      return half(b + 108);
    });
  }
#endif
};

struct Q4_K : SuperTraits {
  static constexpr int kType = 12, kBytes = 144;
  static int native(int p) { return q4k_native(p); }
  ROSEINFER_EXACT static void dequantize(const uint8_t* b, float* out) { dequantize_k<false>(b, out); }
  // Q4_K's values, and with HighBit Q5_K's (fifth bits at b + 16, codes at b + 48).
  template <bool HighBit>
  ROSEINFER_EXACT static void dequantize_k(const uint8_t* b, float* out) {
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *qh = b + 16, *qs = b + (HighBit ? 48 : 16);
    for (int j = 0; j < 4; ++j) {  // 64 values: 32 in the low nibbles, 32 in the high ones
      const float dd0 = d * static_cast<float>(sc[2 * j]), dm0 = dmin * static_cast<float>(mn[2 * j]);
      const float dd1 = d * static_cast<float>(sc[2 * j + 1]), dm1 = dmin * static_cast<float>(mn[2 * j + 1]);
      const uint8_t* q = qs + j * 32;
      float* o = out + j * 64;
      for (int l = 0; l < 32; ++l) {
        int low = q[l] & 0x0F, high = q[l] >> 4;
        if constexpr (HighBit) {
          low |= ((qh[l] >> (2 * j)) & 1) << 4;
          high |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
        }
        o[l] = dd0 * static_cast<float>(low) - dm0;
        o[l + 32] = dd1 * static_cast<float>(high) - dm1;
      }
    }
  }
#if ROSEINFER_GGUF_VNNI
  template <bool HighBit, int T>
  static void dot_k(const uint8_t* row, int64_t units, int64_t bytes, int64_t qs_at, const Activations& a, int64_t m0,
                    float* out) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[T];
    __m256 macc[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* b = row + u * bytes;
      uint64_t sc, mn;
      k_scale_min_words(b + 4, sc, mn);
      // Words 0-7: the scales; 8-15: the minimums.
      const __m256i words = _mm256_cvtepu8_epi16(_mm_set_epi64x(static_cast<int64_t>(mn), static_cast<int64_t>(sc)));
      const __m512i sc16 = _mm512_castsi256_si512(words);
      // Minimums per run of 32, each twice, to meet the activations' sums per 16.
      const __m256i mn16 = _mm256_permutexvar_epi16(
          _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), words);
      __m512i scales[4], codes[4];
      spread_scales32_q4k(sc16, scales);
      const __m512i l0 = _mm512_loadu_si512(b + qs_at), l1 = _mm512_loadu_si512(b + qs_at + 64);
      codes[0] = _mm512_and_si512(l0, nibble);
      codes[1] = _mm512_and_si512(_mm512_srli_epi16(l0, 4), nibble);
      codes[2] = _mm512_and_si512(l1, nibble);
      codes[3] = _mm512_and_si512(_mm512_srli_epi16(l1, 4), nibble);
      if constexpr (HighBit) {
        // Bit r of qh[l]: value 32 r + l; vector k holds runs first[k] and first[k] + 2.
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
        constexpr int first[4] = {0, 1, 4, 5};
        for (int k = 0; k < 4; ++k) {
          const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << first[k])),
                                                  _mm256_set1_epi8(static_cast<char>(1 << (first[k] + 2))), 1);
          codes[k] = _mm512_mask_add_epi8(codes[k], _mm512_test_epi8_mask(qh, bits), codes[k], bit4);
        }
      }
      const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b))));
      const __m512 d = _mm512_broadcastss_ps(d_dmin);
      const __m256 dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin));
      __m512i s[T];
      ksum<T>(codes, scales, a, m0, u, s);
      for (int t = 0; t < T; ++t) {
        const float* dx = a.d + (m0 + t) * a.d_stride + u;
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(d, _mm512_set1_ps(*dx)), acc[t]);
        const __m256i m = run_sums(mn16, a.sums + (m0 + t) * a.sums_stride + u * 16);
        macc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, _mm256_set1_ps(*dx)), macc[t]);
      }
    }
    for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + reduce_half(macc[t]);
  }
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    dot_k<false, T>(row, units, kBytes, 16, a, m0, out);
  }
#endif
};

struct Q5_K : SuperTraits {
  static constexpr int kType = 13, kBytes = 176;
  static int native(int p) { return q4k_native(p); }
  ROSEINFER_EXACT static void dequantize(const uint8_t* b, float* out) { Q4_K::dequantize_k<true>(b, out); }
#if ROSEINFER_GGUF_VNNI
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    Q4_K::dot_k<true, T>(row, units, kBytes, 48, a, m0, out);
  }
#endif
};

struct Q6_K : SuperTraits {
  static constexpr int kType = 14, kBytes = 210;
  static int native(int p) { return p; }
  ROSEINFER_EXACT static void dequantize(const uint8_t* b, float* out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int run = 0; run < 16; ++run) {  // runs of 16 values under one scale
      const int h = run / 8, r = (run % 8) * 16, s = r / 32;
      const float dd = d * static_cast<float>(sc[run]);
      const uint8_t *l4 = ql + h * 64 + r % 64, *h2 = qh + h * 32 + r % 32;
      const int nibble = r < 64 ? 0 : 4;
      for (int l = 0; l < 16; ++l) {
        const int low = (l4[l] >> nibble) & 0x0F, high = (h2[l] >> (2 * s)) & 3;
        out[run * 16 + l] = dd * static_cast<float>((low | (high << 4)) - 32);
      }
    }
  }
#if ROSEINFER_GGUF_VNNI
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), two_bits = _mm512_set1_epi8(0x30);
    // Values h*128 + 32 s + l take bits 2s of qh[32 h + l]: moved to bits 4-5 of each byte.
    const __m512i up_a = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // s = 0, 1
    const __m512i down_b = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);  // s = 2, 3
    offset_kquant_dot<5, T>(row, units, kBytes, a, m0, out,
                            [&](const uint8_t* b, __m256i& sc16, __m512i codes[4]) __attribute__((always_inline)) {
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
      for (int h = 0; h < 2; ++h) {
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        codes[2 * h] = _mm512_or_si512(_mm512_and_si512(l, nibble), _mm512_and_si512(_mm512_sllv_epi16(q, up_a), two_bits));
        codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), nibble),
                                           _mm512_and_si512(_mm512_srlv_epi16(q, down_b), two_bits));
      }
      return half(b + 208);
    });
  }
#endif
};

struct IQ4_XS : SuperTraits {
  static constexpr int kType = 23, kBytes = 136;
  static int native(int p) { return nibbles_native(p); }
  static int scale(const uint8_t* b, int run) {
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    const int low = (b[4 + run / 2] >> (4 * (run % 2))) & 0x0F;
    return (low | (((high >> (2 * run)) & 3) << 4)) - 32;
  }
  ROSEINFER_EXACT static void dequantize(const uint8_t* b, float* out) {
    const float d = half(b);
    const uint8_t* qs = b + 8;
    for (int run = 0; run < 8; ++run) {
      const float dl = d * static_cast<float>(scale(b, run));
      for (int j = 0; j < 32; ++j) {
        const uint8_t byte = qs[run * 16 + j % 16];
        out[run * 32 + j] = dl * static_cast<float>(kIQ4Values[j < 16 ? (byte & 0x0F) : (byte >> 4)]);
      }
    }
  }
#if ROSEINFER_GGUF_VNNI
  template <int T>
  static void dot(const uint8_t* row, int64_t units, const Activations& a, int64_t m0, float* out) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i table = shifted_values<kIQ4Values, 128>();
    const __m512i spread4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[T];
    __m256 macc[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* b = row + u * kBytes;
      const float d = half(b);
      alignas(32) float dl[8];
      for (int run = 0; run < 8; ++run) dl[run] = d * static_cast<float>(scale(b, run));
      const __m256 dl8 = _mm256_load_ps(dl);
      // The codes are the values + 128: per run, 128 * scale times the run's activation sum comes off.
      const __m256 shift8 = _mm256_mul_ps(dl8, _mm256_set1_ps(-128.0f));
      __m512i c[4];
      for (int g = 0; g < 2; ++g) {
        const __m512i packed = _mm512_loadu_si512(b + 8 + 64 * g);
        c[2 * g] = _mm512_shuffle_epi8(table, _mm512_and_si512(packed, nibble));
        c[2 * g + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble));
      }
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.q + (m0 + t) * a.q_stride + u * 256;
        const float dx = a.d[(m0 + t) * a.d_stride + u];
        const __m512 dxv = _mm512_set1_ps(dx);
        for (int g = 0; g < 2; ++g) {
          const __m512i p = _mm512_add_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c[2 * g], _mm512_loadu_si512(xq + 128 * g)),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[2 * g + 1], _mm512_loadu_si512(xq + 128 * g + 64)));
          const __m512 scale = _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(g ? _mm256_extractf128_ps(dl8, 1) : _mm256_castps256_ps128(dl8)));
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(scale, dxv), acc[t]);
        }
        // Run sums of 32 from the sums of 16 (natural order; runs are 32 natural values).
        const int16_t* sums = a.sums + (m0 + t) * a.sums_stride + u * 16;
        const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums));
        const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
        macc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(shift8, _mm256_set1_ps(dx)), macc[t]);
      }
    }
    for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + reduce_half(macc[t]);
  }
#endif
};

// Calls f with a default-constructed traits object of the GGML type `type`; false if none.
template <typename F>
bool with_block_traits(int type, F&& f) {
  switch (type) {
    case Q4_0::kType: f(Q4_0{}); return true;
    case Q4_1::kType: f(Q4_1{}); return true;
    case Q5_0::kType: f(Q5_0{}); return true;
    case Q5_1::kType: f(Q5_1{}); return true;
    case Q8_0::kType: f(Q8_0{}); return true;
    case Q2_K::kType: f(Q2_K{}); return true;
    case Q3_K::kType: f(Q3_K{}); return true;
    case Q4_K::kType: f(Q4_K{}); return true;
    case Q5_K::kType: f(Q5_K{}); return true;
    case Q6_K::kType: f(Q6_K{}); return true;
    case IQ4_NL::kType: f(IQ4_NL{}); return true;
    case IQ4_XS::kType: f(IQ4_XS{}); return true;
    case MXFP4::kType: f(MXFP4{}); return true;
    default: return false;
  }
}

}  // namespace roseinfer::gguf

// What the kernels' source files share with one another (the fused decode step calls the
// attention and linear kernels directly, without going through PyTorch's dispatcher).

#pragma once

#include <cstdint>
#include <vector>

namespace roseinfer {

// One sequence's decode attention over the paged pool (float32 storage): q [heads, head_dim]
// (unscaled) -> out [heads, head_dim]. The buffers are scratch space reused between calls.
void paged_attention_sequence(const float* q, const float* k_pool, const float* v_pool, const int64_t* block_table,
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

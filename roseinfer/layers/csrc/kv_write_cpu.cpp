// A step's new keys and values stored at their slots of the paged pool, one pass on the CPU.
//
// In PyTorch this is two index_copy_ calls (plus a conversion when --kv-cache-dtype narrows the
// pool), each going through TensorIterator and the thread pool for a few KiB: ~3% of a batch-64
// decode step. Here every token's K and V rows are copied (rounded to the pool's type) in one loop.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "cpu_kernels.h"

namespace {

// Tokens per parallel task: a decode step's 64 tokens are one task (copying them takes ~2 us).
constexpr int64_t kTokensPerTask = 256;

template <typename scalar_t, typename cache_t>
void copy_rows(const scalar_t* __restrict src, int64_t token_stride, const int64_t* __restrict slots,
               cache_t* __restrict pool, int64_t kv_heads, int64_t head_dim, int64_t begin, int64_t end) {
  const int64_t row = roseinfer::kv_row_elements<cache_t>(head_dim);
  for (int64_t t = begin; t < end; ++t)
    for (int64_t h = 0; h < kv_heads; ++h)
      roseinfer::store_kv_row(pool + (slots[t] * kv_heads + h) * row, src + t * token_stride + h * head_dim, head_dim);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& pool, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be a CPU tensor [tokens, kv_heads, head_dim] with each token's heads contiguous");
  const int64_t row = roseinfer::pool_row_elements(pool.scalar_type() == torch::kChar, x.size(2));
  TORCH_CHECK(x.size(1) == pool.size(3) && row == pool.size(4), name, "'s heads do not match the pool's");
}

}  // namespace

// kv_cache: [2, blocks, block_size, kv_heads, head_dim] (keys, values), contiguous; slot_mapping:
// [tokens] int64, each token's slot (block * block_size + offset); k, v: [tokens, kv_heads, head_dim],
// tokens possibly strided (the k and v parts of a fused qkv output), of the model's dtype, which is
// the pool's, float32 over a 16-bit pool, or any over a q8_0 (int8) pool.
void write_kv_(torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
  check_rows(k, kv_cache, "k");
  check_rows(v, kv_cache, "v");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v must match");
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64, one slot per token");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() || k.scalar_type() == torch::kFloat ||
                  kv_cache.scalar_type() == torch::kChar,
              "a 16-bit pool of another dtype than k and v: they must be float32");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2), pool_half = kv_cache.numel() / 2;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "slot ", slots[t], " is outside the pool");
  auto store = [&](auto* pool) {
    using cache_t = std::remove_pointer_t<decltype(pool)>;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_", [&] {
      const scalar_t* keys = k.data_ptr<scalar_t>();
      const scalar_t* values = v.data_ptr<scalar_t>();
      at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
        copy_rows<scalar_t, cache_t>(keys, k.stride(0), slots, pool, kv_heads, head_dim, begin, end);
        copy_rows<scalar_t, cache_t>(values, v.stride(0), slots, pool + pool_half, kv_heads, head_dim, begin, end);
      });
    });
  };
  switch (kv_cache.scalar_type()) {
    case torch::kFloat: store(kv_cache.data_ptr<float>()); break;
    case torch::kDouble: store(kv_cache.data_ptr<double>()); break;
    case torch::kBFloat16: store(kv_cache.data_ptr<c10::BFloat16>()); break;
    case torch::kHalf: store(kv_cache.data_ptr<c10::Half>()); break;
    case torch::kChar: store(kv_cache.data_ptr<int8_t>()); break;  // q8_0
    default: TORCH_CHECK(false, "the KV pool must be float32, float64, bfloat16, float16 or int8 (q8_0)");
  }
}

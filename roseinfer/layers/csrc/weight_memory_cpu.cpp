// Memory for weights the kernels keep for the model's life (GGUF blocks in the kernels' layout,
// float weights in panels), in 2 MiB pages where the kernel lends them.
//
// A decode step streams every weight once. In 4 KiB pages that is a TLB miss every 4 KiB and the
// hardware prefetchers' streams cut at each page; PyTorch's allocator gives 4 KiB pages (this
// machine's transparent huge pages are "madvise": only memory asked for gets 2 MiB pages). The
// same kernels on the same weights in 2 MiB pages: Q4_K one row from memory 2.2 against 2.6-3.6
// ns per 256 values, a one-stream OLMoE-shaped decode 44.4 against 39.2 tok/s.
//
// Weights are placed one after another in chunks of at least 256 MiB, mapped 2 MiB-aligned and
// advised MADV_HUGEPAGE, so that an expert's 1-2 MiB tensors share huge pages rather than each
// rounding up to its own. Memory is committed as it is written (a weight's tail huge page at most
// past its end), a chunk is unmapped when no tensor in it is left, and nothing is reused: every
// allocation is fresh, zero-filled memory. Only weights come here (a temporary would hold its
// chunk's memory until the chunk's last weight goes).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_kernels.h"

namespace {

#if defined(__linux__) && defined(MADV_HUGEPAGE)
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kChunkBytes = size_t{256} << 20;
constexpr size_t kAlignment = 64;  // a cache line: what every kernel's loads expect at most

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct Chunk {
  char* base;
  size_t size;
  Chunk(char* base, size_t size) : base(base), size(size) {}
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;
  ~Chunk() { munmap(base, size); }
};

// A 2 MiB-aligned anonymous mapping of at least `bytes`, advised huge; nullptr if none could be mapped.
std::shared_ptr<Chunk> map_chunk(size_t bytes) {
  const size_t size = round_up(bytes, kHugePage);
  void* mapped = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  char* raw = static_cast<char*>(mapped);
  char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), kHugePage));
  if (base > raw) munmap(raw, base - raw);  // the unaligned head and tail of the reservation
  if (raw + kHugePage > base) munmap(base + size, raw + kHugePage - base);
  madvise(base, size, MADV_HUGEPAGE);  // refused (no THP in this kernel): 4 KiB pages, still correct
  return std::make_shared<Chunk>(base, size);
}

struct Arena {
  std::mutex mutex;
  std::shared_ptr<Chunk> current;
  size_t used = 0;
};
#endif

}  // namespace

namespace roseinfer {

torch::Tensor lasting_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t count = c10::multiply_integers(sizes);
  const size_t bytes = round_up(std::max<size_t>(1, count * c10::elementSize(dtype)), kAlignment);
  static Arena arena;
  std::shared_ptr<Chunk> chunk;
  size_t offset;
  {
    std::lock_guard<std::mutex> lock(arena.mutex);
    if (!arena.current || arena.used + bytes > arena.current->size) {
      auto fresh = map_chunk(std::max(kChunkBytes, bytes));
      if (!fresh) return torch::zeros(sizes, torch::dtype(dtype));
      arena.current = std::move(fresh);
      arena.used = 0;
    }
    chunk = arena.current;
    offset = arena.used;
    arena.used += bytes;
  }
  // Each tensor holds its chunk: the chunk goes with the last of them.
  return torch::from_blob(
      chunk->base + offset, sizes, [chunk](void*) mutable { chunk.reset(); }, torch::dtype(dtype));
#else
  return torch::zeros(sizes, torch::dtype(dtype));
#endif
}

}  // namespace roseinfer

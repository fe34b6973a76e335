// The roofline for a decode step: how fast this machine streams N bytes from memory, read the way the
// decode kernels read their weights (one contiguous range per thread, 64-byte vector loads, lines
// asked for kWeightPrefetchBytes ahead; the weight-only kernels' own distance is measured per machine,
// and on the Zen 4 machine this read's speed did not depend on it, from none to 8 KiB). The
// benchmarks time it right after each decode step of the same bytes. A reduction in PyTorch
// (x.sum()) is no such bound: on the 2-core AVX-512 machine it read 200 MB at 23 GB/s where this
// loop reads them at 31-35 GB/s, so "% of the read bandwidth" against it flattered every kernel by a
// quarter.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// 32-bit integer sum of the words in [p, p + bytes), bytes a multiple of 256. Integer adds: float
// adds of arbitrary bit patterns could meet denormals, which take a slow path on x86.
uint32_t sum_words(const char* p, int64_t bytes) {
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < bytes; i += 256) {
    for (int line = 0; line < 4; ++line) __builtin_prefetch(p + i + kvik::kWeightPrefetchBytes + 64 * line, 0, 1);
    a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(p + i + 192));
  }
  return static_cast<uint32_t>(
      _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3))));
#else
  // Elsewhere: 64 bytes a step into sixteen independent sums, which GCC vectorises for the target.
  uint32_t sums[16] = {};
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(p + i + kvik::kWeightPrefetchBytes, 0, 1);
    uint32_t words[16];
    std::memcpy(words, p + i, sizeof(words));
    for (int j = 0; j < 16; ++j) sums[j] += words[j];
  }
  uint32_t total = 0;
  for (uint32_t s : sums) total += s;
  return total;
#endif
}

}  // namespace

namespace kvik {

int64_t stream_read(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(), "stream_read needs a contiguous CPU tensor");
  const auto* p = static_cast<const char*>(buffer.data_ptr());
  const int64_t bytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  TORCH_CHECK(bytes % 4 == 0, "stream_read reads 32-bit words: the buffer's size must be a multiple of 4 bytes");
  const int64_t chunks = bytes / 256;
  // One contiguous range per thread (grain = an even share), like the kernels' ranges of blocks.
  const int64_t grain = std::max<int64_t>(1, chunks / std::max(1, at::get_num_threads()));
  std::vector<uint32_t> partial(static_cast<size_t>(at::get_num_threads()), 0);  // one per thread
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    partial[at::get_thread_num()] += sum_words(p + begin * 256, (end - begin) * 256);
  });
  uint32_t total = 0;
  for (uint32_t s : partial) total += s;
  for (int64_t i = chunks * 256; i < bytes; i += 4) {  // the tail after the last 256 bytes
    uint32_t word;
    std::memcpy(&word, p + i, sizeof(word));
    total += word;
  }
  return static_cast<int64_t>(total);
}

}  // namespace kvik

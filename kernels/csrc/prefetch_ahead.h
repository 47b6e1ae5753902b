// Prefetching the next piece of work's memory while this one computes, a few lines at a time: a whole region
// at once would wait on the core's few line-fill buffers. `Ahead` holds the byte ranges the next piece will
// read and spreads their prefetches over the current piece's inner iterations (`tick`); whatever is left is
// issued before the next piece starts (`finish`). Used where the hardware prefetcher (which stops at a 4 KiB
// page) meets every run cold: the paged KV cache's next block (`decode_blocks.h`, into L3 / L2: `Locality` 1),
// and the LoRA kernel's next chunk of adapter weights, short runs the base weights and the KV streamed since
// the last layer have evicted (`sgmv_group_cpu.cpp`, into L2: 2).
#pragma once

#include <cstdint>
#include <vector>

namespace loragate {

template <int Locality>
class Ahead {
 public:
  void clear() { ranges_.clear(), range_ = 0, offset_ = 0, per_tick_ = 0; }
  // Only [p, p + bytes) (nothing for a null p), spread over `ticks` calls of `tick`.
  void start(const void* p, int64_t bytes, int64_t ticks) {
    clear();
    if (p != nullptr) add(p, bytes);
    spread(ticks);
  }
  void add(const void* p, int64_t bytes) {
    if (bytes <= 0) return;
    const auto at = reinterpret_cast<uintptr_t>(p), line = at & ~static_cast<uintptr_t>(LINE - 1);
    ranges_.push_back({reinterpret_cast<const char*>(line), bytes + static_cast<int64_t>(at - line)});
  }
  // Spread what was added over `ticks` calls of `tick`.
  void spread(int64_t ticks) {
    int64_t lines = 0;
    for (const Range& r : ranges_) lines += (r.bytes + LINE - 1) / LINE;
    per_tick_ = ticks > 0 ? (lines + ticks - 1) / ticks : lines;
  }
  void tick() { issue(per_tick_); }
  void finish() { issue(INT64_MAX); }

 private:
  static constexpr int64_t LINE = 64;
  struct Range {
    const char* p;
    int64_t bytes;
  };
  void issue(int64_t lines) {
    for (; lines > 0 && range_ < ranges_.size(); --lines) {
      const Range& r = ranges_[range_];
      __builtin_prefetch(r.p + offset_, 0, Locality);
      offset_ += LINE;
      if (offset_ >= r.bytes) ++range_, offset_ = 0;
    }
  }
  std::vector<Range> ranges_;
  size_t range_ = 0;
  int64_t offset_ = 0, per_tick_ = 0;
};

}  // namespace loragate

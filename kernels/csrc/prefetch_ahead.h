// Prefetching the next work item's weights while this one computes. A decode step's adapters come from
// memory (the base weights and the KV cache streamed since the last layer have evicted them): a chunk's A rows
// and B pairs are a few short runs, too short for the hardware prefetcher, so a thread that loads them on
// demand waits on memory and then computes, one after the other. `Ahead` holds the byte ranges the thread's
// next item will read and spreads their prefetches over the current item's inner loop iterations (`tick`),
// so memory and the tiles work at once; whatever is left is issued before the next item starts (`finish`).
#pragma once

#include <cstdint>
#include <vector>

namespace loragate {

class Ahead {
 public:
  void clear() { ranges_.clear(), range_ = 0, offset_ = 0, per_tick_ = 0; }
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
      __builtin_prefetch(r.p + offset_, 0, 2);  // to L2: the next item's weights outgrow L1
      offset_ += LINE;
      if (offset_ >= r.bytes) ++range_, offset_ = 0;
    }
  }
  std::vector<Range> ranges_;
  size_t range_ = 0;
  int64_t offset_ = 0, per_tick_ = 0;
};

}  // namespace loragate

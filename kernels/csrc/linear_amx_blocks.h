// The AMX linear layer's blocks (`linear_amx.cpp`): the tile configuration, and a thread's blocks of sums on
// their way out (`Blocks`): rounded, put through SiLU or argmax, with a LoRA group's sums where it has them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "linear_amx_lora.h"
#include "linear_amx_out.h"
#include "sgmv_amx.h"

namespace loragate_amx_linear {

using bf16 = at::BFloat16;
constexpr int64_t PANEL = 32;      // output columns a panel
constexpr int64_t KBLOCK = 32;     // k values a tile row
constexpr int64_t TILE = 16 * 32;  // bf16 values a tile

#if LORAGATE_AMX

using loragate_amx_lora::Adapters;
using loragate_amx_out::Out;

// Tiles 0-3: sums [16 rows x 16 columns] (row tile r, column tile h at 2 r + h); 4-5: x [16 x 32];
// 6-7: the weight's pairs [16 x 32]. One shape for every call: configured once per parallel task.
using Tiles = loragate_amx::UniformTiles;

// Tile `tile` (a literal: the intrinsics spell its register) from rows at p (stride bytes apart), with the
// non-temporal hint when `stream`.
#define LORAGATE_LOAD_HINTED(tile, p, stride, stream) \
  do {                                           \
    ::loragate_amx::fence(p);                    \
    if (stream) {                                \
      _tile_stream_loadd(tile, p, stride);       \
    } else {                                     \
      _tile_loadd(tile, p, stride);              \
    }                                            \
  } while (0)

inline __m512 bias_at(const float* bias, int64_t col, int64_t n) {
  if (bias == nullptr) return _mm512_setzero_ps();
  const __mmask16 m = col >= n ? 0 : col + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
  return _mm512_maskz_loadu_ps(m, bias + col);
}

// A thread's blocks of sums, two buffers: a block's sums are rounded into y while the tiles compute the next
// block, a few rows after each k block's multiplies (reading the other buffer), so that the core's vector
// work and the tiles overlap; issued all after the last multiply, the rounding and SiLU of a 32-row block
// outran the reorder buffer and left the tiles idle (30 gate/up layers with SiLU at 2,048 rows: 91-97 ms
// that way, 76.5 interleaved; the down projections 38.4-39.2 -> 35.6-36.0).
class Blocks {
 public:
  // `big`: a prefill-sized call, run row block by row block over every panel (`linear_amx`): the panels'
  // tiles are then loaded with the non-temporal hint, so that the row block's x stays in L1.
  // `best` / `at`: for `Out::argmax`, each row's best value and its column so far (y is not written).
  // `lora`: a group's adapters to add to their rows (`linear_amx_lora.h`), or null.
  Blocks(bf16* y, int64_t ldy, int64_t n, bool big, Out how, float* best = nullptr, int64_t* at = nullptr,
         Adapters* lora = nullptr)
      : y_(y), ldy_(ldy), n_(n), how_(how), best_(best), at_(at), lora_(lora), stream_w(big) {}
  Blocks(const Blocks&) = delete;
  Blocks& operator=(const Blocks&) = delete;

  // Rows [row, row + rows) (<= 32) of x times one panel (columns col..col + 32): x0 holds the first 16 rows
  // (stride ldx0 values), x1 the rest (stride ldx1: x itself or its padded tail). `ahead`: per_kb lines of
  // the next panel to prefetch per k block (or null).
  void run(int64_t row, int64_t rows, const bf16* x0, int64_t ldx0, const bf16* x1, int64_t ldx1,
           const bf16* panel, int64_t kblocks, int64_t col, __m512 b0, __m512 b1, const char* ahead,
           int64_t per_kb) {
    const bool two = rows > 16;
    // The last block's rows go out a few after each k block's multiplies, so that the core rounds them
    // (and computes their SiLU) while the tiles work, instead of all after the last multiply.
    const int64_t per = (pending_.rows + kblocks - 1) / kblocks;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const bf16* w = panel + kb * 2 * TILE;
      if (ahead != nullptr)
        for (int64_t l = 0; l < per_kb; ++l) _mm_prefetch(ahead + (kb * per_kb + l) * 64, _MM_HINT_T1);
      LORAGATE_LOAD_HINTED(6, w, 64, stream_w);
      LORAGATE_LOAD_HINTED(7, w + TILE, 64, stream_w);
      LORAGATE_TILE_LOAD(4, x0 + kb * KBLOCK, ldx0 * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        LORAGATE_TILE_LOAD(5, x1 + kb * KBLOCK, ldx1 * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if (done_ < pending_.rows) finish(std::min(pending_.rows, done_ + per));
    }
    flush();
    float(*c)[256] = c_[cur_];
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (two) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    const bool adapted = lora_ != nullptr && lora_->sums(row, rows, col, l_[cur_]);
    pending_ = {row, rows, col, b0, b1, adapted};
  }

  // Round the rest of the block waiting in the current buffer into y (and switch buffers).
  void flush() {
    if (pending_.rows == 0) return;
    finish(pending_.rows);
    pending_.rows = 0, done_ = 0;
    cur_ ^= 1;
  }

 private:
  // The waiting block's rows from done_ to `until` to their destination (`Out`).
  void finish(int64_t until) {
    const Pending& p = pending_;
    if (!p.adapted) {
      out(done_, until, p.b0, p.b1);
    } else {  // an adapted row's sums become bf16(sums + bias) + its LoRA sums, which `out` rounds again
      for (int64_t r = done_, e; r < until; r = e) {
        const bool adapted = lora_->adapted(p.row + r);
        for (e = r + 1; e < until && lora_->adapted(p.row + e) == adapted;) ++e;
        if (!adapted) {
          out(r, e, p.b0, p.b1);
          continue;
        }
        for (int64_t u = r; u < e; ++u) {
          float* c0 = c_[cur_][u / 16 * 2] + u % 16 * 16;
          float* c1 = c_[cur_][u / 16 * 2 + 1] + u % 16 * 16;
          const float* l0 = l_[cur_][u / 16 * 2] + u % 16 * 16;
          const float* l1 = l_[cur_][u / 16 * 2 + 1] + u % 16 * 16;
          using loragate_amx_out::rounded;
          _mm512_store_ps(c0, _mm512_add_ps(rounded(_mm512_add_ps(_mm512_load_ps(c0), p.b0)), _mm512_load_ps(l0)));
          _mm512_store_ps(c1, _mm512_add_ps(rounded(_mm512_add_ps(_mm512_load_ps(c1), p.b1)), _mm512_load_ps(l1)));
        }
        out(r, e, _mm512_setzero_ps(), _mm512_setzero_ps());
      }
    }
    done_ = until;
  }

  // The waiting block's rows [r0, r1) to their destination (`Out`), with these biases.
  void out(int64_t r0, int64_t r1, __m512 b0, __m512 b1) {
    using namespace loragate_amx_out;
    const Pending& p = pending_;
    bf16* y = y_ + p.row * ldy_;
    if (how_ == Out::plain)
      store(y, ldy_, c_[cur_], r0, r1, p.col, n_, b0, b1);
    else if (how_ == Out::argmax)
      pick(best_ + p.row, at_ + p.row, c_[cur_], r0, r1, p.col, n_);
    else
      store_gated(y, ldy_, c_[cur_], r0, r1, p.col, n_ / 2, b0, b1, how_);
  }

  struct Pending {
    int64_t row, rows, col;
    __m512 b0, b1;
    bool adapted;  // some row has adapters: their sums wait in l_
  };
  alignas(64) float c_[2][4][256];
  alignas(64) float l_[2][4][256];  // the adapted rows' LoRA sums, as c_'s
  bf16* y_;
  int64_t ldy_, n_;
  Out how_;
  float* best_;
  int64_t* at_;
  Adapters* lora_;
  Pending pending_{0, 0, 0, _mm512_setzero_ps(), _mm512_setzero_ps(), false};
  int64_t done_ = 0;  // the waiting block's rows already out
  int cur_ = 0;
  const bool stream_w;
};

#endif  // LORAGATE_AMX

}  // namespace loragate_amx_linear

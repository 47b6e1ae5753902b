// A multi-LoRA group's adapters inside the AMX linear layer (`linear_amx.cpp`, op `linear_amx_lora`): for a
// token row of slot s, y = bf16(bf16(x Wᵀ + b) + v Bᵀ) with v = bf16(scale * x Aᵀ) — what the linear followed
// by `sgmv_group_run` computes, bit for bit (the same shrink, `sgmv_group_shrink`; the same tile products over
// the same rank pairs in the same order; the same two roundings) — but the expand's sums come from the tiles
// right after the block's own multiplies, and the result is written once: no second pass over y, and a gated
// gate/up weight keeps its SiLU inside the matmul, in the shadow of the next block's multiplies, instead of a
// pass of its own over [rows, 2 * inter].
//
// Per block of up to 32 rows and panel of 32 columns, every run of rows of one slot in the block adds into
// the same four tiles of sums (after the block's own are stored): v's rows of the run's place (tiles 4-5, 32
// rank values a row, zero past the rank and outside the run's rows) times that slot's B in rank pairs for the
// column tile's module (tiles 6-7: 16 pairs a tile; a rank of 16 or less is copied into a zeroed tile first,
// so nothing past the slot's own pairs is read). Each run costs a few tile loads and multiplies that nothing
// hides, so the decoder takes this path only where runs are long (`Plan::long_runs`: a prefill's prompts).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "sgmv_amx.h"
#include "sgmv_group_plan.h"

#if LORAGATE_AMX

namespace loragate_amx_lora {

using bf16 = at::BFloat16;
using loragate_sgmv_group::Module;
using loragate_sgmv_group::Plan;

// One call's adapters: the plan's group at one layer, laid over the linear's packed columns.
class Adapters {
 public:
  // `gated`: the weight is packed gated (panel p's column tile 0 is the gate's columns p * 16 .., tile 1 the up
  // projection's n / 2 + p * 16 ..); else packed column c is output column c. v: [rows, modules, runs, width]
  // (`sgmv_group_v`).
  Adapters(const Plan& plan, int64_t layer, const bf16* v, int64_t width, int64_t n, int64_t panels, bool gated)
      : plan_(plan), v_(v), width_(width), modules_(static_cast<int64_t>(plan.mods.size())) {
    for (int64_t m = 0; m < modules_; ++m) mods_.push_back(loragate_sgmv_group::at_layer(plan, m, layer));
    for (int64_t t = 0; t < 2 * panels; ++t) {
      const int64_t p = t / 2, h = t % 2, out = gated ? (h == 0 ? p * 16 : n / 2 + p * 16) : t * 16;
      int64_t mod = -1, local = 0;
      for (int64_t m = 0; m < modules_; ++m)
        if (out >= mods_[m].offset && out < mods_[m].offset + mods_[m].outs) mod = m, local = out - mods_[m].offset;
      tile_mod_.push_back(mod), tile_out_.push_back(local);
    }
  }

  // Prefetch the B pairs the panel at packed column `col` reads, for every slot of the call: a step's adapters
  // come from memory, and a tile's pairs fetched only when its block needs them stall the tiles each time.
  void prefetch(int64_t col) const {
    if (col / 16 + 1 >= static_cast<int64_t>(tile_mod_.size())) return;
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t m = tile_mod_[col / 16 + h];
      if (m < 0) continue;
      for (int64_t s : plan_.used) {
        const int64_t r = plan_.ranks[m * plan_.slots + s];
        if (r == 0) continue;
        const char* p = reinterpret_cast<const char*>(pairs(m, s, col / 16 + h, r));
        for (int64_t l = 0; l < loragate_amx::v_row(r) / 2; ++l) _mm_prefetch(p + l * 64, _MM_HINT_T0);
      }
    }
  }

  bool adapted(int64_t row) const {
    return row < static_cast<int64_t>(plan_.row_slot.size()) && plan_.row_slot[row] >= 0;
  }
  int64_t slot(int64_t row) const { return adapted(row) ? plan_.row_slot[row] : -1; }

  // The LoRA sums of rows [row, row + rows) (<= 32, a block: row a multiple of 32) by the panel at packed
  // column col into `sums`, laid out as the block's own sums (rows 16.. in [2], [3]), zero for rows without
  // adapters. Uses every tile. Returns whether any row is adapted.
  //
  // v holds each row's shrink in its run's place (`Plan::row_run`), zeros elsewhere, so that every run of the
  // block adds into the same four tiles of sums: a run's v tiles are zero outside its own rows, whose sums
  // therefore take only their own slot's products (the others add zeros: adapters' weights are finite,
  // `worker.lora`), in the order `sgmv_group`'s expand takes them.
  bool sums(int64_t row, int64_t rows, int64_t col, float (*sums)[256]) {
    const int64_t end = row + rows, ld = modules_ * plan_.runs * width_;
    bool any = false;
    for (int64_t u = row; u < end;) {
      const int64_t s = slot(u);
      int64_t e = u + 1;
      while (e < end && slot(e) == s) ++e;
      if (s < 0) {
        u = e;
        continue;
      }
      if (!any) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        any = true;
      }
      const bool low = u < row + 16, high = rows > 16 && e > row + 16;  // the run's 16-row tiles
      const int64_t run = plan_.row_run[u];
      int64_t rank[2], mod[2], deepest = 0;
      for (int64_t h = 0; h < 2; ++h) {
        mod[h] = tile_mod_[col / 16 + h];
        rank[h] = mod[h] < 0 ? 0 : plan_.ranks[mod[h] * plan_.slots + s];
        deepest = std::max(deepest, loragate_amx::v_row(rank[h]));
      }
      for (int64_t j = 0; j < deepest; j += 32) {
        const bf16* loaded = nullptr;  // the v rows tiles 4-5 hold
        for (int64_t h = 0; h < 2; ++h) {
          if (j >= loragate_amx::v_row(rank[h])) continue;
          const bf16* va = v_ + ((row * modules_ + mod[h]) * plan_.runs + run) * width_ + j;
          if (va != loaded) {
            if (low) LORAGATE_TILE_LOAD(4, va, ld * 2);
            if (high) LORAGATE_TILE_LOAD(5, va + 16 * ld, ld * 2);
            loaded = va;
          }
          const bf16* bp = operand(h, pairs(mod[h], s, col / 16 + h, rank[h]) + j * 16,
                                   (loragate_amx::v_row(rank[h]) - j) / 2);
          if (h == 0) {
            LORAGATE_TILE_LOAD(6, bp, 64);
            if (low) _tile_dpbf16ps(0, 4, 6);
            if (high) _tile_dpbf16ps(2, 5, 6);
          } else {
            LORAGATE_TILE_LOAD(7, bp, 64);
            if (low) _tile_dpbf16ps(1, 4, 7);
            if (high) _tile_dpbf16ps(3, 5, 7);
          }
        }
      }
      u = e;
    }
    if (any) {
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      if (rows > 16) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
      }
    }
    return any;
  }

 private:
  // Slot s's B pairs (rank r) for packed column tile `tile` of module m.
  const bf16* pairs(int64_t m, int64_t s, int64_t tile, int64_t r) const {
    const Module& md = mods_[m];
    return static_cast<const bf16*>(md.pairs) + s * md.pair_slot + tile_out_[tile] / 16 * (loragate_amx::v_row(r) / 2) * 32;
  }

  // B's tile of 16 pairs from b, `left` of them the slot's: b itself, or for a rank of 16 or less (left <= 8)
  // its pairs copied into a tile whose other rows are zero.
  const bf16* operand(int64_t h, const bf16* b, int64_t left) {
    if (left >= 16) return b;
    std::memcpy(padded_[h], b, left * 64);
    std::memset(padded_[h] + left * 32, 0, (8 - left) * 64);
    return padded_[h];
  }

  const Plan& plan_;
  const bf16* v_;
  int64_t width_, modules_;
  std::vector<Module> mods_;
  std::vector<int64_t> tile_mod_, tile_out_;  // per packed column tile: its module (-1: none), its first output
  alignas(64) bf16 padded_[2][16 * 32] = {};  // rows 8-15 stay zero
};

}  // namespace loragate_amx_lora

#endif  // LORAGATE_AMX

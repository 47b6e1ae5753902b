// The LoRA group's side of its adapters inside the AMX linear (`linear_amx_lora.h`): the rows' shrinks into
// each row's run's place of v, a zeroed v of the right shape, and whether a plan can and should go that way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <algorithm>
#include <vector>

#include "sgmv_amx.h"
#include "sgmv_group_plan.h"

namespace {

using namespace loragate_sgmv_group;
using loragate::from_float;

#if LORAGATE_AMX
using bf16 = at::BFloat16;

// One shrink of a work item: module m's rank rows [j0, j0 + rb) of the item's slot, read from a (rows ld
// values apart).
struct Job {
  int64_t m, j0, rb;
  const bf16* a;
  int64_t ld;
};

// The tiles of up to four shrink chains at once. Two chunks (m2 > 0): jobs a and b (tiles 1 and 4: their A
// rows [rank rows x 32]) times chunks 1 and 2 (tiles 2 and 5: their x pairs [16 x rows]) into sums 0 (a, 1),
// 3 (a, 2), 6 (b, 1), 7 (b, 2). One chunk: jobs a, b and c (A rows in tiles 1, 4, 5) times its x pairs
// (tile 2) into sums 0, 3, 6. Rank rows 0: no such job. Loaded when the shapes change.
class ChainTiles {
 public:
  ChainTiles() = default;
  ChainTiles(const ChainTiles&) = delete;
  ChainTiles& operator=(const ChainTiles&) = delete;
  ~ChainTiles() {
    if (loaded_) _tile_release();
  }
  void configure(int64_t m1, int64_t m2, int64_t ra, int64_t rb, int64_t rc) {
    const std::array<int64_t, 5> shape{m1, m2, ra, rb, rc};
    if (loaded_ && shape == shape_) return;
    loragate_amx::TileConfig cfg;
    cfg.set(0, ra, m1 * 4), cfg.set(1, ra, 64), cfg.set(2, 16, m1 * 4);
    if (rb > 0) cfg.set(4, rb, 64);
    if (m2 > 0) {
      cfg.set(3, ra, m2 * 4), cfg.set(5, 16, m2 * 4);
      if (rb > 0) cfg.set(6, rb, m1 * 4), cfg.set(7, rb, m2 * 4);
    } else {
      if (rb > 0) cfg.set(3, rb, m1 * 4);
      if (rc > 0) cfg.set(5, rc, 64), cfg.set(6, rc, m1 * 4);
    }
    cfg.load();
    shape_ = shape, loaded_ = true;
  }

 private:
  std::array<int64_t, 5> shape_{};
  bool loaded_ = false;
};

// The fused path's shrink (`linear_amx_lora.h`): for each token row t of an adapted chunk and each module m
// its slot adapts, v[t][m][run][j] = bf16(scale * sum_d x[t][d] * a[m][layer, slot, j, d]) for j < rank,
// where run is the row's run in its block of 32 rows (`Plan::row_run`): per sum the same tile products in
// the same order as `group`'s shrink on AMX (`loragate_amx::shrink`), so the same bits. v comes zeroed (the
// rest stays zero).
//
// A shrink is a chain of multiplies into one tile of sums (one per 32 values of x), each waiting for the
// last: alone, the tiles idle most of each multiply's latency. So a work item is up to two consecutive
// chunks of one slot (a prompt's), and its shrinks (module x block of 16 rank rows) run two at a time,
// four chains in flight, each A tile serving both chunks and each chunk's x pairs both shrinks; an item
// of one chunk (a decode step's few rows of a slot) runs them three at a time. Threads take items as they
// finish. (SmolLM2 bf16, 8 adapters, alternated in one process: a 2,048-token prefill step with 51 of 64
// prompts adapted 348.5 -> 337.3 ms, a 128-row decode step 63.6 -> 62.5 ms.)
void sgmv_group_shrink(at::Tensor v, const at::Tensor& x, const at::Tensor& plan_t, int64_t layer) {
  const Plan& plan = read_plan(plan_t);
  const int64_t n = static_cast<int64_t>(plan.mods.size()), in = plan.in;
  int64_t widest = 0;
  for (int64_t r : plan.ranks) widest = std::max(widest, loragate_amx::v_row(r));
  TORCH_CHECK(plan.tiles, "sgmv_group_shrink: the group's adapters do not run on AMX tiles here");
  TORCH_CHECK(v.scalar_type() == at::kBFloat16 && v.dim() == 4 && v.is_contiguous() && v.size(0) >= plan.rows &&
                  v.size(1) == n && v.size(2) == plan.runs && v.size(3) % 32 == 0 && v.size(3) >= widest,
              "sgmv_group_shrink: v must be contiguous bf16 [rows, modules, runs, a multiple of 32 >= every rank]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == in &&
                  x.size(0) >= plan.rows,
              "sgmv_group_shrink: x must be bf16 [rows, in] with contiguous rows");
  TORCH_CHECK(layer >= 0 && layer < plan.layers, "sgmv_group_shrink: layer out of range");
  std::vector<Module> mods(n);
  for (int64_t m = 0; m < n; ++m) mods[m] = at_layer(plan, m, layer);
  const bf16* xp = x.data_ptr<bf16>();
  bf16* vp = v.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), width = v.size(3), runs = plan.runs;
  // Work items: the first chunk of each, and a second of the same slot's consecutive rows where one follows.
  std::vector<int64_t> items;
  for (int64_t i = 0; i < static_cast<int64_t>(plan.work.size()); ++i) {
    items.push_back(i);
    const Chunk &k = plan.work[i], *after = i + 1 < static_cast<int64_t>(plan.work.size()) ? &plan.work[i + 1] : nullptr;
    if (after != nullptr && after->slot == k.slot && after->token == k.token + k.rows) ++i;
  }
  const int64_t count = static_cast<int64_t>(items.size());
  if (count == 0) return;
  std::atomic<int64_t> next{0};  // threads take items as they finish (slots differ in ranks and modules)
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    thread_local std::vector<uint32_t> xt;
    xt.resize(2 * (in / 32 * 256));
    alignas(64) float c[4][16 * 16];
    ChainTiles tiles;
    std::vector<Job> jobs;
    // Sums [rank rows x 16] of `job` over chunk k, scaled and rounded, into each row's place of v.
    auto put = [&](const float* sums, const Job& job, const Chunk& k, int64_t slot) {
      const float scale = plan.scales[job.m * plan.slots + slot];
      for (int64_t u = 0; u < k.rows; ++u) {
        const int64_t t = k.token + u;
        bf16* out = vp + ((t * n + job.m) * runs + plan.row_run[t]) * width + job.j0;
        for (int64_t j = 0; j < job.rb; ++j) out[j] = from_float<bf16>(scale * sums[j * 16 + u]);
      }
    };
    for (int64_t it = next++; it < count; it = next++) {
      const int64_t first = items[it];
      const int64_t last = it + 1 < count ? items[it + 1] : static_cast<int64_t>(plan.work.size());
      const Chunk& k1 = plan.work[first];
      const Chunk* k2 = last - first > 1 ? &plan.work[first + 1] : nullptr;
      const int64_t slot = k1.slot, m1 = k1.rows, m2 = k2 ? k2->rows : 0;
      uint32_t* xt1 = xt.data();
      uint32_t* xt2 = xt.data() + in / 32 * 256;
      loragate_amx::pack_x(xt1, xp + k1.token * ldx, ldx, m1, in);
      if (k2) loragate_amx::pack_x(xt2, xp + k2->token * ldx, ldx, m2, in);
      jobs.clear();
      for (int64_t m = 0; m < n; ++m) {
        const int64_t r = plan.ranks[m * plan.slots + slot], rb = r < 16 ? r : 16;
        const bf16* a = static_cast<const bf16*>(mods[m].a) + slot * mods[m].a_slot;
        for (int64_t j0 = 0; j0 < r; j0 += rb) jobs.push_back({m, j0, rb, a + j0 * mods[m].a_row, mods[m].a_row});
      }
      const size_t per = k2 ? 2 : 3;  // jobs at a time
      for (size_t q = 0; q < jobs.size(); q += per) {
        const Job* ja = &jobs[q];
        const Job* jb = q + 1 < jobs.size() ? &jobs[q + 1] : nullptr;
        const Job* jc = !k2 && q + 2 < jobs.size() ? &jobs[q + 2] : nullptr;
        tiles.configure(m1, m2, ja->rb, jb ? jb->rb : 0, jc ? jc->rb : 0);
        _tile_zero(0);
        if (k2 || jb) _tile_zero(3);
        if ((k2 && jb) || jc) _tile_zero(6);
        if (k2 && jb) _tile_zero(7);
        for (int64_t d = 0; d < in; d += 32) {
          if (d + loragate_amx::AHEAD < in) {  // A comes from memory in short strided runs: fetch ahead
            const int64_t at = d + loragate_amx::AHEAD;
            for (const Job* job : {ja, jb, jc})
              if (job != nullptr)
                for (int64_t j = 0; j < job->rb; ++j) __builtin_prefetch(job->a + j * job->ld + at, 0, 3);
          }
          LORAGATE_TILE_LOAD(1, ja->a + d, ja->ld * 2);
          LORAGATE_TILE_LOAD(2, xt1 + d / 32 * 256, 64);
          _tile_dpbf16ps(0, 1, 2);
          if (k2) {
            LORAGATE_TILE_LOAD(5, xt2 + d / 32 * 256, 64);
            _tile_dpbf16ps(3, 1, 5);
            if (jb) {
              LORAGATE_TILE_LOAD(4, jb->a + d, jb->ld * 2);
              _tile_dpbf16ps(6, 4, 2);
              _tile_dpbf16ps(7, 4, 5);
            }
          } else {
            if (jb) {
              LORAGATE_TILE_LOAD(4, jb->a + d, jb->ld * 2);
              _tile_dpbf16ps(3, 4, 2);
            }
            if (jc) {
              LORAGATE_TILE_LOAD(5, jc->a + d, jc->ld * 2);
              _tile_dpbf16ps(6, 5, 2);
            }
          }
        }
        _tile_stored(0, c[0], 64);
        put(c[0], *ja, k1, slot);
        if (k2) {
          _tile_stored(3, c[1], 64);
          put(c[1], *ja, *k2, slot);
          if (jb) {
            _tile_stored(6, c[2], 64);
            _tile_stored(7, c[3], 64);
            put(c[2], *jb, k1, slot);
            put(c[3], *jb, *k2, slot);
          }
        } else {
          if (jb) {
            _tile_stored(3, c[1], 64);
            put(c[1], *jb, k1, slot);
          }
          if (jc) {
            _tile_stored(6, c[2], 64);
            put(c[2], *jc, k1, slot);
          }
        }
      }
    }
  });
}
#else
void sgmv_group_shrink(at::Tensor, const at::Tensor&, const at::Tensor& plan_t, int64_t) {
  TORCH_CHECK(read_plan(plan_t).tiles, "sgmv_group_shrink: the group's adapters do not run on AMX tiles here");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("sgmv_group_shrink(Tensor(a!) v, Tensor x, Tensor plan, int layer) -> ()");
  // A zeroed v for `sgmv_group_shrink` over `rows` token rows: [rows up to a multiple of 32, modules, runs,
  // the widest rank up to a multiple of 32].
  m.def("sgmv_group_v(Tensor plan, int rows) -> Tensor", [](const at::Tensor& plan_t, int64_t rows) {
    const Plan& plan = read_plan(plan_t);
    int64_t deepest = 1;
    for (int64_t r : plan.ranks) deepest = std::max(deepest, r);
    return at::zeros({(std::max(rows, plan.rows) + 31) / 32 * 32, static_cast<int64_t>(plan.mods.size()), plan.runs,
                      (deepest + 31) / 32 * 32},
                     at::TensorOptions().dtype(at::kBFloat16));
  });
  m.impl("sgmv_group_shrink", c10::DispatchKey::CPU, &sgmv_group_shrink);
  // Whether a group's plan runs its adapters on AMX tiles (so the AMX linear can add them in its matmul), and
  // whether its adapted rows come in long runs (where that is faster).
  m.def("sgmv_group_tiles(Tensor plan) -> bool", [](const at::Tensor& plan) { return read_plan(plan).tiles; });
  m.def("sgmv_group_long_runs(Tensor plan) -> bool", [](const at::Tensor& plan) { return read_plan(plan).long_runs; });
}

// The LoRA group's side of its adapters inside the AMX linear (`linear_amx_lora.h`): the rows' shrinks into
// each row's run's place of v, a zeroed v of the right shape, and whether a plan can and should go that way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "sgmv_amx.h"
#include "sgmv_group_plan.h"

namespace {

using namespace loragate_sgmv_group;
using loragate::from_float;

// The fused path's shrink (`linear_amx_lora.h`): for each token row t of an adapted chunk and each module m
// its slot adapts, v[t][m][run][j] = bf16(scale * sum_d x[t][d] * a[m][layer, slot, j, d]) for j < rank,
// where run is the row's run in its block of 32 rows (`Plan::row_run`): the same tiles and order as
// `group`'s shrink on AMX, so the same bits. v comes zeroed (the rest stays zero).
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
#if LORAGATE_AMX
  std::vector<Module> mods(n);
  for (int64_t m = 0; m < n; ++m) mods[m] = at_layer(plan, m, layer);
  using bf16 = at::BFloat16;
  const bf16* xp = x.data_ptr<bf16>();
  bf16* vp = v.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), width = v.size(3), count = static_cast<int64_t>(plan.work.size());
  const int64_t runs = plan.runs;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint32_t> xt;
    xt.resize(in / 32 * 256);
    loragate_amx::Tiles tiles;
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& k = plan.work[i];
      loragate_amx::pack_x(xt.data(), xp + k.token * ldx, ldx, k.rows, in);
      for (int64_t m = 0; m < n; ++m) {
        const int64_t r = plan.ranks[m * plan.slots + k.slot];
        if (r == 0) continue;
        const float scale = plan.scales[m * plan.slots + k.slot];
        const bf16* a = static_cast<const bf16*>(mods[m].a) + k.slot * mods[m].a_slot;
        loragate_amx::shrink(
            tiles, xt.data(), k.rows, a, mods[m].a_row, r, in,
            [&](int64_t u, int64_t j, float s) {
              const int64_t t = k.token + u;
              vp[((t * n + m) * runs + plan.row_run[t]) * width + j] = from_float<bf16>(scale * s);
            },
            [] {});
      }
    }
  });
#endif
}

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

// Multi-LoRA for a group of projections that read one input and write column slices of one fused output
// (q/k/v into qkv, gate/up into gate_up; a group of one for o and down): every module's shrink and
// expand in one call, one pass over the tokens.
//
// For each chunk of up to CHUNK tokens of one segment (one adapter slot), for each module m the slot adapts:
//   v[u, j] = round(scale[m, slot] * sum_d x[u, d] * a[m][layer, slot, j, d])   j < rank[m, slot]
//   y[u, off[m] + o] += sum_j v[u, j] * b[m][layer, slot, o, j]
// which is `sgmv_shrink` into a zeroed v then `sgmv_expand` (same sums, same order, v rounded to the
// storage dtype in between), without v ever leaving the thread: one dispatch per group instead of three
// per module, the chunk's 16-bit inputs converted once for all modules. A chunk's tiles of 4 tokens share
// each block of weights while it is in L1 (`sgmv_blocks.h`), and threads take chunks as they finish
// (segments differ in length). In bf16 on a CPU with AMX, a module whose B also comes in rank pairs
// (`pairs`, kept by the adapter cache, each slot's own ranks dense) runs on AMX tiles instead (`sgmv_amx.h`),
// each thread prefetching its next chunk's A and B pairs while the tiles work on this one (a step's adapters
// come from memory: `prefetch_ahead.h`),
// and on a CPU with AVX512-BF16 but no AMX on `vdpbf16ps` (`sgmv_dpbf16.h`): the same sums, summed in pairs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sgmv_group_plan.h"
#include "prefetch_ahead.h"
#include "sgmv_amx.h"
#include "sgmv_common.h"
#include "sgmv_dpbf16.h"

#include <algorithm>
#include <array>
#include <limits>
#include <memory>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace loragate_sgmv;
using namespace loragate_sgmv_group;

struct Scratch {
  std::vector<float> xs, vs;
  std::vector<std::vector<float>> b;
  std::vector<uint32_t> xt;  // AMX: x's chunk in pairs
  std::vector<uint16_t> vh;  // AMX, AVX512-BF16: v's bf16 bits
  loragate::Ahead<2> ahead;  // AMX: the next chunk's weights, prefetched while this one computes
};

#if LORAGATE_AMX
// What chunk `k` reads on AMX tiles, into `ahead`; returns its tiles' inner iterations.
inline int64_t amx_reads(loragate::Ahead<2>* ahead, const Chunk& k, const Module* mods, int64_t n, const int64_t* ranks,
                         int64_t slots, int64_t in) {
  int64_t ticks = 0;
  for (int64_t m = 0; m < n; ++m) {
    const int64_t r = ranks[m * slots + k.slot];
    const Module& md = mods[m];
    if (r == 0 || md.pairs == nullptr || !loragate_amx::fits(in, md.outs, r)) continue;
    ticks += loragate_amx::shrink_ticks(r, in) + loragate_amx::expand_ticks(md.outs);
    if (ahead == nullptr) continue;
    const auto* a = static_cast<const at::BFloat16*>(md.a) + k.slot * md.a_slot;
    if (md.a_row == in) {
      ahead->add(a, r * in * 2);
    } else {
      for (int64_t j = 0; j < r; ++j) ahead->add(a + j * md.a_row, in * 2);
    }
    const auto* pairs = static_cast<const at::BFloat16*>(md.pairs) + k.slot * md.pair_slot;
    ahead->add(pairs, md.outs * loragate_amx::v_row(r) * 2);
  }
  return ticks;
}
#endif

template <typename T>
void group(at::Tensor& y, const at::Tensor& x, const Module* mods, int64_t n, const int64_t* ranks,
           const float* scales, int64_t slots, const Chunk* work, int64_t count) {
  const int64_t in = x.size(1), ldx = x.stride(0), ldy = y.stride(0);
  int64_t max_rank = 0;
  for (int64_t i = 0; i < n * slots; ++i) max_rank = std::max(max_rank, ranks[i]);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  // bf16 on AMX (`sgmv_amx.h`) for the modules whose B comes in rank pairs and whose shapes fit
  // (`loragate_amx::fits`; the adapter cache keeps pairs only for such shapes); the AVX blocks for the rest.
  const bool amx = std::is_same_v<T, at::BFloat16> && in % 32 == 0 && loragate_amx::ready();
  // Else bf16 pairs on AVX512-BF16 (`sgmv_dpbf16.h`), for the same modules.
  const bool dp = std::is_same_v<T, at::BFloat16> && in % 32 == 0 && !amx && loragate_dpbf16::ready();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    constexpr bool wide = std::is_same_v<T, float>;
    // Scratch kept by each pool thread across calls: allocating it per call cost page faults every call
    // (glibc hands large freed blocks back to the kernel).
    thread_local Scratch scratch;
    std::vector<float>& xs = scratch.xs;
    std::vector<float>& vs = scratch.vs;
    xs.resize(wide ? 0 : CHUNK * in), vs.resize(CHUNK * max_rank);
    // 16-bit B in the axpy layout: each module's slot [R, O] converted to fp32 once per run of its chunks.
    std::vector<std::vector<float>>& bf = scratch.b;
    if (!wide && static_cast<int64_t>(bf.size()) < n) bf.resize(n);
    std::vector<int64_t> converted(n, -1);
#if LORAGATE_AMX
    std::optional<loragate_amx::Tiles> tiles;
    if (amx) {
      tiles.emplace();
      scratch.xt.resize(in / 32 * 256), scratch.vh.resize(CHUNK * loragate_amx::v_row(max_rank));
    }
#endif
    if (dp) scratch.vh.resize(CHUNK * loragate_dpbf16::v_row(max_rank));
    loragate::Ahead<2>& ahead = scratch.ahead;
    for (int64_t i = next++, following = 0; i < count; i = following) {
      const Chunk& k = work[i];
      following = next++;  // claimed now, so that its weights come in while this chunk computes
      ahead.clear();
#if LORAGATE_AMX
      if (amx && following < count) {
        amx_reads(&ahead, work[following], mods, n, ranks, slots, in);
        ahead.spread(amx_reads(nullptr, k, mods, n, ranks, slots, in));
      }
      auto tick = [&] { ahead.tick(); };
#endif
      const T* xt = xp + k.token * ldx;
      bool have_xs = wide, x_paired = false;  // x's chunk in fp32 / packed in pairs, made when first needed
      const int64_t padded = (k.rows + TILE - 1) / TILE * TILE;
      for (int64_t m = 0; m < n; ++m) {
        const int64_t r = ranks[m * slots + k.slot];
        if (r == 0) continue;
        const Module& md = mods[m];
        const float scale = scales[m * slots + k.slot];
#if LORAGATE_AMX
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (amx && md.pairs != nullptr && loragate_amx::fits(in, md.outs, r)) {
            if (!x_paired) loragate_amx::pack_x(scratch.xt.data(), xt, ldx, k.rows, in), x_paired = true;
            const int64_t ldv = loragate_amx::v_row(r);
            uint16_t* vh = scratch.vh.data();
            const T* a = static_cast<const T*>(md.a) + k.slot * md.a_slot;
            loragate_amx::shrink(*tiles, scratch.xt.data(), k.rows, a, md.a_row, r, in,
                                 [&](int64_t u, int64_t j, float s) { vh[u * ldv + j] = from_float<T>(scale * s).x; },
                                 tick);
            if (ldv > r)
              for (int64_t u = 0; u < k.rows; ++u) vh[u * ldv + r] = 0;
            const T* bp = static_cast<const T*>(md.pairs) + k.slot * md.pair_slot;
            loragate_amx::expand(*tiles, yp + k.token * ldy + md.offset, ldy, vh, ldv, k.rows, bp, ldv / 2, r,
                                 md.outs, tick);
            continue;
          }
        }
#endif
#if LORAGATE_DPBF16
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (dp && md.pairs != nullptr && loragate_dpbf16::fits(in, md.outs, r)) {
            const int64_t ldv = loragate_dpbf16::v_row(r);
            uint16_t* vh = scratch.vh.data();
            std::fill(vh, vh + k.rows * ldv, uint16_t{0});  // an odd rank's last pair: half zero
            const T* a = static_cast<const T*>(md.a) + k.slot * md.a_slot;
            loragate_dpbf16::shrink(xt, ldx, k.rows, a, md.a_row, r, in,
                                    [&](int64_t u, int64_t j, float s) { vh[u * ldv + j] = from_float<T>(scale * s).x; });
            const T* bp = static_cast<const T*>(md.pairs) + k.slot * md.pair_slot;
            loragate_dpbf16::expand(yp + k.token * ldy + md.offset, ldy, vh, ldv, k.rows, bp, md.outs);
            continue;
          }
        }
#endif
        if (!have_xs) {
          for (int64_t u = 0; u < k.rows; ++u) to_float(xs.data() + u * in, xt + u * ldx, in);
          have_xs = true;
        }
        std::fill(vs.begin(), vs.begin() + padded * r, 0.f);  // a short tile's missing rows add zeros
        const T* a = static_cast<const T*>(md.a) + k.slot * md.a_slot;
        auto keep = [&](int64_t u, int64_t j, float s) {
          vs[u * r + j] = static_cast<float>(from_float<T>(scale * s));
        };
        if constexpr (wide) {
          shrink_rows(a, md.a_row, r, xt, ldx, k.rows, in, keep);
        } else {
          shrink_rows(a, md.a_row, r, xs.data(), in, k.rows, in, keep);
        }
        T* yt = yp + k.token * ldy + md.offset;
        const T* b = static_cast<const T*>(md.b) + k.slot * md.b_slot;
        if (md.b_out != 1) {
          expand_dots(yt, ldy, vs.data(), k.rows, r, b, md.b_out, md.b_rank, md.outs);
        } else if constexpr (wide) {
          expand_axpy(yt, ldy, vs.data(), k.rows, r, b, md.b_rank, md.outs);
        } else {
          std::vector<float>& buf = bf[m];
          if (converted[m] != k.slot) {
            buf.resize(r * md.outs);
            for (int64_t j = 0; j < r; ++j) to_float(buf.data() + j * md.outs, b + j * md.b_rank, md.outs);
            converted[m] = k.slot;
          }
          expand_axpy(yt, ldy, vs.data(), k.rows, r, buf.data(), md.outs, md.outs);
        }
      }
      ahead.finish();  // what the ticks did not cover, before the chunk that needs it
    }
  });
}

// The plan (`sgmv_group_plan.h`): checked and laid out once per step, read by every layer's call.
at::Tensor sgmv_group_plan(at::TensorList a, at::TensorList b, at::TensorList pairs, const at::Tensor& ranks,
                           const at::Tensor& scales, at::IntArrayRef offsets, const at::Tensor& segments) {
  const int64_t n = static_cast<int64_t>(a.size());
  TORCH_CHECK(n > 0, "sgmv_group: no projection");
  TORCH_CHECK(static_cast<int64_t>(b.size()) == n && static_cast<int64_t>(offsets.size()) == n,
              "sgmv_group: one b and one offset per a");
  TORCH_CHECK(pairs.empty() || static_cast<int64_t>(pairs.size()) == n, "sgmv_group: one B in pairs per a, or none");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == n,
              "sgmv_group: ranks must be contiguous int64 [M, S]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.sizes() == ranks.sizes(),
              "sgmv_group: scales must be contiguous float32 [M, S]");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && segments.dim() == 2 &&
                  segments.size(1) == 3,
              "sgmv_group: segments must be contiguous int64 [N, 3]");
  auto plan = std::make_unique<Plan>();
  const int64_t slots = ranks.size(1);
  const int64_t* rk = ranks.data_ptr<int64_t>();
  plan->dtype = a[0].scalar_type(), plan->slots = slots, plan->in = a[0].size(3);
  plan->layers = std::numeric_limits<int64_t>::max();
  const int64_t esize = static_cast<int64_t>(a[0].element_size());
  for (int64_t m = 0; m < n; ++m) {
    const at::Tensor &am = a[m], &bm = b[m];
    TORCH_CHECK(am.dim() == 4 && bm.dim() == 4 && am.scalar_type() == plan->dtype && bm.scalar_type() == plan->dtype,
                "sgmv_group: a and b must be [L, S, R, in] / [L, S, O, R] in x's dtype");
    TORCH_CHECK(am.size(3) == plan->in && am.stride(3) == 1 && am.stride(2) == am.size(3),
                "sgmv_group: a's rows must be contiguous and as long as x's");
    TORCH_CHECK(am.size(1) == slots && bm.size(1) == slots && bm.size(3) == am.size(2),
                "sgmv_group: a, b and the slot tables must agree on slots and rank");
    TORCH_CHECK(offsets[m] >= 0, "sgmv_group: output slice out of y");
    for (int64_t s = 0; s < slots; ++s)
      TORCH_CHECK(rk[m * slots + s] >= 0 && rk[m * slots + s] <= am.size(2), "sgmv_group: rank out of range");
    plan->layers = std::min({plan->layers, am.size(0), bm.size(0)});
    plan->width = std::max(plan->width, offsets[m] + bm.size(2));
    plan->mods.push_back({am.data_ptr(), am.stride(1), am.stride(2), bm.data_ptr(), bm.stride(1), bm.stride(2),
                          bm.stride(3), bm.size(2), offsets[m], nullptr, 0});
    std::array<int64_t, 3> strides{am.stride(0) * esize, bm.stride(0) * esize, 0};
    plan->held.push_back(am), plan->held.push_back(bm);
    if (!pairs.empty()) {
      const at::Tensor& pm = pairs[m];
      TORCH_CHECK(pm.dim() == 5 && pm.is_contiguous() && pm.scalar_type() == plan->dtype &&
                      pm.size(0) == am.size(0) && pm.size(1) == slots && pm.size(2) * 16 == bm.size(2) &&
                      pm.size(3) * 2 >= am.size(2) && pm.size(4) == 32,
                  "sgmv_group: pairs must be B in rank pairs, contiguous [L, S, O / 16, ceil(R / 2), 32]");
      plan->mods.back().pairs = pm.data_ptr();
      plan->mods.back().pair_slot = pm.stride(1);
      strides[2] = pm.stride(0) * esize;
      plan->held.push_back(pm);
    }
    plan->layer_bytes.push_back(strides);
  }
  plan->ranks.assign(rk, rk + n * slots);
  const float* sc = scales.data_ptr<float>();
  plan->scales.assign(sc, sc + n * slots);
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = seg[3 * i], end = seg[3 * i + 1], slot = seg[3 * i + 2];
    TORCH_CHECK(start >= 0 && start <= end && slot < slots, "sgmv_group: bad segment");
    plan->rows = std::max(plan->rows, end);
    if (slot < 0) continue;
    bool used = false;
    for (int64_t m = 0; m < n; ++m) used = used || rk[m * slots + slot] > 0;
    if (!used) continue;
    for (int64_t t = start; t < end; t += CHUNK) plan->work.push_back({t, slot, std::min(CHUNK, end - t)});
  }
  plan->row_slot.assign(plan->rows, -1);
  for (const Chunk& k : plan->work) {
    std::fill_n(plan->row_slot.begin() + k.token, k.rows, k.slot);
    if (std::find(plan->used.begin(), plan->used.end(), k.slot) == plan->used.end()) plan->used.push_back(k.slot);
  }
  plan->row_run.assign(plan->rows, -1);
  for (int64_t block = 0; block < plan->rows; block += 32) {
    int64_t run = -1;
    for (int64_t u = block; u < std::min(plan->rows, block + 32); ++u) {
      const int64_t s = plan->row_slot[u];
      if (s >= 0 && (u == block || plan->row_slot[u - 1] != s)) ++run;
      if (s >= 0) plan->row_run[u] = run;
    }
    plan->runs = std::max(plan->runs, run + 1);
  }
  // On AMX tiles where every module and every rank the step uses can be (what `group` would choose for each).
  bool tiles = plan->dtype == at::kBFloat16 && plan->in % 32 == 0 && !pairs.empty() && loragate_amx::ready();
  for (int64_t m = 0; m < n && tiles; ++m) {
    const Module& md = plan->mods[m];
    tiles = md.offset % 16 == 0 && md.outs % 16 == 0;
    for (const Chunk& k : plan->work) {
      const int64_t r = rk[m * slots + k.slot];
      tiles = tiles && (r == 0 || loragate_amx::fits(plan->in, md.outs, r));
    }
  }
  plan->tiles = tiles;
  int64_t adapted = 0, pieces = 0;
  for (int64_t u = 0; u < plan->rows; ++u) {
    const int64_t s = plan->row_slot[u];
    if (s < 0) continue;
    ++adapted;
    pieces += u % 16 == 0 || plan->row_slot[u - 1] != s;
  }
  plan->long_runs = adapted >= LONG_RUN * pieces;
  return loragate::plan_tensor(std::move(plan));
}

void run(at::Tensor& y, const at::Tensor& x, const Plan* plan, int64_t layer) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1,
              "sgmv_group: y and x must be 2-D with contiguous rows");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "sgmv_group: y and x must share a dtype");
  TORCH_CHECK(x.scalar_type() == plan->dtype, "sgmv_group: a and b must be [L, S, R, in] / [L, S, O, R] in x's dtype");
  TORCH_CHECK(x.size(1) == plan->in, "sgmv_group: a's rows must be contiguous and as long as x's");
  TORCH_CHECK(layer >= 0 && layer < plan->layers, "sgmv_group: layer out of range");
  TORCH_CHECK(plan->width <= y.size(1), "sgmv_group: output slice out of y");
  TORCH_CHECK(plan->rows <= x.size(0) && plan->rows <= y.size(0), "sgmv_group: bad segment");
  if (plan->work.empty()) return;
  const int64_t n = static_cast<int64_t>(plan->mods.size());
  std::array<Module, 8> local;
  std::vector<Module> many;
  Module* mods = n <= 8 ? local.data() : (many.resize(n), many.data());
  for (int64_t m = 0; m < n; ++m) {
    mods[m] = at_layer(*plan, m, layer);
  }
  const int64_t* rk = plan->ranks.data();
  const float* sc = plan->scales.data();
  const Chunk* work = plan->work.data();
  const int64_t count = static_cast<int64_t>(plan->work.size()), slots = plan->slots;
  switch (x.scalar_type()) {
    case at::kFloat: group<float>(y, x, mods, n, rk, sc, slots, work, count); break;
    case at::kBFloat16: group<at::BFloat16>(y, x, mods, n, rk, sc, slots, work, count); break;
    case at::kHalf: group<at::Half>(y, x, mods, n, rk, sc, slots, work, count); break;
    default: TORCH_CHECK(false, "sgmv_group: unsupported dtype ", x.scalar_type());
  }
}

void sgmv_group_run(at::Tensor y, const at::Tensor& x, const at::Tensor& plan, int64_t layer) {
  run(y, x, &read_plan(plan), layer);
}

// Plan and run in one call (for a single layer's use).
void sgmv_group(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList pairs,
                const at::Tensor& ranks, const at::Tensor& scales, at::IntArrayRef offsets, const at::Tensor& segments,
                int64_t layer) {
  sgmv_group_run(y, x, sgmv_group_plan(a, b, pairs, ranks, scales, offsets, segments), layer);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("sgmv_group_plan(Tensor[] a, Tensor[] b, Tensor[] pairs, Tensor ranks, Tensor scales, int[] offsets, "
        "Tensor segments) -> Tensor");
  m.impl("sgmv_group_plan", c10::DispatchKey::CPU, &sgmv_group_plan);
  m.def("sgmv_group_run(Tensor(a!) y, Tensor x, Tensor plan, int layer) -> ()");
  m.impl("sgmv_group_run", c10::DispatchKey::CPU, &sgmv_group_run);
  m.def("sgmv_group(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, Tensor[] pairs, Tensor ranks, Tensor scales, "
        "int[] offsets, Tensor segments, int layer) -> ()");
  m.impl("sgmv_group", c10::DispatchKey::CPU, &sgmv_group);
  // Whether the bf16 kernels use AMX here (so B in rank pairs is worth keeping): built for it and allowed.
  m.def("amx_ready() -> bool", [] { return loragate_amx::ready(); });
  // Whether the bf16 kernels read B in rank pairs here: on AMX, or on AVX512-BF16's pair dot products.
  m.def("bf16_pairs_ready() -> bool", [] { return loragate_amx::ready() || loragate_dpbf16::ready(); });
}

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
// (`pairs`, kept by the adapter cache, each slot's own ranks dense) runs on AMX tiles instead (`sgmv_amx.h`):
// the same sums, summed in the tiles' order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sgmv_amx.h"
#include "sgmv_common.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace loragate_sgmv;

constexpr int64_t CHUNK = 16;  // tokens per work item: 4 tiles per read of the weights from L2 or memory

struct Chunk {
  int64_t token, slot, rows;
};

struct Module {
  const void* a;  // this layer's [S, R, in], rows contiguous
  int64_t a_slot, a_row;
  const void* b;  // this layer's [S, O, R] through its strides
  int64_t b_slot, b_out, b_rank, outs, offset;
  // This layer's B in rank pairs [S, O / 16, R / 2, 32] (`sgmv_amx.h`), or null. Each slot's region holds
  // its own rank's pairs densely, [O / 16, ceil(r / 2), 32] from its start (`kernels.sgmv_native.slot_pairs`).
  const void* pairs;
  int64_t pair_slot;
};

struct Scratch {
  std::vector<float> xs, vs;
  std::vector<std::vector<float>> b;
  std::vector<uint32_t> xt;  // AMX: x's chunk in pairs
  std::vector<uint16_t> vh;  // AMX: v's bf16 bits
};

template <typename T>
void group(at::Tensor& y, const at::Tensor& x, const std::vector<Module>& mods, const int64_t* ranks,
           const float* scales, int64_t slots, const std::vector<Chunk>& work) {
  const int64_t in = x.size(1), ldx = x.stride(0), ldy = y.stride(0), n = static_cast<int64_t>(mods.size());
  int64_t max_rank = 0;
  for (int64_t i = 0; i < n * slots; ++i) max_rank = std::max(max_rank, ranks[i]);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(work.size()));
  // bf16 on AMX (`sgmv_amx.h`) for the modules whose B comes in rank pairs and whose shapes fit
  // (`loragate_amx::fits`; the adapter cache keeps pairs only for such shapes); the AVX blocks for the rest.
  const bool amx = std::is_same_v<T, at::BFloat16> && in % 32 == 0 && loragate_amx::ready();
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
    for (int64_t i = next++; i < static_cast<int64_t>(work.size()); i = next++) {
      const Chunk& k = work[i];
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
                                 [&](int64_t u, int64_t j, float s) { vh[u * ldv + j] = from_float<T>(scale * s).x; });
            if (ldv > r)
              for (int64_t u = 0; u < k.rows; ++u) vh[u * ldv + r] = 0;
            const T* bp = static_cast<const T*>(md.pairs) + k.slot * md.pair_slot;
            loragate_amx::expand(*tiles, yp + k.token * ldy + md.offset, ldy, vh, ldv, k.rows, bp, ldv / 2, r,
                                 md.outs);
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
    }
  });
}

void sgmv_group(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList b, at::TensorList pairs,
                const at::Tensor& ranks,
                const at::Tensor& scales, at::IntArrayRef offsets, const at::Tensor& segments, int64_t layer) {
  const int64_t n = static_cast<int64_t>(a.size());
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1,
              "sgmv_group: y and x must be 2-D with contiguous rows");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "sgmv_group: y and x must share a dtype");
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
  const int64_t slots = ranks.size(1);
  const int64_t* rk = ranks.data_ptr<int64_t>();
  std::vector<Module> mods;
  for (int64_t m = 0; m < n; ++m) {
    const at::Tensor &am = a[m], &bm = b[m];
    TORCH_CHECK(am.dim() == 4 && bm.dim() == 4 && am.scalar_type() == x.scalar_type() &&
                    bm.scalar_type() == x.scalar_type(),
                "sgmv_group: a and b must be [L, S, R, in] / [L, S, O, R] in x's dtype");
    TORCH_CHECK(am.size(3) == x.size(1) && am.stride(3) == 1 && am.stride(2) == am.size(3),
                "sgmv_group: a's rows must be contiguous and as long as x's");
    TORCH_CHECK(am.size(1) == slots && bm.size(1) == slots && bm.size(3) == am.size(2),
                "sgmv_group: a, b and the slot tables must agree on slots and rank");
    TORCH_CHECK(layer >= 0 && layer < am.size(0) && layer < bm.size(0), "sgmv_group: layer out of range");
    TORCH_CHECK(offsets[m] >= 0 && offsets[m] + bm.size(2) <= y.size(1), "sgmv_group: output slice out of y");
    for (int64_t s = 0; s < slots; ++s)
      TORCH_CHECK(rk[m * slots + s] >= 0 && rk[m * slots + s] <= am.size(2), "sgmv_group: rank out of range");
    const int64_t esize = static_cast<int64_t>(x.element_size());
    mods.push_back({static_cast<const char*>(am.data_ptr()) + layer * am.stride(0) * esize, am.stride(1),
                    am.stride(2), static_cast<const char*>(bm.data_ptr()) + layer * bm.stride(0) * esize,
                    bm.stride(1), bm.stride(2), bm.stride(3), bm.size(2), offsets[m], nullptr, 0});
    if (!pairs.empty()) {
      const at::Tensor& pm = pairs[m];
      TORCH_CHECK(pm.dim() == 5 && pm.is_contiguous() && pm.scalar_type() == x.scalar_type() &&
                      pm.size(0) == am.size(0) && pm.size(1) == slots && pm.size(2) * 16 == bm.size(2) &&
                      pm.size(3) * 2 >= am.size(2) && pm.size(4) == 32,
                  "sgmv_group: pairs must be B in rank pairs, contiguous [L, S, O / 16, ceil(R / 2), 32]");
      mods.back().pairs = static_cast<const char*>(pm.data_ptr()) + layer * pm.stride(0) * esize;
      mods.back().pair_slot = pm.stride(1);
    }
  }
  std::vector<Chunk> work;
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = seg[3 * i], end = seg[3 * i + 1], slot = seg[3 * i + 2];
    TORCH_CHECK(start >= 0 && end <= x.size(0) && end <= y.size(0) && slot < slots, "sgmv_group: bad segment");
    if (slot < 0) continue;
    bool used = false;
    for (int64_t m = 0; m < n; ++m) used = used || rk[m * slots + slot] > 0;
    if (!used) continue;
    for (int64_t t = start; t < end; t += CHUNK) work.push_back({t, slot, std::min(CHUNK, end - t)});
  }
  const float* sc = scales.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: group<float>(y, x, mods, rk, sc, slots, work); break;
    case at::kBFloat16: group<at::BFloat16>(y, x, mods, rk, sc, slots, work); break;
    case at::kHalf: group<at::Half>(y, x, mods, rk, sc, slots, work); break;
    default: TORCH_CHECK(false, "sgmv_group: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("sgmv_group(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, Tensor[] pairs, Tensor ranks, Tensor scales, "
        "int[] offsets, Tensor segments, int layer) -> ()");
  m.impl("sgmv_group", c10::DispatchKey::CPU, &sgmv_group);
  // Whether the bf16 kernels use AMX here (so B in rank pairs is worth keeping): built for it and allowed.
  m.def("amx_ready() -> bool", [] { return loragate_amx::ready(); });
}

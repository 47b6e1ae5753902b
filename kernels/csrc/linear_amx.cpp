// Dense bf16 linear layers on CPUs with AMX, for the row counts of decode steps: y = bf16(x Wᵀ + b).
//
// Why not oneDNN's matmul, which also runs on AMX: at 16-128 rows a layer's matmul is as much a stream of its
// weights from memory (SmolLM2's 30 layers are 212 MB of bf16, read once a step) as arithmetic, and oneDNN's
// AMX matmul at those row counts does the two one after the other: over 30 layers' distinct weights it took
// 21 ms at 128 rows against 10.9 ms with the weights in cache and 12 ms for the weights alone at 16 rows
// (docs/BENCHMARKS.md). Here the weight is packed once (`kernels.linear_amx.pack_amx`) into panels of 32
// output columns, each panel one contiguous run of memory; a thread takes a contiguous range of panels and,
// while its tiles multiply one panel, prefetches the next into L2 (its lines spread over the panel's blocks
// of rows), so the fetch and the arithmetic overlap, and a panel read once serves every row.
//
// Layout: packed[p][kb] holds two tiles of B for output columns p * 32 + h * 16 + c (h = 0, 1; c < 16) and
// k = kb * 32 + 2 i + e (i < 16, e < 2) at [h * 512 + i * 32 + c * 2 + e] (AMX's pairs of k per column),
// zero past the weight's N columns and K values. Per block of 32 rows (16 for an odd last block) and panel,
// four tiles of fp32 sums (2 row tiles x 2 column tiles) run over k in order; the sums plus the bias are
// rounded to bf16 once, while the tiles compute the next block (two buffers, `Blocks`). A row's result never
// depends on the rows around it. The rows past a multiple of 16 are read from a zero-padded copy (at most 15
// rows); a K that is no multiple of 32 takes a padded copy of x. A decode-sized call (up to `BIG_ROWS` rows) runs each
// panel over every block of rows; a prefill-sized one takes its panels in groups of at most `GROUP_BYTES`
// (which stay in L2) and runs each block of 32 rows over every panel of a group, the panels' tiles loaded
// with the non-temporal hint so that the block's x stays in L1 (30 SmolLM2 layers at 2,048 rows: 136-147 ms
// against 168-182 with all of a thread's panels a group, whose 1.8 MB of gate/up weights left L2 each
// block, and 191.7 ms running each panel over every block; oneDNN 161.8).
//
// A fused gate/up weight can be packed gated (each panel 16 of the gate's columns and the up projection's same
// 16): the sums then go out in the weight's own order, or as silu(gate) * up with `silu_mul`'s roundings, so
// the MLP's activation is computed in the shadow of the next block's multiplies instead of in a pass of its own
// over [rows, 2 * inter] (a SmolLM2 bf16 decode step of 64 rows: 37.6 -> 35.8 ms). A LoRA group's adapters
// can be added inside the matmul too (`linear_amx_lora`, `linear_amx_lora.h`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "linear_amx_blocks.h"
#include "sgmv_amx.h"

namespace {

using namespace loragate_amx_linear;
constexpr int64_t BIG_ROWS = 128;  // above this many rows a call is run as a prefill (see the loop)
constexpr int64_t GROUP_BYTES = 1 << 20;  // a prefill's panels, a group at a time: half of an AMX core's L2

bool usable(const at::Tensor& x, const at::Tensor& packed) {
  return x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
         packed.dim() == 3 && x.stride(1) == 1 && packed.is_contiguous() && packed.size(2) == 2 * TILE &&
         x.size(1) <= packed.size(1) * KBLOCK;
}

#if LORAGATE_AMX

// A LoRA group whose adapters go in at `layer`, with the rows' shrinks v [rows, modules, runs, width].
struct LoRA {
  const loragate_sgmv_group::Plan* plan;
  int64_t layer;
  const bf16* v;
  int64_t width;
};

// x [m, K] times the packed weight's n output columns, each block's sums handed to `how` (`Blocks`): into
// yp (row stride ldy), or for `Out::argmax` each row's argmax into at; with `lora`'s adapters on their rows.
void compute(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias_in,
             bf16* yp, int64_t ldy, int64_t n, Out how, int64_t* at, const LoRA* lora = nullptr) {
  const int64_t m = x_in.size(0), kblocks = packed.size(1);
  const int64_t panels = (n + PANEL - 1) / PANEL;
  if (m == 0 || n == 0) return;
  // x as the tiles read it: in place when K fills whole tiles, else a zero-padded copy; and its rows past the
  // last multiple of 16 zero-padded to 16. Both in buffers of this thread's, kept between calls.
  thread_local std::vector<bf16> padded, tail;
  const int64_t k = x_in.size(1), ldt = kblocks * KBLOCK, full = m / 16 * 16;
  const bf16* xp = x_in.data_ptr<bf16>();
  int64_t ldx = x_in.stride(0);
  if (k != ldt) {
    padded.assign(m * ldt, bf16(0.f));
    for (int64_t r = 0; r < m; ++r) std::memcpy(padded.data() + r * ldt, xp + r * ldx, k * sizeof(bf16));
    xp = padded.data(), ldx = ldt;
  }
  if (full < m) {
    tail.assign(16 * ldt, bf16(0.f));
    for (int64_t r = full; r < m; ++r) std::memcpy(tail.data() + (r - full) * ldt, xp + r * ldx, k * sizeof(bf16));
  }
  at::Tensor bias_f;
  if (bias_in.has_value() && bias_in->defined()) bias_f = bias_in->to(at::kFloat).contiguous();
  const float* bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const bf16* tp = full < m ? tail.data() : nullptr;
  const bf16* wp = packed.data_ptr<bf16>();
  // A gated weight's column tiles are the gate's columns col / 2 .. and the up projection's n / 2 + col / 2 ..:
  // the bias is read there, in the weight's own order.
  const bool gated = how == Out::split || how == Out::silu_mul;
  // argmax: each task's best per row over its panels, merged in the panels' order after.
  struct Part {
    int64_t begin;
    std::vector<float> best;
    std::vector<int64_t> at;
  };
  std::vector<Part> parts;
  std::mutex parts_lock;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    Part part{begin, {}, {}};
    if (how == Out::argmax) {
      part.best.assign(m, -std::numeric_limits<float>::infinity());
      part.at.assign(m, begin * PANEL);
    }
    Tiles tiles;
    std::optional<Adapters> adapters;
    if (lora != nullptr) adapters.emplace(*lora->plan, lora->layer, lora->v, lora->width, n, panels, gated);
    Blocks blocks(yp, ldy, n, m > BIG_ROWS, how, part.best.data(), part.at.data(),
                  adapters.has_value() ? &*adapters : nullptr);
    // The 16 rows of x from row r (a multiple of 16) and their stride: x's own, or the padded tail's.
    auto tile_rows = [&](int64_t r) { return r < full ? std::pair{xp + r * ldx, ldx} : std::pair{tp, ldt}; };
    auto run = [&](int64_t r, int64_t p, const char* ahead, int64_t per_kb) {
      const int64_t col = p * PANEL;
      const auto [x0, l0] = tile_rows(r);
      const auto [x1, l1] = tile_rows(r + 16);
      blocks.run(r, std::min<int64_t>(32, m - r), x0, l0, x1, l1, wp + p * kblocks * 2 * TILE, kblocks, col,
                 bias_at(bias, gated ? col / 2 : col, n), bias_at(bias, gated ? n / 2 + col / 2 : col + 16, n), ahead,
                 per_kb);
    };
    auto next_panel = [&](int64_t p) { return reinterpret_cast<const char*>(wp + (p + 1) * kblocks * 2 * TILE); };
    if (m > BIG_ROWS) {  // a prefill: each block of 32 rows over a group of the thread's panels, x's block in L1
      const int64_t group = std::max<int64_t>(1, GROUP_BYTES / (kblocks * 2 * TILE * int64_t{sizeof(bf16)}));
      for (int64_t g = begin; g < end; g += group) {
        const int64_t g_end = std::min(end, g + group);
        for (int64_t r = 0; r < m; r += 32)
          for (int64_t p = g; p < g_end; ++p) {  // the first pass fetches the panels: it prefetches the next
            if (r == 0 && adapters.has_value() && p + 1 < end) adapters->prefetch((p + 1) * PANEL);
            run(r, p, r == 0 && p + 1 < end ? next_panel(p) : nullptr, PANEL);
          }
      }
    } else {  // a decode step: each panel over every block of rows, the next panel's lines spread over them
      const int64_t nblocks = (m + 31) / 32, per_kb = (PANEL + nblocks - 1) / nblocks;
      if (adapters.has_value())
        for (int64_t p = begin; p < std::min(end, begin + 2); ++p) adapters->prefetch(p * PANEL);
      for (int64_t p = begin; p < end; ++p) {
        if (adapters.has_value() && p + 2 < end) adapters->prefetch((p + 2) * PANEL);
        for (int64_t r = 0, blk = 0; r < m; r += 32, ++blk)
          run(r, p, p + 1 < end ? next_panel(p) + blk * kblocks * per_kb * 64 : nullptr, per_kb);
      }
    }
    blocks.flush();
    if (how == Out::argmax) {
      const std::lock_guard<std::mutex> hold(parts_lock);
      parts.push_back(std::move(part));
    }
  });
  if (how != Out::argmax) return;
  std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.begin < b.begin; });
  for (int64_t r = 0; r < m; ++r) {  // the first part's answer unless a later one's is larger, or a NaN
    float best = parts[0].best[r];
    at[r] = parts[0].at[r];
    for (size_t i = 1; i < parts.size() && !std::isnan(best); ++i)
      if (std::isnan(parts[i].best[r]) || parts[i].best[r] > best) best = parts[i].best[r], at[r] = parts[i].at[r];
  }
}

#endif  // LORAGATE_AMX

// mode: 0 out = x Wᵀ + b; for a weight packed gated (`kernels.linear_amx.pack_amx`), 1 the same in the weight's
// own column order, 2 silu(gate) * up, out half as wide.
void linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias, int64_t mode) {
  const int64_t n = mode == 2 ? 2 * out.size(1) : out.size(1);
  TORCH_CHECK(usable(x, packed) && out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && mode >= 0 && mode <= 2 &&
                  (mode == 0 ? n <= packed.size(0) * PANEL : n == packed.size(0) * PANEL),
              "linear_amx: bf16 out [M, N], x [M, K], packed [P, KB, 1024], mode 0-2 (1-2: N fills the panels)");
  TORCH_CHECK(loragate_amx::ready(), "linear_amx: this CPU (or process) cannot run AMX tiles");
#if LORAGATE_AMX
  compute(x, packed, bias, out.data_ptr<bf16>(), out.stride(0), n, static_cast<Out>(mode), nullptr);
#endif
}

// `linear_amx` plus a LoRA group's adapters on their rows (`linear_amx_lora.h`): what `linear_amx` then
// `sgmv_group_run` on its output compute (mode 0 or 1), or, mode 2, with the SiLU after them. v: the group's
// shrinks of x (`sgmv_group_shrink` into `sgmv_group_v`).
void linear_amx_lora(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const std::optional<at::Tensor>& bias, int64_t mode, const at::Tensor& v, const at::Tensor& plan_t,
                     int64_t layer) {
  const auto& plan = loragate_sgmv_group::read_plan(plan_t);
  const int64_t n = mode == 2 ? 2 * out.size(1) : out.size(1), m = x.size(0);
  const int64_t modules = static_cast<int64_t>(plan.mods.size());
  TORCH_CHECK(plan.tiles && plan.in == x.size(1) && plan.width <= n && plan.rows <= m && layer >= 0 &&
                  layer < plan.layers,
              "linear_amx_lora: the group must run on AMX tiles, read x's rows and fit in the output");
  TORCH_CHECK(v.scalar_type() == at::kBFloat16 && v.dim() == 4 && v.is_contiguous() && v.size(0) >= (m + 31) / 32 * 32 &&
                  v.size(1) == modules && v.size(2) == plan.runs && v.size(3) % 32 == 0,
              "linear_amx_lora: v must be contiguous bf16 [rows rounded up to 32, modules, runs, 32 k] (`sgmv_group_v`)");
  for (int64_t r : plan.ranks) TORCH_CHECK(loragate_amx::v_row(r) <= v.size(3), "linear_amx_lora: v too narrow");
  TORCH_CHECK(usable(x, packed) && out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == m && mode >= 0 && mode <= 2 &&
                  (mode == 0 ? n <= packed.size(0) * PANEL : n == packed.size(0) * PANEL),
              "linear_amx_lora: bf16 out [M, N], x [M, K], packed [P, KB, 1024], mode 0-2 (1-2: N fills the panels)");
  TORCH_CHECK(loragate_amx::ready(), "linear_amx_lora: this CPU (or process) cannot run AMX tiles");
#if LORAGATE_AMX
  const LoRA lora{&plan, layer, v.data_ptr<bf16>(), v.size(3)};
  compute(x, packed, bias, out.data_ptr<bf16>(), out.stride(0), n, static_cast<Out>(mode), nullptr, &lora);
#endif
}

// out[r] = argmax over the first n columns of bf16(x Wᵀ)[r]: `linear_amx` then `argmax_rows`, without the
// results (the LM head's greedy pick).
void linear_amx_argmax(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(usable(x, packed) && out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() &&
                  out.size(0) == x.size(0) && n > 0 && n <= packed.size(0) * PANEL,
              "linear_amx_argmax: int64 out [M], x [M, K], packed [P, KB, 1024], 0 < n <= 32 P");
  TORCH_CHECK(loragate_amx::ready(), "linear_amx_argmax: this CPU (or process) cannot run AMX tiles");
#if LORAGATE_AMX
  compute(x, packed, std::nullopt, nullptr, 0, n, Out::argmax, out.data_ptr<int64_t>());
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("linear_amx(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int mode=0) -> ()");
  m.def("linear_amx_argmax(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.impl("linear_amx", c10::DispatchKey::CPU, &linear_amx);
  m.def("linear_amx_lora(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int mode, Tensor v, Tensor plan, "
        "int layer) -> ()");
  m.impl("linear_amx_lora", c10::DispatchKey::CPU, &linear_amx_lora);
  m.impl("linear_amx_argmax", c10::DispatchKey::CPU, &linear_amx_argmax);
}

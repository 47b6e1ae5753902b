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
// over [rows, 2 * inter] (a SmolLM2 bf16 decode step of 64 rows: 37.6 -> 35.8 ms).
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

#include "linear_amx_out.h"
#include "sgmv_amx.h"

namespace {

using bf16 = at::BFloat16;
constexpr int64_t PANEL = 32;      // output columns a panel
constexpr int64_t KBLOCK = 32;     // k values a tile row
constexpr int64_t TILE = 16 * 32;  // bf16 values a tile
constexpr int64_t BIG_ROWS = 128;  // above this many rows a call is run as a prefill (see the loop)
constexpr int64_t GROUP_BYTES = 1 << 20;  // a prefill's panels, a group at a time: half of an AMX core's L2

#if LORAGATE_AMX

using loragate_amx_out::Out;

// Tiles 0-3: sums [16 rows x 16 columns] (row tile r, column tile h at 2 r + h); 4-5: x [16 x 32];
// 6-7: the weight's pairs [16 x 32]. One shape for every call: configured once per parallel task.
struct Tiles {
  Tiles() {
    loragate_amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
    cfg.load();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() { _tile_release(); }
};

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
  Blocks(bf16* y, int64_t ldy, int64_t n, bool big, Out how, float* best = nullptr, int64_t* at = nullptr)
      : y_(y), ldy_(ldy), n_(n), how_(how), best_(best), at_(at), stream_w(big) {}
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
    pending_ = {row, rows, col, b0, b1};
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
    using namespace loragate_amx_out;
    const Pending& p = pending_;
    bf16* y = y_ + p.row * ldy_;
    if (how_ == Out::plain)
      store(y, ldy_, c_[cur_], done_, until, p.col, n_, p.b0, p.b1);
    else if (how_ == Out::argmax)
      pick(best_ + p.row, at_ + p.row, c_[cur_], done_, until, p.col, n_);
    else
      store_gated(y, ldy_, c_[cur_], done_, until, p.col, n_ / 2, p.b0, p.b1, how_);
    done_ = until;
  }

  struct Pending {
    int64_t row, rows, col;
    __m512 b0, b1;
  };
  alignas(64) float c_[2][4][256];
  bf16* y_;
  int64_t ldy_, n_;
  Out how_;
  float* best_;
  int64_t* at_;
  Pending pending_{0, 0, 0, _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t done_ = 0;  // the waiting block's rows already out
  int cur_ = 0;
  const bool stream_w;
};

#endif  // LORAGATE_AMX

bool usable(const at::Tensor& x, const at::Tensor& packed) {
  return x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
         packed.dim() == 3 && x.stride(1) == 1 && packed.is_contiguous() && packed.size(2) == 2 * TILE &&
         x.size(1) <= packed.size(1) * KBLOCK;
}

#if LORAGATE_AMX

// x [m, K] times the packed weight's n output columns, each block's sums handed to `how` (`Blocks`): into
// yp (row stride ldy), or for `Out::argmax` each row's argmax into at.
void compute(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias_in,
             bf16* yp, int64_t ldy, int64_t n, Out how, int64_t* at) {
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
    Blocks blocks(yp, ldy, n, m > BIG_ROWS, how, part.best.data(), part.at.data());
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
          for (int64_t p = g; p < g_end; ++p)  // the first pass fetches the panels: it prefetches the next
            run(r, p, r == 0 && p + 1 < end ? next_panel(p) : nullptr, PANEL);
      }
    } else {  // a decode step: each panel over every block of rows, the next panel's lines spread over them
      const int64_t nblocks = (m + 31) / 32, per_kb = (PANEL + nblocks - 1) / nblocks;
      for (int64_t p = begin; p < end; ++p)
        for (int64_t r = 0, blk = 0; r < m; r += 32, ++blk)
          run(r, p, p + 1 < end ? next_panel(p) + blk * kblocks * per_kb * 64 : nullptr, per_kb);
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
  m.impl("linear_amx_argmax", c10::DispatchKey::CPU, &linear_amx_argmax);
}

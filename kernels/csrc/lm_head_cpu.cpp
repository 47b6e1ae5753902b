// The LM head on a CPU: logits = x Wᵀ over a vocabulary of V columns, from W packed once in column panels
// (`kernels.lm_head.pack_lm_head`: panels[p][k][c] = W[p * PANEL + c][k], zero past V). And the greedy pick
// fused into it: each row's argmax read off the tiles as they are computed, so that a greedy step never
// writes its [rows, V] logits to memory and reads them back (16-25 MB a step at 128 rows, V = 32-49k).
//
// A tile is R rows × PANEL = 48 columns. With AVX-512: 8 rows, 24 accumulators, and per k one load of the
// panel's 3 vectors and 8 broadcasts of x feed 24 FMAs. With AVX2 (16 registers): 2 rows, 12 accumulators,
// 6 loads and 2 broadcasts per 12 FMAs (4 rows × 3 vectors, twice per panel, measured slower on a Zen 3:
// the panel is re-read from L2 either way). A panel (K × 48 floats) is read from memory once and serves
// every tile of rows while it is in L1/L2. Each logit sums over k in order, one FMA at a time, wherever its row
// sits: a row's logits never depend on the batch around it. Threads take contiguous ranges of panels.
//
// The argmax is torch.argmax's: the first index of a row's largest value, or of its first NaN. With
// `round_bf16` the logits are compared as bf16 rounds them (what the argmax of bf16 logits sees).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "convert.h"

namespace {

using loragate::from_float;

// The vectors are the target's own width: 16 floats (one zmm) with AVX-512, else 8 (one ymm). GCC lowers a
// generic vector wider than the target's registers piece by piece, and a scalar times such a vector through
// the stack, lane by lane (25x slower than oneDNN on an AVX2 Zen 3).
#if defined(__AVX512F__)
constexpr int L = 16;
constexpr int R = 8;   // rows per tile
constexpr int CV = 3;  // column vectors summed at once: 8 × 3 accumulators, 24 of the 32 zmm registers
#else
constexpr int L = 8;
constexpr int R = 2;   // rows per tile
constexpr int CV = 6;  // 2 × 6 accumulators in 12 of the 16 ymm registers
#endif
using vf = float __attribute__((vector_size(L * sizeof(float))));
using vi = int32_t __attribute__((vector_size(L * sizeof(int32_t))));
using vu = uint32_t __attribute__((vector_size(L * sizeof(uint32_t))));

constexpr int64_t PANEL = 48;   // columns a panel (`kernels.lm_head.PANEL`)
constexpr int V = PANEL / L;    // vectors per panel row
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc[r][v] = sum_k x[r][k] * panel[k][L v .. L v + L) for H rows of x (row r at x + r * ldx), CV vectors
// of columns at a time so that H × CV accumulators stay in registers.
template <int H>
inline void tile(vf (&acc)[R][V], const float* x, int64_t ldx, const float* panel, int64_t k_size) {
  const float* xr[H];
  for (int r = 0; r < H; ++r) xr[r] = x + r * ldx;
  for (int c0 = 0; c0 < V; c0 += CV) {
    vf part[H][CV];
#pragma GCC unroll 8
    for (int r = 0; r < H; ++r)
      for (int v = 0; v < CV; ++v) part[r][v] = vf{};
    const float* col = panel + L * c0;
    for (int64_t k = 0; k < k_size; ++k) {
      vf w[CV];
      for (int v = 0; v < CV; ++v) w[v] = load(col + k * PANEL + L * v);
#pragma GCC unroll 8
      for (int r = 0; r < H; ++r) {
        const vf xs = vf{} + xr[r][k];
        for (int v = 0; v < CV; ++v) part[r][v] += xs * w[v];
      }
    }
    for (int r = 0; r < H; ++r)
      for (int v = 0; v < CV; ++v) acc[r][c0 + v] = part[r][v];
  }
}

// Every tile of rows against panels [p0, p1): `visit(acc, m0, rows, p)` after each.
template <typename Visit>
inline void sweep(const float* x, int64_t m_size, int64_t k_size, const float* panels, int64_t p0, int64_t p1,
                  Visit&& visit) {
  vf acc[R][V];
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * k_size * PANEL;
    int64_t m0 = 0;
    for (; m0 + R <= m_size; m0 += R) {
      tile<R>(acc, x + m0 * k_size, k_size, panel, k_size);
      visit(acc, m0, R, p);
    }
    for (; m0 < m_size; ++m0) {
      tile<1>(acc, x + m0 * k_size, k_size, panel, k_size);
      visit(acc, m0, 1, p);
    }
  }
}

inline vf round_bf16(vf s) {
  vu w;
  std::memcpy(&w, &s, sizeof(w));
  w = (w + 0x7FFFu + ((w >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&s, &w, sizeof(s));
  return s;
}

void check(const at::Tensor& x, const at::Tensor& panels, int64_t vocab) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "lm_head: x must be contiguous float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat &&
                  panels.size(1) == x.size(1) && panels.size(2) == PANEL,
              "lm_head: panels must be contiguous float32 [P, K, ", PANEL, "] over x's K");
  TORCH_CHECK(vocab > 0 && vocab <= panels.size(0) * PANEL && panels.size(0) == (vocab + PANEL - 1) / PANEL,
              "lm_head: vocab ", vocab, " does not fit ", panels.size(0), " panels");
}

// out[m][n] = x[m] · W[n], rounded to out's dtype (float32 or bfloat16).
template <typename T>
void logits_impl(T* out, const float* x, int64_t m_size, int64_t k_size, const float* panels, int64_t num_panels,
                 int64_t vocab) {
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    sweep(x, m_size, k_size, panels, p0, p1, [&](vf (&acc)[R][V], int64_t m0, int rows, int64_t p) {
      const int64_t n0 = p * PANEL, width = std::min(PANEL, vocab - n0);
      for (int r = 0; r < rows; ++r) {
        T* row = out + (m0 + r) * vocab + n0;
        if (width == PANEL) {
          for (int v = 0; v < V; ++v) {
            float f[L];
            std::memcpy(f, &acc[r][v], sizeof(f));
            for (int l = 0; l < L; ++l) row[L * v + l] = from_float<T>(f[l]);
          }
        } else {
          float s[PANEL];
          std::memcpy(s, acc[r], sizeof(s));
          for (int64_t c = 0; c < width; ++c) row[c] = loragate::from_float<T>(s[c]);
        }
      }
    });
  });
}

void lm_head_logits(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, int64_t vocab) {
  check(x, panels, vocab);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == vocab,
              "lm_head_logits: out must be contiguous [M, vocab]");
  const int64_t m = x.size(0), k = x.size(1), p = panels.size(0);
  if (out.scalar_type() == at::kFloat) {
    logits_impl(out.data_ptr<float>(), x.data_ptr<float>(), m, k, panels.data_ptr<float>(), p, vocab);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "lm_head_logits: out must be float32 or bfloat16");
    logits_impl(out.data_ptr<at::BFloat16>(), x.data_ptr<float>(), m, k, panels.data_ptr<float>(), p, vocab);
  }
}

// (value, index) of the better of two candidates, `a` covering lower indices on a tie of values.
struct Best {
  float value = NEG_INF;
  int64_t index = -1;
  bool nan = false;
  void offer(float v, int64_t i) {
    const bool is_nan = v != v;
    if (index < 0 || (is_nan && !nan) || (!nan && !is_nan && (v > value || (v == value && i < index))) ||
        (nan && is_nan && i < index)) {
      value = v, index = i, nan = is_nan;
    }
  }
};

void lm_head_argmax(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, int64_t vocab,
                    bool round_to_bf16) {
  check(x, panels, vocab);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong,
              "lm_head_argmax: out must be contiguous int64 [M]");
  const int64_t m_size = x.size(0), k_size = x.size(1), num_panels = panels.size(0);
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_panels));
  std::vector<Best> bests(parts * m_size);
  at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // Lane-wise running bests: lane l of vector v holds the best of columns n ≡ L v + l (mod PANEL).
      std::vector<vf> value(m_size * V, vf{} + NEG_INF);
      std::vector<vi> index(m_size * V, vi{} - 1);
      vi lane;
      for (int l = 0; l < L; ++l) lane[l] = l;
      sweep(xp, m_size, k_size, pp, num_panels * t / parts, num_panels * (t + 1) / parts,
            [&](vf (&acc)[R][V], int64_t m0, int rows, int64_t p) {
              const int32_t n0 = static_cast<int32_t>(p * PANEL);
              for (int r = 0; r < rows; ++r)
                for (int v = 0; v < V; ++v) {
                  const vf raw = acc[r][v];
                  const vi idx = lane + (n0 + L * v);
                  const vi is_nan = raw != raw;
                  const vf s = round_to_bf16 ? (is_nan ? raw : round_bf16(raw)) : raw;
                  vf& best = value[(m0 + r) * V + v];
                  vi& at = index[(m0 + r) * V + v];
                  // A NaN beats any number and nothing beats a NaN; columns past the vocabulary never win.
                  const vi best_nan = best != best;
                  const vi wins = ((s > best) | is_nan | (at < 0)) & ~best_nan & (idx < static_cast<int32_t>(vocab));
                  best = wins ? s : best;
                  at = wins ? idx : at;
                }
            });
      for (int64_t m = 0; m < m_size; ++m) {
        Best& b = bests[t * m_size + m];
        for (int v = 0; v < V; ++v)
          for (int l = 0; l < L; ++l)
            if (index[m * V + v][l] >= 0) b.offer(value[m * V + v][l], index[m * V + v][l]);
      }
    }
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < m_size; ++m) {
    Best b;
    for (int64_t t = 0; t < parts; ++t)
      if (bests[t * m_size + m].index >= 0) b.offer(bests[t * m_size + m].value, bests[t * m_size + m].index);
    o[m] = b.index;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("lm_head_logits(Tensor(a!) out, Tensor x, Tensor panels, int vocab) -> ()");
  m.def("lm_head_argmax(Tensor(a!) out, Tensor x, Tensor panels, int vocab, bool round_bf16) -> ()");
  m.impl("lm_head_logits", c10::DispatchKey::CPU, &lm_head_logits);
  m.impl("lm_head_argmax", c10::DispatchKey::CPU, &lm_head_argmax);
}

// The bf16 SGMV blocks on CPUs with AMX (Intel Sapphire Rapids and later): `tdpbf16ps` multiplies a tile of
// up to 16 x 32 bf16 by one of 32 x 16 into 16 x 16 fp32 sums, ~13x the multiply-adds per cycle of AVX-512
// fp32 FMAs here (on these Intel CPUs AVX512-BF16's `vdpbf16ps` runs at half the FMA rate: no help; on AMD's Zen 4,
// which has no AMX, it runs at the FMA rate, `sgmv_dpbf16.h`). See docs/BENCHMARKS.md.
//
// For a chunk of m <= 16 token rows of one adapter slot:
// - shrink, per block of up to 16 rank rows j: C[j][u] = sum_d a[j][d] * x[u][d]. A's rows are read in place
//   (tile rows = rank rows, 32 of their values per tile); x's chunk is transposed once into pairs,
//   xt[d / 2][u] = (x[u][d], x[u][d + 1]) (`pack_x`), shared by every module of the group;
//   v[u][j] = bf16(scale * C[j][u]).
// - expand, per 16 outputs: C[u][o] = sum_j v[u][j] * b[j][o], then y[u][o] = bf16(y[u][o] + C[u][o]), B read
//   in rank pairs per 16 outputs, the layout the adapter cache keeps beside B for this kernel
//   (`kernels.sgmv_native.rank_pairs`): moving B is what a decode step's LoRA costs, so it is not repacked
//   per step.
// Every sum runs over its reduction dimension in one fixed order whatever m is, so a token's result never
// depends on the batch around it. Shapes AMX takes (`fits`): rows a multiple of 32 values, outputs of 16,
// rank at most 16 or a multiple of 32; others, and CPUs without AMX, take the AVX paths.
// Tile state is per thread: each parallel task configures its tiles (`Tiles`) and releases them when done,
// so code that uses AMX after it (oneDNN, torch's brgemm) finds them released and configures its own.
#pragma once

#include <ATen/ATen.h>

#include "convert.h"
#include "sgmv_blocks.h"

#include <cstdint>
#include <cstring>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define LORAGATE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LORAGATE_AMX 0
#endif

namespace loragate_amx {

using bf16 = at::BFloat16;
using loragate::from_float;

// Whether AMX runs here: built for it, and Linux lets this process use tile data (asked once per process,
// ARCH_REQ_XCOMP_PERM for XTILEDATA; oneDNN asks the same).
inline bool ready() {
#if LORAGATE_AMX
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

constexpr int64_t AHEAD = 4 * 32;  // how far ahead along A's rows the shrink prefetches, in values

inline bool fits(int64_t in, int64_t outs, int64_t r) {
  return in % 32 == 0 && outs % 16 == 0 && r > 0 && (r <= 16 || r % 32 == 0);
}

using loragate_sgmv::v_row;  // the expand takes up to 32 of a row a tile

#if LORAGATE_AMX

// A compiler barrier. GCC 12's AMX intrinsics under-declare their memory operands: `_tile_loadd` declares none
// (only the address registers) and `_tile_loadconfig` 8 bytes of the 64-byte config, so stores that only a
// tile load or ldtilecfg reads (v and x's pairs written just before, the config on the stack) could be moved
// after it or dropped as dead — a config so dropped faulted in ldtilecfg (seen when a change elsewhere in
// this file moved the config's stores). So every tile load goes through `LORAGATE_TILE_LOAD` and ldtilecfg
// follows a fence: the address handed to an empty asm that clobbers memory, so every store through it is
// done first. It costs no instruction.
inline void fence(const void* p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }
#define LORAGATE_TILE_LOAD(tile, base, stride) \
  do {                                         \
    ::loragate_amx::fence(base);               \
    _tile_loadd(tile, base, stride);           \
  } while (0)

// A tile configuration (palette 1): each tile's rows and bytes a row, loaded with ldtilecfg.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int t, int64_t r, int64_t bytes) {
    rows[t] = static_cast<uint8_t>(r);
    colsb[t] = static_cast<uint16_t>(bytes);
  }
  void load() {
    fence(this);  // ldtilecfg reads all 64 bytes; GCC's intrinsic declares 8 (see `fence`)
    _tile_loadconfig(this);
  }
};
static_assert(sizeof(TileConfig) == 64);

// Every tile 16 rows of 64 bytes, configured for a parallel task's life and released after it (the AMX
// linear's blocks, `linear_amx_blocks.h`; the prompt tiles' attention, `prefill_tiles.h`).
struct UniformTiles {
  UniformTiles() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
    cfg.load();
  }
  UniformTiles(const UniformTiles&) = delete;
  UniformTiles& operator=(const UniformTiles&) = delete;
  ~UniformTiles() { _tile_release(); }
};

// The tile shapes of one (m, rank) pair, loaded when they change. Tiles: 0 shrink sums [rb x m], 1 A rows
// [rb x 32], 2 xt pairs [16 x m], 3 v [m x k], 4-5 packed B [k / 2 x 16 pairs], 6-7 expand sums [m x 16].
class Tiles {
 public:
  Tiles() = default;
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  ~Tiles() {
    if (m_ >= 0) _tile_release();
  }
  void configure(int64_t m, int64_t r) {
    const int64_t rb = r < 16 ? r : 16, k = std::min<int64_t>(v_row(r), 32);
    if (m == m_ && rb == rb_ && k == k_) return;
    TileConfig cfg;
    cfg.set(0, rb, m * 4), cfg.set(1, rb, 64), cfg.set(2, 16, m * 4), cfg.set(3, m, k * 2);
    cfg.set(4, k / 2, 64), cfg.set(5, k / 2, 64), cfg.set(6, m, 64), cfg.set(7, m, 64);
    cfg.load();
    m_ = m, rb_ = rb, k_ = k;
  }

 private:
  int64_t m_ = -1, rb_ = -1, k_ = -1;
};

// xt[(d / 32) * 256 + (d % 32 / 2) * 16 + u] = the pair (x[u][d], x[u][d + 1]) for even d < in, u < m (rows
// past m zeros): per 32 values a 16 x 16 transpose of 32-bit pairs.
inline void pack_x(uint32_t* xt, const bf16* x, int64_t ldx, int64_t m, int64_t in) {
  for (int64_t d = 0; d < in; d += 32) {
    __m512i r[16], t[16];
    for (int u = 0; u < 16; ++u) r[u] = u < m ? _mm512_loadu_si512(x + u * ldx + d) : _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane l: pair 4l + k of rows 4i..4i+3
      r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    uint32_t* out = xt + d / 32 * 256;
    for (int k = 0; k < 4; ++k) {
      const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
      const __m512i w0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
      const __m512i w1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
      _mm512_storeu_si512(out + k * 16, _mm512_shuffle_i32x4(v0, w0, 0x88));
      _mm512_storeu_si512(out + (8 + k) * 16, _mm512_shuffle_i32x4(v0, w0, 0xDD));
      _mm512_storeu_si512(out + (4 + k) * 16, _mm512_shuffle_i32x4(v1, w1, 0x88));
      _mm512_storeu_si512(out + (12 + k) * 16, _mm512_shuffle_i32x4(v1, w1, 0xDD));
    }
  }
}

// The inner iterations of `shrink` and `expand`: each calls `tick()` once per iteration, where a caller
// prefetches its next work (`prefetch_ahead.h`).
inline int64_t shrink_ticks(int64_t r, int64_t in) { return (r + 15) / 16 * (in / 32); }
inline int64_t expand_ticks(int64_t outs) { return (outs + 31) / 32; }

// store(u, j, C[j][u]) for u < m, j < r: the shrink of the chunk packed in `xt` by the rank rows of `a`
// (row j at a + j * a_row).
template <typename Store, typename Tick>
inline void shrink(Tiles& tiles, const uint32_t* xt, int64_t m, const bf16* a, int64_t a_row, int64_t r,
                   int64_t in, Store&& store, Tick&& tick) {
  tiles.configure(m, r);
  alignas(64) float c[16 * 16];
  const int64_t rb = r < 16 ? r : 16;
  for (int64_t j0 = 0; j0 < r; j0 += rb) {
    _tile_zero(0);
    for (int64_t d = 0; d < in; d += 32) {
      if (d + AHEAD < in) {  // A comes from memory in rb short strided runs: fetch each row's lines ahead
        for (int64_t j = 0; j < rb; ++j) __builtin_prefetch(a + (j0 + j) * a_row + d + AHEAD, 0, 3);
      }
      LORAGATE_TILE_LOAD(1, a + j0 * a_row + d, a_row * sizeof(bf16));
      LORAGATE_TILE_LOAD(2, xt + d / 32 * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
      tick();
    }
    _tile_stored(0, c, 64);
    for (int64_t j = 0; j < rb; ++j)
      for (int64_t u = 0; u < m; ++u) store(u, j0 + j, c[j * 16 + u]);
  }
}

inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// y[u][o..o+width) = bf16(y + sums) for u < m and width 32 (two blocks of sums, `lo` and `hi`) or 16
// (`lo`): the adds of `expand`, rounded to nearest even by the CPU's bf16 conversion (which also flushes
// bf16 subnormals, below 1.2e-38, to zero).
inline void add_sums(bf16* y, int64_t ldy, const float* lo, const float* hi, int64_t m, bool both) {
  for (int64_t u = 0; u < m; ++u) {
    bf16* out = y + u * ldy;
    if (both) {
      const __m512i old = _mm512_loadu_si512(out);
      const __m512 a = _mm512_add_ps(widen(_mm512_castsi512_si256(old)), _mm512_load_ps(lo + u * 16));
      const __m512 b = _mm512_add_ps(widen(_mm512_extracti64x4_epi64(old, 1)), _mm512_load_ps(hi + u * 16));
      const __m512bh sum = _mm512_cvtne2ps_pbh(b, a);
      _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(sum));
    } else {
      const __m256i old = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out));
      const __m256bh sum = _mm512_cvtneps_pbh(_mm512_add_ps(widen(old), _mm512_load_ps(lo + u * 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<const __m256i&>(sum));
    }
  }
}

// y[u][o] = bf16(y[u][o] + sum_j v[u * ldv + j] * b[j][o]) for u < m, o < outs; v's rows hold v_row(r)
// values (a zero past an odd rank). B in rank pairs: bp[(o / 16 * pair_stride + p) * 32 + o % 16 * 2 + e] =
// b[2p + e][o] (zero past the rank). Per 32 outputs two tiles of sums share each load of v; the adds to y of
// one 32 run while the tiles compute the next (two buffers), so neither waits on the other.
template <typename Tick>
inline void expand(Tiles& tiles, bf16* y, int64_t ldy, const uint16_t* v, int64_t ldv, int64_t m,
                   const bf16* bp, int64_t pair_stride, int64_t r, int64_t outs, Tick&& tick) {
  tiles.configure(m, r);
  const int64_t k = std::min<int64_t>(v_row(r), 32), block = pair_stride * 32;
  alignas(64) float c[2][2][16 * 16];  // [buffer][block of 16 outputs]
  int64_t pending = -1;                // the 32 outputs whose sums wait in c[pending / 32 % 2]
  const bool one_v = v_row(r) <= k;    // all of v in one tile (rank <= 32): loaded once for every output
  if (one_v) LORAGATE_TILE_LOAD(3, v, ldv * 2);
  for (int64_t o0 = 0;; o0 += 32) {
    if (o0 < outs) {
      const bool two = o0 + 16 < outs;
      const bf16* b0 = bp + o0 / 16 * block;
      float* buf = c[o0 / 32 % 2][0];
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t j = 0; j < v_row(r); j += k) {
        if (!one_v) LORAGATE_TILE_LOAD(3, v + j, ldv * 2);
        LORAGATE_TILE_LOAD(4, b0 + j * 16, 64);
        _tile_dpbf16ps(6, 3, 4);
        if (two) {
          LORAGATE_TILE_LOAD(5, b0 + block + j * 16, 64);
          _tile_dpbf16ps(7, 3, 5);
        }
      }
      _tile_stored(6, buf, 64);
      if (two) _tile_stored(7, buf + 256, 64);
      tick();
    }
    if (pending >= 0) {
      const float* buf = c[pending / 32 % 2][0];
      add_sums(y + pending, ldy, buf, buf + 256, m, pending + 16 < outs);
    }
    if (o0 >= outs) break;
    pending = o0;
  }
}

#endif  // LORAGATE_AMX

}  // namespace loragate_amx

// Prefill attention for a prompt's rows on AMX tiles (bf16, head size 32, 64 or 128): one task is up to
// TASK_TILES tiles of 16 consecutive query rows of one sequence for one KV head, over its keys 0..n.
//
// The task packs its keys once into the tiles' pair layout, kt[j / 16][d / 32][d % 32 / 2][j % 16] =
// (k[j][d], k[j][d + 1]), and its values in key pairs, vp[j / 32][d / 16][j % 32 / 2][d % 16] =
// (v[j][d], v[j + 1][d]), zero past n (a block's unwritten rows never reach a sum). Then for each 16-row
// tile and each query head of the KV head's group:
// - scores S[i][j] = q[i] . k[j], 16 keys a tile of sums (fp32);
// - each row's softmax over its own keys 0..pos: p = bf16(exp(scale S - max)) (zero past pos), and the sum
//   of those rounded p, so the weights the tiles multiply are the ones divided by;
// - o[i] = bf16(sum_j p[i][j] v[j] / sum), 32 keys a multiply, in key order from key 0.
// Every sum a row enters runs over its own keys in a fixed order from key 0, its keys past pos are exact
// zeros, and AMX rows do not mix: a row's bits depend on its query, its keys and its position only, not on
// the tile, chunk or batch around it (tested). They are not the vector kernel's bits (`paged_decode`: fp32
// weights, an FMA chain); which rows come here is the op's rule (`prefill_tiles_cpu.cpp`).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "sgmv_amx.h"

namespace loragate_prefill_tiles {

using bf16 = at::BFloat16;
constexpr int64_t TASK_TILES = 8;  // query tiles of 16 rows a task, at most (long prompts share out)

// One task: the rows at positions [pos, end) of one sequence (q rows from `row`), one KV head.
struct Task {
  int64_t seq, kv_head, pos, end, row;
  int64_t cost() const { return (end - pos) * end; }
};

// The call's shapes and pointers.
struct Call {
  bf16* out;
  const bf16* q;
  const bf16* k_cache;
  const bf16* v_cache;
  const int64_t* tables;
  int64_t ldq, ldo, width, block_size, kv_heads, group;
  float scale;
};

#if LORAGATE_AMX

// A thread's buffers, grown as its tasks need.
struct Scratch {
  std::vector<uint32_t> kt, vp;  // packed keys, values (bf16 pairs)
  std::vector<float> s;          // scores [16][ls]
  std::vector<uint16_t> p;       // weights [16][lp] (bf16 bits)
  alignas(64) float o[16 * 64];  // a 64-value slice of the outputs' sums
  alignas(64) uint16_t qpad[16 * 128];
  float sum[16];
};

// Tiles 0-3 sums, 4-7 queries (scores) or 4 weights and 5-6 values: `loragate_amx::UniformTiles`.

// rows[0..16) = the columns of rows[0..16), 32-bit values: a 16 x 16 transpose in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved, per 128-bit lane
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + m], lane L: rows i..i + 3 of column 4 L + m
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // column 4 L + m gathers lane L of r[m], r[4 + m], r[8 + m], r[12 + m]
    const __m512i s0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), s1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_i32x4(s0, s2, 0x88), t[4 + m] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    t[8 + m] = _mm512_shuffle_i32x4(s1, s3, 0x88), t[12 + m] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

template <int DIM>
void pack(const Call& c, const Task& t, int64_t n, Scratch& w) {
  const int64_t nk16 = (n + 15) / 16, nk32 = (n + 31) / 32, token = c.kv_heads * DIM;
  const int64_t* table = c.tables + t.seq * c.width;
  w.kt.resize(nk16 * (DIM / 32) * 256);
  w.vp.resize(nk32 * (DIM / 16) * 256);
  auto key_row = [&](const bf16* cache, int64_t j) {
    return cache + (table[j / c.block_size] * c.block_size + j % c.block_size) * token + t.kv_head * DIM;
  };
  // Keys: per 16 and per 32 values, the 16 keys' 16 pairs transposed into the tile's rows of pairs.
  for (int64_t kb = 0; kb < nk16; ++kb) {
    const bf16* rows[16];
    for (int64_t j = 0; j < 16; ++j) rows[j] = kb * 16 + j < n ? key_row(c.k_cache, kb * 16 + j) : nullptr;
    for (int64_t ch = 0; ch < DIM / 32; ++ch) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = rows[j] != nullptr ? _mm512_loadu_si512(rows[j] + ch * 32) : _mm512_setzero_si512();
      transpose16(r);
      uint32_t* dst = w.kt.data() + (kb * (DIM / 32) + ch) * 256;
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
    }
  }
  // Values: each pair of keys' 16 values at a time interleaved into a tile row (zero past n).
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  alignas(64) uint16_t lo[32], hi[32];
  for (int i = 0; i < 32; ++i) lo[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + i / 2), hi[i] = lo[i] + 16;
  const __m512i take_lo = _mm512_load_si512(lo), take_hi = _mm512_load_si512(hi);
  uint32_t* vp = w.vp.data();
  for (int64_t j = 0; j < nk32 * 32; j += 2) {
    const bf16* a = j < n ? key_row(c.v_cache, j) : nullptr;
    const bf16* b = j + 1 < n ? key_row(c.v_cache, j + 1) : nullptr;
    uint32_t* dst = vp + (j / 32 * (DIM / 16) * 16 + j % 32 / 2) * 16;
    for (int64_t z = 0; z < DIM / 32; ++z) {  // 32 values of each key: chunks 2 z and 2 z + 1
      even = a != nullptr ? _mm512_loadu_si512(a + z * 32) : _mm512_setzero_si512();
      odd = b != nullptr ? _mm512_loadu_si512(b + z * 32) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * z * 256, _mm512_permutex2var_epi16(even, take_lo, odd));
      _mm512_storeu_si512(dst + (2 * z + 1) * 256, _mm512_permutex2var_epi16(even, take_hi, odd));
    }
  }
}

// exp(x) for x <= 0 (scores less their row's largest) to ~1e-6 relative, plenty for bf16 weights: 2^(x
// log2 e) as 2^k 2^f, f in [-0.5, 0.5] by its degree-6 Taylor polynomial; NaN stays NaN.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(-87.f), x), _mm512_set1_ps(1.44269504f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// Scores of the tile's m rows (q rows from `q`, stride ldq values) against keys [0, 16 nk16) into w.s.
template <int DIM>
void scores(const bf16* q, int64_t ldq, int64_t nk16, int64_t ls, Scratch& w) {
  LORAGATE_TILE_LOAD(4, q, ldq * 2);
  if constexpr (DIM >= 64) LORAGATE_TILE_LOAD(5, q + 32, ldq * 2);
  if constexpr (DIM == 128) {
    LORAGATE_TILE_LOAD(6, q + 64, ldq * 2);
    LORAGATE_TILE_LOAD(7, q + 96, ldq * 2);
  }
  // One 16-key block's scores into sums tile c (a literal), the key tiles through 1 and 3.
#define LORAGATE_SCORE_BLOCK(c, k, s)         \
  do {                                        \
    _tile_zero(c);                            \
    LORAGATE_TILE_LOAD(1, k, 64);             \
    _tile_dpbf16ps(c, 4, 1);                  \
    if constexpr (DIM >= 64) {                \
      LORAGATE_TILE_LOAD(3, (k) + 256, 64);   \
      _tile_dpbf16ps(c, 5, 3);                \
    }                                         \
    if constexpr (DIM == 128) {               \
      LORAGATE_TILE_LOAD(1, (k) + 512, 64);   \
      _tile_dpbf16ps(c, 6, 1);                \
      LORAGATE_TILE_LOAD(3, (k) + 768, 64);   \
      _tile_dpbf16ps(c, 7, 3);                \
    }                                         \
    _tile_stored(c, s, ls * 4);               \
  } while (0)
  for (int64_t kb = 0; kb < nk16; ++kb) {  // alternate sums tiles: a block's store beside the next's multiplies
    const uint32_t* k = w.kt.data() + kb * (DIM / 32) * 256;
    float* s = w.s.data() + kb * 16;
    if (kb % 2 == 0) {
      LORAGATE_SCORE_BLOCK(0, k, s);
    } else {
      LORAGATE_SCORE_BLOCK(2, k, s);
    }
  }
#undef LORAGATE_SCORE_BLOCK
  loragate_amx::fence(w.s.data());  // the stores before any read of the scores
}

// Row i's weights over keys [0, 32 nk32) (zero past `keys`) into w.p, and their sum.
inline void softmax_row(Scratch& w, int64_t i, int64_t keys, int64_t nk32, int64_t ls, int64_t lp, float scale) {
  const float* s = w.s.data() + i * ls;
  uint16_t* p = w.p.data() + i * lp;
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto mask = [&](int64_t j) -> __mmask16 {
    return j + 16 <= keys ? 0xFFFF : j >= keys ? 0 : static_cast<__mmask16>((1u << (keys - j)) - 1);
  };
  for (int64_t j = 0; j < keys; j += 16)
    mx = _mm512_mask_max_ps(mx, mask(j), mx, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask(j), s + j), sc));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk32 * 32; j += 16) {
    const __mmask16 k = mask(j);
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), sc), m);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_nonpositive(x));
    const __m256bh b = _mm512_cvtneps_pbh(e);
    const __m256i bits = reinterpret_cast<const __m256i&>(b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), bits);
    total = _mm512_add_ps(total, loragate_amx::widen(bits));
  }
  w.sum[i] = _mm512_reduce_add_ps(total);
}

// o[i][h * 64 .. + 64) (DIM 32: + 32) = sum_j p[i][j] v[j] over 32 nk32 keys, for the tile's 16 rows,
// into w.o.
template <int DIM>
void weigh(int64_t h, int64_t nk32, int64_t lp, Scratch& w) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (DIM >= 64) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint32_t* vp = w.vp.data();
  for (int64_t vb = 0; vb < nk32; ++vb) {
    LORAGATE_TILE_LOAD(4, w.p.data() + vb * 32, lp * 2);
    const uint32_t* v = vp + (vb * (DIM / 16) + 4 * h) * 256;
    LORAGATE_TILE_LOAD(5, v, 64);
    _tile_dpbf16ps(0, 4, 5);
    LORAGATE_TILE_LOAD(6, v + 256, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (DIM >= 64) {
      LORAGATE_TILE_LOAD(5, v + 512, 64);
      _tile_dpbf16ps(2, 4, 5);
      LORAGATE_TILE_LOAD(6, v + 768, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, w.o, 256);
  _tile_stored(1, w.o + 16, 256);
  if constexpr (DIM >= 64) {
    _tile_stored(2, w.o + 32, 256);
    _tile_stored(3, w.o + 48, 256);
  }
  loragate_amx::fence(w.o);
}

// The task's rows, every query head of its KV head.
template <int DIM>
void run_task(const Call& c, const Task& t, Scratch& w) {
  const int64_t n = t.end;  // the last row's keys: positions 0..end-1
  pack<DIM>(c, t, n, w);
  const int64_t ls = (n + 15) / 16 * 16, lp = (n + 31) / 32 * 32;
  w.s.resize(16 * ls);
  w.p.resize(16 * lp);
  for (int64_t pos = t.pos; pos < t.end; pos += 16) {
    const int64_t m = std::min<int64_t>(16, t.end - pos), keys_max = pos + m;
    const int64_t nk16 = (keys_max + 15) / 16, nk32 = (keys_max + 31) / 32;
    const int64_t row = t.row + (pos - t.pos);
    if (m < 16) std::memset(w.p.data() + m * lp, 0, (16 - m) * lp * 2);  // rows past the tile's: no weight
    for (int64_t g = 0; g < c.group; ++g) {
      const int64_t head = t.kv_head * c.group + g;
      const bf16* q = c.q + row * c.ldq + head * DIM;
      int64_t ldq = c.ldq;
      if (m < 16) {  // a short tile from a zero-padded copy (a tile load reads 16 rows)
        std::memset(w.qpad, 0, sizeof(w.qpad));
        for (int64_t i = 0; i < m; ++i) std::memcpy(w.qpad + i * DIM, q + i * c.ldq, DIM * 2);
        q = reinterpret_cast<const bf16*>(w.qpad), ldq = DIM;
      }
      scores<DIM>(q, ldq, nk16, ls, w);
      for (int64_t i = 0; i < m; ++i) softmax_row(w, i, pos + i + 1, nk32, ls, lp, c.scale);
      for (int64_t h = 0; h < (DIM + 63) / 64; ++h) {
        weigh<DIM>(h, nk32, lp, w);
        for (int64_t i = 0; i < m; ++i) {
          const __m512 inv = _mm512_set1_ps(1.f / w.sum[i]);
          bf16* o = c.out + (row + i) * c.ldo + head * DIM + h * 64;
          for (int64_t d = 0; d < std::min(DIM, 64); d += 16) {
            const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(w.o + i * 64 + d), inv));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), reinterpret_cast<const __m256i&>(b));
          }
        }
      }
    }
  }
}

// Tasks [first, last) on this thread.
inline void run_tasks(const Call& c, const std::vector<Task>& tasks, int64_t first, int64_t last, int64_t dim) {
  if (first >= last) return;
  loragate_amx::UniformTiles tiles;
  Scratch w;
  for (int64_t i = first; i < last; ++i) {
    switch (dim) {
      case 32: run_task<32>(c, tasks[i], w); break;
      case 64: run_task<64>(c, tasks[i], w); break;
      default: run_task<128>(c, tasks[i], w);
    }
  }
}

#endif  // LORAGATE_AMX

}  // namespace loragate_prefill_tiles

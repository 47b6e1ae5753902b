// The small per-layer ops of the CPU forward, fused: each is one pass over the step's rows instead of the 5-8
// torch ops (and their temporaries) it replaces; and the greedy pick of a step's tokens (argmax_rows). Rows are
// split over torch's thread pool. Each matches the Hugging Face Llama computation in its rounding points:
// RMSNorm in fp32, the normalized row rounded to the storage dtype before the weight multiplies it; rotate-half
// RoPE with the fp32 tables rounded to the storage dtype; SiLU rounded before it multiplies `up`. SiLU's exp is
// the one torch's own CPU kernel calls (SLEEF's 1-ULP vector exp, exported by libtorch) where this CPU has the
// vector width torch uses (AVX-512 or AVX2), so fp32 SiLU is bit-identical to torch's. Built without floating-
// point contraction: a fused multiply-add would round differently from torch's separate multiply and add, and
// the fp32 engine must match transformers token for token.
#pragma GCC optimize("fp-contract=off")
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "vecmath.h"

namespace {

template <typename T>
inline T round_to(float v) {
  return loragate::from_float<T>(v);
}
using loragate::round_float;

#if defined(__AVX512F__)
// 16 bf16 values widened to fp32 (exact); v rounded to bf16 as `round_float` rounds (the same bits, vectorized);
// and a rounded v's 16 bf16 values stored.
inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store_bf16(at::BFloat16* p, __m512 rounded) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

// `rms_norm_rows`' row for bf16 rows of a multiple of 16 values, in registers: the same roundings (the sum of
// squares in 16 lanes, then reduced). The compiler's own vectors for it were half as wide and rounded each value
// to bf16 with integer tricks twice as long.
inline void rms_norm_row_bf16(at::BFloat16* o, at::BFloat16* x, const at::BFloat16* d, const at::BFloat16* w,
                              int64_t n, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = load_bf16(x + i);
    if (d != nullptr) {
      v = round_bf16(_mm512_add_ps(v, load_bf16(d + i)));
      store_bf16(x + i, v);
    }
    sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(x + i), inv));
    store_bf16(o + i, round_bf16(_mm512_mul_ps(load_bf16(w + i), normed)));
  }
}
#endif

// out[t] = w * (h[t] * rsqrt(mean(h[t]^2) + eps)), after h[t] += delta[t] when `delta` is given.
template <typename T>
void rms_norm_rows(T* out, T* h, const T* delta, const T* w, int64_t rows, int64_t n, int64_t ldo, int64_t ldh,
                   int64_t ldd, double eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* x = h + t * ldh;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (n % 16 == 0) {
          rms_norm_row_bf16(out + t * ldo, x, delta != nullptr ? delta + t * ldd : nullptr, w, n,
                            static_cast<float>(eps));
          continue;
        }
      }
#endif
      if (delta != nullptr) {
        const T* d = delta + t * ldd;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] = round_to<T>(static_cast<float>(x[i]) + static_cast<float>(d[i]));
      }
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < n; ++i) sq += static_cast<float>(x[i]) * static_cast<float>(x[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + static_cast<float>(eps));
      T* o = out + t * ldo;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const T normed = round_to<T>(static_cast<float>(x[i]) * inv);
        o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

void rms_norm(at::Tensor out, at::Tensor h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
              double eps) {
  TORCH_CHECK(h.dim() == 2 && out.dim() == 2 && h.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous(),
              "rms_norm: 2-D rows with unit stride");
  TORCH_CHECK(h.scalar_type() == out.scalar_type() && h.scalar_type() == weight.scalar_type(),
              "rms_norm: one dtype");
  const bool add = delta.has_value();
  if (add) TORCH_CHECK(delta->stride(1) == 1 && delta->scalar_type() == h.scalar_type(), "rms_norm: delta rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(),
                            add ? delta->data_ptr<scalar_t>() : nullptr, weight.data_ptr<scalar_t>(), h.size(0),
                            h.size(1), out.stride(0), h.stride(0), add ? delta->stride(0) : 0, eps);
  });
}

// x[head] = x * cos[pos] + rotate_half(x) * sin[pos], in place, for the `heads` heads of one row. The row and
// the position's tables are widened to fp32 once (a bf16 value is a shift of its bits) and every rounding to T
// is done on floats, so the loop vectorizes for every storage dtype. `cf`, `sf`, `xf`, `of`: dim floats each.
#if defined(__AVX512F__)
// `rope_row` on bf16 rows whose half head is a multiple of 16, in registers: the same operations and roundings
// on the same values (so the same bits). Through fp32 copies in memory it ran at ~7 ns a value: each copy's
// stores stalled the loads that read it back at the other half's offset.
inline void rope_row_bf16(at::BFloat16* x, const at::BFloat16* cos, const at::BFloat16* sin, int64_t position,
                          int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  const at::BFloat16* c = cos + position * dim;
  const at::BFloat16* s = sin + position * dim;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t hd = 0; hd < heads; ++hd) {
    at::BFloat16* v = x + hd * dim;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 a = load_bf16(v + i), b = load_bf16(v + half + i);
      const __m512 c0 = load_bf16(c + i), c1 = load_bf16(c + half + i);
      const __m512 s0 = load_bf16(s + i), s1 = load_bf16(s + half + i);
      const __m512 first = round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(a, c0)),
                                                    round_bf16(_mm512_mul_ps(_mm512_xor_ps(sign, b), s0))));
      const __m512 second =
          round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(b, c1)), round_bf16(_mm512_mul_ps(a, s1))));
      store_bf16(v + i, first);
      store_bf16(v + half + i, second);
    }
  }
}
#endif

template <typename T>
void rope_row(T* x, const T* cos, const T* sin, int64_t position, int64_t heads, int64_t dim, float* cf, float* sf,
              float* xf, float* of) {
  const int64_t half = dim / 2;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (half % 16 == 0) return rope_row_bf16(x, cos, sin, position, heads, dim);
  }
#endif
  loragate::to_float(cf, cos + position * dim, dim);
  loragate::to_float(sf, sin + position * dim, dim);
  const float *c = cf, *s = sf;
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* v = x + hd * dim;
    const float* a;
    float* o;
    if constexpr (std::is_same_v<T, float>) {  // in place: each i reads and writes only i and i + half
      a = v;
      o = v;
    } else {
      loragate::to_float(xf, v, dim);
      a = xf;
      o = of;
    }
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      // torch rounds each product and the sum to T: x * cos + rotated * sin
      const float first = round_float<T>(round_float<T>(a[i] * c[i]) + round_float<T>(-a[i + half] * s[i]));
      const float second =
          round_float<T>(round_float<T>(a[i + half] * c[i + half]) + round_float<T>(a[i] * s[i + half]));
      o[i] = first;
      o[i + half] = second;
    }
    if constexpr (!std::is_same_v<T, float>) {
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) v[i] = round_to<T>(o[i]);  // exact: o[i] is a T already
    }
  }
}

// `rope_row` over the first `heads` heads of each row (row stride ldx).
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, const int64_t* positions, int64_t rows, int64_t heads,
               int64_t dim, int64_t ldx) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * dim);
    float* b = buf.data();
    for (int64_t t = begin; t < end; ++t)
      rope_row(x + t * ldx, cos, sin, positions[t], heads, dim, b, b + dim, b + 2 * dim, b + 3 * dim);
  });
}

void rope(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions, int64_t heads,
          int64_t dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * dim, "rope: x must be [T, >= heads * dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong,
              "rope: contiguous tables and int64 positions");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        positions.data_ptr<int64_t>(), x.size(0), heads, dim, x.stride(0));
  });
}

// A step's fused qkv rows [T, (H + 2 KVH) * D] after their adapters: RoPE on the q and k heads in place
// (`rope_row`), then each row's k and v heads copied to its cache slot (k_cache.view(-1, KVH * D)[slots[t]]):
// `rope` then `write_kv`, the same bits, in one pass over the rows instead of two calls.
template <typename T>
void rope_write_rows(T* qkv, T* kc, T* vc, const T* cos, const T* sin, const int64_t* positions,
                     const int64_t* slots, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t dim,
                     int64_t ld) {
  const int64_t width = kv_heads * dim, k_at = q_heads * dim, v_at = k_at + width;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * dim);
    float* b = buf.data();
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * ld;
      rope_row(row, cos, sin, positions[t], q_heads + kv_heads, dim, b, b + dim, b + 2 * dim, b + 3 * dim);
      std::memcpy(kc + slots[t] * width, row + k_at, width * sizeof(T));
      std::memcpy(vc + slots[t] * width, row + v_at, width * sizeof(T));
    }
  });
}

void rope_write_kv(at::Tensor qkv, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& slots, int64_t q_heads,
                   int64_t kv_heads, int64_t dim) {
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (q_heads + 2 * kv_heads) * dim,
              "rope_write_kv: qkv must be [T, >= (H + 2 KVH) * D] with unit-stride rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == kv_heads && k_cache.size(3) == dim,
              "rope_write_kv: the caches must be contiguous [NB, BS, KVH, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type() && k_cache.scalar_type() == qkv.scalar_type(),
              "rope_write_kv: contiguous tables, one dtype throughout");
  for (const at::Tensor* ix : {&positions, &slots})
    TORCH_CHECK(ix->scalar_type() == at::kLong && ix->is_contiguous() && ix->dim() == 1 && ix->size(0) == rows,
                "rope_write_kv: int64 positions and slots, one per row");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1), max_position = cos.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "rope_write_kv: slot ", sp[t], " outside the cache");
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_position, "rope_write_kv: position ", pp[t], " outside the tables");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_rows<scalar_t>(qkv.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), pp, sp, rows, q_heads, kv_heads,
                              dim, qkv.stride(0));
  });
}

// out[t] = silu(gate_up[t, :n]) * gate_up[t, n:]
template <typename T>
void silu_mul_rows(T* out, const T* gu, int64_t rows, int64_t n, int64_t ldo, int64_t ldg) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> gf(n), act(n);
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gu + t * ldg;
      const T* u = g + n;
      T* o = out + t * ldo;
      loragate::to_float(gf.data(), g, n);
      loragate::silu_floats(act.data(), gf.data(), n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = static_cast<float>(round_to<T>(act[i]));
        o[i] = round_to<T>(a * static_cast<float>(u[i]));
      }
    }
  });
}

void silu_mul(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(out.dim() == 2 && gate_up.dim() == 2 && out.stride(1) == 1 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) == 2 * out.size(1),
              "silu_mul: out [T, n], gate_up [T, 2n], unit-stride rows");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "silu_mul: one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), out.size(0), out.size(1),
                            out.stride(0), gate_up.stride(0));
  });
}

// out[t] = the index of row t's largest value, the first one on ties, the first NaN where a row has one:
// torch.argmax's answer, in one pass a row. A row is read in chunks widened to fp32 (exact for bf16/fp16);
// a chunk's max and whether it holds a NaN come from one vectorized sweep, and only a chunk that beats the
// best so far (strictly: an equal max later is not the first) is searched again, in L1, for where its max is.
template <typename T>
void argmax_rows_impl(int64_t* out, const T* logits, int64_t rows, int64_t n, int64_t ld) {
  constexpr int64_t kChunk = 1024;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kChunk];
    for (int64_t t = begin; t < end; ++t) {
      const T* row = logits + t * ld;
      float best = -std::numeric_limits<float>::infinity();
      int64_t at = 0;
      for (int64_t c = 0; c < n; c += kChunk) {
        const int64_t len = std::min(kChunk, n - c);
        loragate::to_float(buf, row + c, len);
        float m = -std::numeric_limits<float>::infinity();
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < len; ++i) {
          m = buf[i] > m ? buf[i] : m;
          nan |= buf[i] != buf[i];
        }
        if (nan) {  // torch counts NaN above every number: the row's first NaN is its argmax
          int64_t i = 0;
          while (buf[i] == buf[i]) ++i;
          at = c + i;
          break;
        }
        if (m > best) {
          int64_t i = 0;
          while (buf[i] != m) ++i;
          best = m;
          at = c + i;
        }
      }
      out[t] = at;
    }
  });
}

void argmax_rows(at::Tensor out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits [N, V > 0] with unit-stride rows");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == logits.size(0) && out.scalar_type() == at::kLong &&
                  out.is_contiguous(),
              "argmax_rows: out [N] int64");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    argmax_rows_impl<scalar_t>(out.data_ptr<int64_t>(), logits.data_ptr<scalar_t>(), logits.size(0),
                               logits.size(1), logits.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor(b!) h, Tensor? delta, Tensor weight, float eps) -> ()");
  m.def("rope(Tensor(a!) x, Tensor cos, Tensor sin, Tensor positions, int heads, int dim) -> ()");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor slots, int q_heads, int kv_heads, int dim) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("rope", c10::DispatchKey::CPU, &rope);
  m.impl("rope_write_kv", c10::DispatchKey::CPU, &rope_write_kv);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}

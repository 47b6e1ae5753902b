// Vector math on fp32 runs with the exp torch's own CPU kernels call (SLEEF's 1-ULP vector exp, exported by
// libtorch) where this CPU has the vector width torch dispatches to (AVX-512 or AVX2); std::exp elsewhere
// and for the tails, as torch's scalar loops do. Shared by the native CPU kernels.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
extern "C" {
__m512 Sleef_expf16_u10(__m512);
__m256 Sleef_expf8_u10(__m256);
}
#endif

namespace loragate {

// act[i] = g[i] / (1 + exp(-g[i])), as torch's vectorized SiLU computes it (scalar tail: std::exp, as its).
inline void silu_floats(float* act, const float* g, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(sign, x));
    _mm512_storeu_ps(act + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(sign, x));
    _mm256_storeu_ps(act + i, _mm256_div_ps(x, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) act[i] = g[i] / (1.f + std::exp(-g[i]));
}

// x[i] = exp(x[i] - m)
inline void exp_shifted(float* x, int64_t n, float m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
#elif defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i] - m);
}

}  // namespace loragate

// Conversions between the storage dtypes (fp32, bf16, fp16) and fp32, written so that the compiler
// vectorizes them (shared by every native CPU kernel).
#pragma once

#include <ATen/ATen.h>

#include <bit>
#include <cstdint>
#include <cstring>

namespace loragate {

// float -> T. For bf16, round to nearest even on the bits (what c10 does for every non-NaN value), written
// so that the compiler vectorizes it: c10's conversion tests for NaN first and stays scalar.
template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);
}
template <>
inline at::BFloat16 from_float<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return at::BFloat16(static_cast<uint16_t>(bits >> 16), at::BFloat16::from_bits());
}

// v rounded to T and back: the value T stores, computed on floats (vectorizes for bf16; NaN aside, as above).
template <typename T>
inline float round_float(float v) {
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float round_float<float>(float v) {
  return v;
}
template <>
inline float round_float<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

template <typename T>
inline void to_float(float* dst, const T* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
// bf16 -> fp32 is a shift of the bits: spelled out so that it vectorizes. The floats are written as floats
// (bit_cast), never through a uint32_t pointer: a caller that reads them back inlined would otherwise be free
// to read them before the writes (strict aliasing) — it did, in argmax_rows.
template <>
inline void to_float<at::BFloat16>(float* dst, const at::BFloat16* src, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
}

}  // namespace loragate

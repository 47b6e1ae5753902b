// Multi-LoRA SGMV for CPUs: each call applies every segment's adapter to its tokens in one pass.
//
// A segment is (first token, end token, slot). Work is split over tokens with torch's thread pool; a
// thread's tokens are contiguous, so one adapter's weights (a few tens of KB) stay in its cache while
// they are reused. Tokens are taken TILE at a time, and each weight row is read once per tile.
// Accumulation is fp32 whatever the storage dtype.
// (A short tile's partial sums for rows past its end are computed on zeros and never stored.)
//
// shrink: y[t, j] += scale[slot] * sum_d x[t, d] * a[slot, j, d]          for j < rank[slot]
// expand: y[t, o] += sum_j v[t, j] * b[slot, o, j]                         for j < rank[slot]
// `b` may be stored [S, O, R] (rows contiguous: a dot per output) or as the transposed view of a
// [S, R, O] buffer (outputs contiguous: an axpy per rank, the fast layout the CPU engine keeps).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sgmv_common.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace loragate_sgmv;

struct Work {
  int64_t token, slot, tile;  // the tile's first token and length, all in one segment
};

std::vector<Work> tiles(const at::Tensor& segments, const int64_t* ranks) {
  std::vector<Work> out;
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = seg[3 * i], end = seg[3 * i + 1], slot = seg[3 * i + 2];
    if (slot < 0 || ranks[slot] == 0) continue;
    for (int64_t t = start; t < end; t += TILE) out.push_back({t, slot, std::min(TILE, end - t)});
  }
  return out;
}

template <typename T>
void shrink(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& segments,
            const int64_t* ranks, const float* scales) {
  const int64_t in = x.size(1), max_rank = w.size(1);
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const std::vector<Work> work = tiles(segments, ranks);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(std::is_same_v<T, float> ? 0 : TILE * in);  // 16-bit rows, converted once
    for (int64_t i = begin; i < end; ++i) {
      const Work& k = work[i];
      const T* xt = xp + k.token * ldx;
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t u = 0; u < k.tile; ++u) to_float(xs.data() + u * in, xt + u * ldx, in);
      }
      T* yt = yp + k.token * ldy;
      const float scale = scales[k.slot];
      auto add = [&](int64_t u, int64_t j, float s) {
        T* out = yt + u * ldy + j;
        *out = from_float<T>(static_cast<float>(*out) + scale * s);
      };
      const T* a = wp + k.slot * max_rank * in;
      if constexpr (std::is_same_v<T, float>) {
        shrink_rows(a, in, ranks[k.slot], xt, ldx, k.tile, in, add);
      } else {
        shrink_rows(a, in, ranks[k.slot], xs.data(), in, k.tile, in, add);
      }
    }
  });
}

template <typename T>
void expand(at::Tensor& y, const at::Tensor& v, const at::Tensor& b, const at::Tensor& segments,
            const int64_t* ranks) {
  const int64_t outs = b.size(1), ldv = v.stride(0), ldy = y.stride(0);
  const int64_t slot_stride = b.stride(0), o_stride = b.stride(1), r_stride = b.stride(2);
  const bool axpy = o_stride == 1;  // [S, R, O] storage seen through its transpose
  const T* vp = v.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const std::vector<Work> work = tiles(segments, ranks);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vs(TILE * b.size(2));
    // 16-bit B in the axpy layout: the slot's [R, O] converted to fp32 once per run of its tiles.
    std::vector<float> bf(std::is_same_v<T, float> || !axpy ? 0 : b.size(2) * outs);
    int64_t converted = -1;
    for (int64_t i = begin; i < end; ++i) {
      const Work& k = work[i];
      const int64_t r = ranks[k.slot];
      std::fill(vs.begin(), vs.begin() + TILE * r, 0.f);  // a short tile's missing rows add zeros
      for (int64_t u = 0; u < k.tile; ++u) to_float(vs.data() + u * r, vp + (k.token + u) * ldv, r);
      T* yt = yp + k.token * ldy;
      const T* base = bp + k.slot * slot_stride;
      if (axpy && !bf.empty()) {
        if (converted != k.slot) {
          for (int64_t j = 0; j < r; ++j) to_float(bf.data() + j * outs, base + j * r_stride, outs);
          converted = k.slot;
        }
        expand_axpy(yt, ldy, vs.data(), k.tile, r, bf.data(), outs, outs);
      } else if (axpy) {
        expand_axpy(yt, ldy, vs.data(), k.tile, r, base, r_stride, outs);
      } else {
        expand_dots(yt, ldy, vs.data(), k.tile, r, base, o_stride, r_stride, outs);
      }
    }
  });
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& segments, const at::Tensor& ranks) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1,
              "sgmv: y and x must be 2-D with contiguous rows");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "sgmv: y and x must share a dtype");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && segments.dim() == 2 &&
                  segments.size(1) == 3,
              "sgmv: segments must be contiguous int64 [N, 3]");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous(), "sgmv: ranks must be contiguous int64");
}

void sgmv_shrink(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& segments,
                 const at::Tensor& ranks, const at::Tensor& scales) {
  check(y, x, segments, ranks);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "sgmv_shrink: w must be contiguous, x's dtype");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "sgmv_shrink: scales must be float32");
  const int64_t* r = ranks.data_ptr<int64_t>();
  const float* s = scales.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: shrink<float>(y, x, w, segments, r, s); break;
    case at::kBFloat16: shrink<at::BFloat16>(y, x, w, segments, r, s); break;
    case at::kHalf: shrink<at::Half>(y, x, w, segments, r, s); break;
    default: TORCH_CHECK(false, "sgmv_shrink: unsupported dtype ", x.scalar_type());
  }
}

void sgmv_expand(at::Tensor y, const at::Tensor& v, const at::Tensor& b, const at::Tensor& segments,
                 const at::Tensor& ranks) {
  check(y, v, segments, ranks);
  TORCH_CHECK(b.dim() == 3 && b.scalar_type() == v.scalar_type(), "sgmv_expand: b must be [S, O, R], v's dtype");
  TORCH_CHECK(b.size(1) == y.size(1), "sgmv_expand: y must be as wide as b's outputs");
  const int64_t* r = ranks.data_ptr<int64_t>();
  switch (v.scalar_type()) {
    case at::kFloat: expand<float>(y, v, b, segments, r); break;
    case at::kBFloat16: expand<at::BFloat16>(y, v, b, segments, r); break;
    case at::kHalf: expand<at::Half>(y, v, b, segments, r); break;
    default: TORCH_CHECK(false, "sgmv_expand: unsupported dtype ", v.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("sgmv_shrink(Tensor(a!) y, Tensor x, Tensor w, Tensor segments, Tensor ranks, Tensor scales) -> ()");
  m.def("sgmv_expand(Tensor(a!) y, Tensor v, Tensor b, Tensor segments, Tensor ranks) -> ()");
  m.impl("sgmv_shrink", c10::DispatchKey::CPU, &sgmv_shrink);
  m.impl("sgmv_expand", c10::DispatchKey::CPU, &sgmv_expand);
}

// Paged decode attention for CPUs: one call per layer for the whole decode batch; prefill attention as
// decode rows, one per new token; and the KV write.
//
// Each thread takes a run of sequences with an equal share of the keys (at::parallel_for, torch's own thread
// pool; split by index, two halves of a batch of random lengths differed by ~5%). Each sequence's keys are read
// once, block by block along its block table, scoring all G query heads of each KV head against each key
// (GQA without copying K/V per query head), then its values once more to accumulate the softmax-weighted
// sum. K/V are read straight from the paged pool: no gather, no padding, no mask.
// Accumulation is fp32 whatever the storage dtype (fp32, bf16, fp16).
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
#include "decode_blocks.h"
#include "vecmath.h"

namespace {

template <typename T>
inline void load_row(float* dst, const T* src, int64_t n) {
  loragate::to_float(dst, src, n);
}

// A row of the cache as fp32: the row itself for fp32 storage, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* src, float* buffer, int64_t n) {
  load_row(buffer, src, n);
  return buffer;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

// One task per sequence: a token's keys (all KV heads, `KVH * D` contiguous values) are read in one
// sweep along each block, so the cache streams block by block (`BS * KVH * D` contiguous values).
// `DIM` is the head size when it is a compile-time constant (the common ones), else 0 and `dim` is used.
// A head size that is a multiple of 16 takes the register-blocked loops of `decode_blocks.h` (runs of up
// to 16 keys, the next block prefetched); others the per-key loops below. Each head's scores sit in a row
// padded past n by at least a vector (whole-vector stores; -inf past n for the softmax's whole vectors).
// `rows` (null for decode): row b's block table is block_tables[rows[b]] (prefill: each query a row of its
// own over its sequence's table), and each of the P tasks takes every P-th row, so that the rows of a long
// prompt, each one key longer than the last, share out evenly.
template <typename T, int DIM>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
            const int64_t* rows) {
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t dim = DIM > 0 ? DIM : q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = block_tables.size(1);
  const int64_t ldq = q.stride(0);  // q's rows may be slices of the fused qkv rows
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t token = kv_heads * dim;  // values per cached token
  const int64_t block_bytes = block_size * token * static_cast<int64_t>(sizeof(T));
  const float fscale = static_cast<float>(scale);
  constexpr int NL = loragate_decode::NL;

  constexpr bool blocked = DIM > 0 && DIM % 16 == 0;
  constexpr bool bf16 = std::is_same_v<T, at::BFloat16>;
  constexpr bool dp = blocked && bf16 && loragate_decode::dp_scores<DIM>();  // keys read as stored
  // 16-bit rows widened into `buf` before use: keys unless `dp`; values only for fp16 (bf16 widens on load).
  constexpr bool widen_k = blocked && !std::is_same_v<T, float> && !dp;
  constexpr bool widen_v = blocked && std::is_same_v<T, at::Half>;
  // Rows first, first + stride, ... below end, one after another in one task.
  auto work = [&](int64_t first, int64_t end, int64_t stride) {
    std::vector<float> qf(heads * dim), acc(heads * dim), row(token), scores, sums(heads);
    std::vector<float> buf(widen_k || widen_v ? block_size * token : 0);
    loragate_decode::Ahead ahead;
    // Pass over [lo, ctx) of `cache` along `table`, in runs within a block (at most 16 keys when blocked):
    // run(rows, i, count) gets the run's first token row (fp32 when `widen`) and its offset i from lo.
    // Blocked, each block's first run prefetches the next block, or after the last one `tail` (or null).
    auto sweep = [&]<bool widen>(const T* cache, const int64_t* table, int64_t lo, int64_t ctx, const T* tail,
                                 auto&& run) {
      for (int64_t p = lo; p < ctx;) {
        const int64_t blk = p / block_size, off = p % block_size;
        const int64_t count = std::min({block_size - off, ctx - p, blocked ? int64_t{16} : block_size});
        const T* rows = cache + (table[blk] * block_size + off) * token;
        if (blocked && (off == 0 || p == lo)) {
          const bool last = (blk + 1) * block_size >= ctx;
          ahead.start(last ? tail : cache + table[blk + 1] * block_size * token, block_bytes,
                      (std::min(block_size - off, ctx - p) + 15) / 16 * heads);
        }
        if constexpr (widen) {
          loragate::to_float(buf.data(), rows, count * token);
          run(static_cast<const float*>(buf.data()), p - lo, count);
        } else {
          run(rows, p - lo, count);
        }
        p += count;
      }
    };
    auto table_of = [&](int64_t b) { return tables + (rows != nullptr ? rows[b] : b) * width; };
    for (int64_t b = first; b < end; b += stride) {
      const int64_t ctx = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - lo;
      T* o = op + b * heads * dim;
      if (n <= 0) {  // nothing to attend to
        std::fill(o, o + heads * dim, static_cast<T>(0.f));
        continue;
      }
      const int64_t nv = (n + NL - 1) / NL * NL, ns = nv + NL;  // scores' row: padded past n by >= NL
      const int64_t* table = table_of(b);
      const T* qb = qp + b * ldq;
      if constexpr (!dp) {
        load_row(qf.data(), qb, heads * dim);
        for (int64_t i = 0; i < heads * dim; ++i) qf[i] *= fscale;
      }
      scores.resize(heads * ns);  // [heads][ns]
      // Pass 1: scores, block by block (no division per token).
      const T* first_value = vp + table[lo / block_size] * block_size * token;
      const T* next_key = b + stride < end ? kp + table_of(b + stride)[0] * block_size * token : nullptr;
      sweep.template operator()<widen_k>(kp, table, lo, ctx, first_value, [&](const auto* key, int64_t i,
                                                                              int64_t count) {
        if constexpr (dp) {
#if LORAGATE_DPBF16
          loragate_decode::score_run_dp<DIM>(scores.data() + i, qb, key, count, token, heads, group, ns, fscale,
                                             ahead);
#endif
        } else if constexpr (blocked) {
          loragate_decode::score_run<DIM>(scores.data() + i, qf.data(), key, count, token, heads, group, ns, ahead);
        } else {
          for (int64_t j = 0; j < count; ++j, key += token) {
            const float* kr = as_float(key, row.data(), token);
            for (int64_t hq = 0; hq < heads; ++hq) {
              const float* qh = qf.data() + hq * dim;
              const float* kh = kr + (hq / group) * dim;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t d = 0; d < dim; ++d) s += qh[d] * kh[d];
              scores[hq * ns + i + j] = s;
            }
          }
        }
      });
      // Softmax numerators and denominators, per query head, over whole vectors (exp(-inf) = 0 past n).
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* sh = scores.data() + hq * ns;
        const float m = loragate::max_floats(sh, n);
        std::fill(sh + n, sh + nv, -std::numeric_limits<float>::infinity());
        sums[hq] = loragate::exp_shifted_sum(sh, nv, m);
      }
      // Pass 2: the weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      sweep.template operator()<widen_v>(vp, table, lo, ctx, next_key, [&](const auto* value, int64_t i,
                                                                           int64_t count) {
        if constexpr (blocked) {
          loragate_decode::weigh_run<DIM>(acc.data(), scores.data() + i, value, count, token, heads, group, ns,
                                          ahead);
        } else {
          for (int64_t j = 0; j < count; ++j, value += token) {
            const float* vr = as_float(value, row.data(), token);
            for (int64_t hq = 0; hq < heads; ++hq) {
              const float w = scores[hq * ns + i + j];
              const float* vh = vr + (hq / group) * dim;
              float* a = acc.data() + hq * dim;
#pragma omp simd
              for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
            }
          }
        }
      });
      for (int64_t hq = 0; hq < heads; ++hq) {
        const float inv = 1.f / sums[hq];
        for (int64_t d = 0; d < dim; ++d) o[hq * dim + d] = static_cast<T>(acc[hq * dim + d] * inv);
      }
    }
  };
  if (rows == nullptr) {  // each task a run of sequences holding an equal share of the keys to read
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch));
    std::vector<int64_t> bounds(tasks + 1, batch);
    int64_t total = 0;
    auto cost = [&](int64_t b) { return (window > 0 ? std::min(lens[b], window) : lens[b]) + 16; };
    for (int64_t b = 0; b < batch; ++b) total += cost(b);
    bounds[0] = 0;
    for (int64_t b = 0, t = 1, done = 0; b < batch && t < tasks; ++b) {
      done += cost(b);
      while (t < tasks && done * tasks >= total * t) bounds[t++] = b + 1;
    }
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) work(bounds[c], bounds[c + 1], 1);
    });
  } else {
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch));
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) work(c, batch, tasks);
    });
  }
}

template <typename T>
void decode_any_dim(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                    const int64_t* rows) {
  switch (q.size(2)) {
    case 32: decode<T, 32>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows); break;
    case 64: decode<T, 64>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows); break;
    case 128: decode<T, 128>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows); break;
    default: decode<T, 0>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows);
  }
}

void attend(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
            const int64_t* rows) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode: q must be [B, H, D] with each row's heads contiguous");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: out and the caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "paged_decode: metadata must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: metadata must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_decode: q, out and the cache must share a dtype");
  switch (q.scalar_type()) {
    case at::kFloat: decode_any_dim<float>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows); break;
    case at::kBFloat16: decode_any_dim<at::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows); break;
    case at::kHalf: decode_any_dim<at::Half>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rows); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window) {
  attend(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, nullptr);
}

// Prefill attention as decode rows: query b attends the first context_lens[b] tokens (its position + 1) of
// sequence rows[b]'s block table (the causal mask by lengths; a window as in decode).
void paged_prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& rows, const at::Tensor& context_lens,
                   double scale, int64_t window) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1 && rows.size(0) == q.size(0),
              "paged_prefill: rows must be contiguous int64 [T], one per query");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0), "paged_prefill: one context length per query");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows.size(0); ++t)
    TORCH_CHECK(rp[t] >= 0 && rp[t] < block_tables.size(0), "paged_prefill: row ", rp[t], " outside the block tables");
  attend(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, rp);
}

// k_cache.view(-1, KVH, D)[slots[t]] = k[t], v_cache likewise: one token's KVH * D values at a time.
template <typename T>
void write_rows(T* kc, T* vc, const T* k, const T* v, const int64_t* slots, int64_t tokens, int64_t width,
                int64_t ldk, int64_t ldv) {
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slots[t] * width, k + t * ldk, width * sizeof(T));
      std::memcpy(vc + slots[t] * width, v + t * ldv, width * sizeof(T));
    }
  });
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(),
              "write_kv: the caches must be contiguous [NB, BS, KVH, D]");
  const int64_t kvh = k_cache.size(2), dim = k_cache.size(3), capacity = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(1) == kvh && x->size(2) == dim && x->stride(2) == 1 &&
                    x->stride(1) == dim && x->size(0) == slots.size(0),
                "write_kv: k and v must be [T, KVH, D] with each token's values contiguous");
    TORCH_CHECK(x->scalar_type() == k_cache.scalar_type(), "write_kv: k, v and the caches must share a dtype");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "write_kv: slot_mapping must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "write_kv: slot ", sp[t], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    write_rows<scalar_t>(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                         v.data_ptr<scalar_t>(), sp, slots.size(0), kvh * dim, k.stride(0), v.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY(loragate_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window) -> ()");
  m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor rows, Tensor context_lens, float scale, int window) -> ()");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
  m.impl("paged_prefill", c10::DispatchKey::CPU, &paged_prefill);
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
}

// Prefill attention with a prompt's rows on AMX tiles (`paged_prefill_prompt`): the rows at positions below
// their sequence's prompt length run on the tiles (`prefill_tiles.h`), every other row (a resumed request's
// generated tokens, a window's rows past it, any row without AMX, bf16 and a head size of 32, 64 or 128) as a
// decode row of `paged_prefill`. So a row's bits follow from what it is — a prompt token or a generated
// one — never from how the scheduler cut the step: a generated token recomputed after a preemption or a
// restart attends as its decode step did, a prompt's rows alike whatever its chunks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "prefill_tiles.h"

namespace {

namespace pt = loragate_prefill_tiles;

using PrefillOp = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, double, int64_t);

// Whether prompt rows of this dtype and head size can run on the tiles here.
bool on_tiles(c10::ScalarType dtype, int64_t head_dim) {
  return LORAGATE_AMX && dtype == at::kBFloat16 && (head_dim == 32 || head_dim == 64 || head_dim == 128) &&
         loragate_amx::ready();
}

// out[t] = softmax(scale q[t] K^T) V over the keys row t sees: sequence s's queries are rows
// [query_start[s], query_start[s + 1]) (less query_start[0]) at the last positions of its context_lens[s]
// tokens; a row at position p sees keys max(0, p + 1 - window)..p (window 0: all). Rows below
// prompt_lens[s] (and, with a window, below it) on the tiles where `on_tiles`.
void paged_prefill_prompt(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& query_start,
                          const at::Tensor& context_lens, const at::Tensor& prompt_lens, double scale,
                          int64_t window) {
  for (const at::Tensor* t : {&query_start, &context_lens, &prompt_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "paged_prefill_prompt: query_start, context_lens and prompt_lens are contiguous int64 vectors");
  const int64_t seqs = context_lens.size(0), rows = q.size(0);
  TORCH_CHECK(query_start.size(0) == seqs + 1 && prompt_lens.size(0) == seqs && block_tables.dim() == 2 &&
                  block_tables.size(0) == seqs,
              "paged_prefill_prompt: one table, context and prompt length per sequence, one more query start");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  out.sizes() == q.sizes() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
              "paged_prefill_prompt: q [T, H, D] with each row's heads contiguous, out like q, contiguous caches "
              "[NB, BS, KVH, D] and int64 tables");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* prompt = prompt_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(qs[seqs] - qs[0] == rows, "paged_prefill_prompt: the query starts span q's rows");
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  const bool tiles = on_tiles(q.scalar_type(), q.size(2)) && q.size(1) % kv_heads == 0;
  at::Tensor vector_rows = at::empty({rows}, query_start.options());
  at::Tensor vector_lens = at::empty({rows}, query_start.options());
  int64_t* vr = vector_rows.data_ptr<int64_t>();
  int64_t* vl = vector_lens.data_ptr<int64_t>();
  int64_t on_vector = 0;
  std::vector<pt::Task> tasks;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = qs[s + 1] - qs[s], first = ctx[s] - n, row0 = qs[s] - qs[0];
    TORCH_CHECK(n >= 0 && first >= 0 && row0 >= 0 && row0 + n <= rows,
                "paged_prefill_prompt: each sequence's queries within q and within its context");
    int64_t end = tiles ? std::min(ctx[s], prompt[s]) : first;  // tile rows: positions [first, end)
    if (window > 0) end = std::min(end, window);
    end = std::max(end, first);
    for (int64_t i = 0; i < n; ++i) {
      vr[row0 + i] = s;
      vl[row0 + i] = first + i < end ? 0 : first + i + 1;  // a tile row: nothing for the vector kernel
      on_vector += first + i >= end;
    }
    if (end == first) continue;
    TORCH_CHECK((end + block_size - 1) / block_size <= width, "paged_prefill_prompt: a context past its table");
    for (int64_t b = 0; b < (end + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < k_cache.size(0),
                  "paged_prefill_prompt: block ", tables[s * width + b], " outside the cache");
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t p = first; p < end; p += 16 * pt::TASK_TILES)
        tasks.push_back({s, h, p, std::min(end, p + 16 * pt::TASK_TILES), row0 + p - first});
  }
  if (on_vector > 0) {
    static const auto prefill =
        c10::Dispatcher::singleton().findSchemaOrThrow("loragate_cpu::paged_prefill", "").typed<PrefillOp>();
    prefill.call(out, q, k_cache, v_cache, block_tables, vector_rows, vector_lens, scale, window);
  }
  if (tasks.empty()) return;
#if LORAGATE_AMX
  const pt::Call call{out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                      v_cache.data_ptr<at::BFloat16>(), tables, q.stride(0), out.stride(0), width, block_size,
                      kv_heads, q.size(1) / kv_heads, static_cast<float>(scale)};
  // Each thread a run of tasks holding an equal share of the work (rows x keys).
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  int64_t total = 0;
  for (const auto& t : tasks) total += t.cost();
  std::vector<int64_t> bounds(threads + 1, count);
  bounds[0] = 0;
  for (int64_t i = 0, th = 1, done = 0; i < count && th < threads; ++i) {
    done += tasks[i].cost();
    while (th < threads && done * threads >= total * th) bounds[th++] = i + 1;
  }
  const int64_t dim = q.size(2);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) pt::run_tasks(call, tasks, bounds[th], bounds[th + 1], dim);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("paged_prefill_prompt(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor context_lens, Tensor prompt_lens, float scale, int window) -> ()");
  m.def("prefill_tiles_ready(ScalarType dtype, int head_dim) -> bool", &on_tiles);
  m.impl("paged_prefill_prompt", c10::DispatchKey::CPU, &paged_prefill_prompt);
}

// A Llama-family model's decoder layers in one native call per step, for a model whose linear layers all run on
// the AMX kernel (`linear_amx.cpp`, bf16) or all on oneDNN's packed matmul (`mkldnn::_linear_pointwise`, fp32):
// the same kernels the Python forward (`worker.model.ModelRunner._layers`) calls one by one, in the same order
// on the same inputs, so the bits are the same, without ~10 trips a layer through Python between them. Those
// trips cost 2.4 ms of a 15 ms one-row SmolLM2 bf16 step and 3.9 of a 34 ms 64-row one (docs/BENCHMARKS.md):
// each is a few microseconds warm, many more once a kernel's memory traffic has pushed the interpreter's own
// working set out of the caches.
//
// `decoder_plan` takes the layers' tensors once (weights, norms, biases, KV caches, RoPE tables) into a plan
// held as a byte tensor (`plan_tensor.h`, as `sgmv_group_plan`'s); `decoder_run` runs every layer on one
// step's residual stream h, with the step's attention metadata and, for an adapted step, each fused
// projection's LoRA plan.
// The kernels are called through the dispatcher (`loragate_cpu::*`), so each keeps its own checks.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include "plan_tensor.h"
#include "sgmv_group_plan.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// Per layer, in this order (`decoder_plan`'s `layers`, LAYER_TENSORS a layer; the biases may be None).
enum Slot : int64_t {
  INPUT_NORM, QKV, QKV_BIAS, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, K_CACHE, V_CACHE,
  LAYER_TENSORS
};
// The LoRA plans' order in `decoder_run`'s `loras` (each None where no adapter of the step touches it).
enum Group : int64_t { G_QKV, G_O, G_GATE_UP, G_DOWN, GROUPS };

constexpr uint64_t PLAN_MAGIC = 0x6465636f64657273ULL;

struct Plan {
  uint64_t magic = PLAN_MAGIC;
  const Plan* self = this;  // a copy of a plan's bytes is not a plan
  std::vector<std::array<OptTensor, LAYER_TENSORS>> layers;
  std::vector<int64_t> windows;  // per layer: keys a query sees (0: all)
  at::Tensor cos, sin;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, qkv_out = 0, inter = 0;
  bool amx = true;     // the linears on the AMX kernel, else on oneDNN's
  bool gated = false;  // gate/up packed gated (`kernels.linear_amx.pack_amx`): SiLU in its matmul where it can
  double eps = 0, scale = 0;
};

const Plan& read_plan(const at::Tensor& t) {
  return loragate::read_plan<Plan>(t, PLAN_MAGIC, "decoder_run: not a plan made by decoder_plan");
}

at::Tensor decoder_plan(const c10::List<OptTensor>& layers, at::IntArrayRef windows, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                        bool amx, bool gated, double eps, double scale) {
  const int64_t n = static_cast<int64_t>(windows.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(layers.size()) == n * LAYER_TENSORS,
              "decoder_plan: ", LAYER_TENSORS, " tensors and one window per layer");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && inter > 0,
              "decoder_plan: heads a multiple of kv_heads, positive sizes");
  auto plan = std::make_unique<Plan>();
  for (int64_t i = 0; i < n; ++i) {
    std::array<OptTensor, LAYER_TENSORS> layer;
    for (int64_t s = 0; s < LAYER_TENSORS; ++s) {
      layer[s] = layers.get(i * LAYER_TENSORS + s);
      const bool bias = s == QKV_BIAS || s == O_BIAS || s == GATE_UP_BIAS || s == DOWN_BIAS;
      TORCH_CHECK(bias || (layer[s].has_value() && layer[s]->defined()), "decoder_plan: layer ", i,
                  " lacks tensor ", s);
    }
    TORCH_CHECK(windows[i] >= 0, "decoder_plan: a window is >= 0 (0: none)");
    plan->layers.push_back(std::move(layer));
  }
  plan->windows.assign(windows.begin(), windows.end());
  plan->cos = cos, plan->sin = sin;
  plan->heads = heads, plan->kv_heads = kv_heads, plan->head_dim = head_dim, plan->inter = inter;
  plan->qkv_out = (heads + 2 * kv_heads) * head_dim;
  plan->amx = amx, plan->gated = amx && gated, plan->eps = eps, plan->scale = scale;
  return loragate::plan_tensor(std::move(plan));
}

// The kernels, as registered (each typed with its kernel's own C++ signature).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, const OptTensor&, const at::Tensor&, double)> rms_norm =
      op<void(at::Tensor, at::Tensor, const OptTensor&, const at::Tensor&, double)>("loragate_cpu::rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)> linear =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>("loragate_cpu::linear_amx");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>
      rope_write_kv = op<void(at::Tensor, at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>(
          "loragate_cpu::rope_write_kv");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t)>
      decode = op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, double, int64_t)>("loragate_cpu::paged_decode");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                int64_t)>
      prefill = op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>(
          "loragate_cpu::paged_prefill_prompt");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t)> lora =
      op<void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t)>("loragate_cpu::sgmv_group_run");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t)> v =
      op<at::Tensor(const at::Tensor&, int64_t)>("loragate_cpu::sgmv_group_v");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t)> shrink =
      op<void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t)>("loragate_cpu::sgmv_group_shrink");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                const at::Tensor&, const at::Tensor&, int64_t)>
      linear_lora = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                            const at::Tensor&, const at::Tensor&, int64_t)>("loragate_cpu::linear_amx_lora");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&)> silu_mul =
      op<void(at::Tensor, const at::Tensor&)>("loragate_cpu::silu_mul");
  c10::OperatorHandle onednn = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
};

const Ops& ops() {
  static const Ops handles;  // looked up once: the library registers every kernel before any call
  return handles;
}

// x Wᵀ + b as `kernels.linear.linear` computes it on the plan's kind of weight: `width` columns out (`mode`: the
// AMX kernel's, 0 plain, 1 a gated weight in its own order, 2 SiLU), or oneDNN's matmul on its packed weight.
at::Tensor linear(const Plan& plan, const at::Tensor& x, const at::Tensor& w, const OptTensor& b, int64_t width,
                  int64_t mode) {
  if (!plan.amx) {
    torch::jit::Stack stack{x, w, b, std::string("none"), c10::List<std::optional<at::Scalar>>(), std::string()};
    ops().onednn.callBoxed(&stack);
    return stack[0].toTensor();
  }
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  ops().linear.call(out, x, w, b, mode);
  return out;
}

// Every layer on h [T, hidden] (the residual stream, updated in place): rows [0, num_decode) decode rows
// (`dec_tables`, `dec_lens` as `paged_decode` takes them), the rest prefill rows (`pre_tables`, `pre_starts`,
// `pre_lens`, `pre_prompt` as `paged_prefill_prompt`). Returns the last layer's MLP output, which the caller adds with the final
// norm, as `ModelRunner.hidden` does.
at::Tensor decoder_run(at::Tensor h, const at::Tensor& plan_t, const at::Tensor& positions,
                       const at::Tensor& slot_mapping, int64_t num_decode, const OptTensor& dec_tables,
                       const OptTensor& dec_lens, const OptTensor& pre_tables, const OptTensor& pre_starts,
                       const OptTensor& pre_lens, const OptTensor& pre_prompt, const c10::List<OptTensor>& loras) {
  const Plan& plan = read_plan(plan_t);
  const int64_t t = h.size(0), hidden = h.size(1), q_size = plan.heads * plan.head_dim;
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && num_decode >= 0 && num_decode <= t,
              "decoder_run: h [T, hidden] contiguous, 0 <= num_decode <= T");
  TORCH_CHECK(num_decode == 0 || (dec_tables.has_value() && dec_lens.has_value()),
              "decoder_run: decode rows need their block tables and lengths");
  TORCH_CHECK(num_decode == t || (pre_tables.has_value() && pre_starts.has_value() && pre_lens.has_value() &&
                                   pre_prompt.has_value()),
              "decoder_run: prefill rows need their block tables, query starts, lengths and prompt lengths");
  TORCH_CHECK(loras.size() == GROUPS, "decoder_run: one LoRA plan (or None) per group: qkv, o, gate_up, down");
  const Ops& k = ops();
  const auto opts = h.options();
  std::array<OptTensor, GROUPS> lora;
  for (int64_t g = 0; g < GROUPS; ++g) lora[g] = loras.get(g);
  auto adapted = [&](int64_t g) { return lora[g].has_value() && lora[g]->defined(); };
  // A group whose adapters run on AMX tiles, its rows in long runs of one slot (a prefill's prompts), goes
  // inside the AMX linear (`linear_amx_lora.h`): its rows' shrinks into v (zeros elsewhere: each layer
  // writes the same entries), then one matmul that adds them; the same bits as `sgmv_group_run` after it.
  std::array<at::Tensor, GROUPS> v;
  for (int64_t g = 0; g < GROUPS; ++g) {
    if (!plan.amx || !adapted(g)) continue;
    const auto& group = loragate_sgmv_group::read_plan(*lora[g]);
    if (group.tiles && group.long_runs) v[g] = k.v.call(*lora[g], t);
  }
  auto adapt = [&](int64_t g, const at::Tensor& y, const at::Tensor& x, int64_t i) {
    if (adapted(g) && !v[g].defined()) k.lora.call(y, x, *lora[g], i);
  };
  // x Wᵀ + b (`linear`), with group g's adapters inside the matmul where they run on tiles.
  auto project = [&](int64_t g, const at::Tensor& x, const at::Tensor& w, const OptTensor& b, int64_t width,
                     int64_t mode, int64_t i) {
    if (!v[g].defined()) return linear(plan, x, w, b, width, mode);
    k.shrink.call(v[g], x, *lora[g], i);
    at::Tensor out = at::empty({x.size(0), width}, x.options());
    k.linear_lora.call(out, x, w, b, mode, v[g], *lora[g], i);
    return out;
  };
  OptTensor down;
  for (int64_t i = 0; i < static_cast<int64_t>(plan.layers.size()); ++i) {
    const auto& w = plan.layers[i];
    at::Tensor x = at::empty_like(h);
    k.rms_norm.call(x, h, down, *w[INPUT_NORM], plan.eps);
    at::Tensor qkv = project(G_QKV, x, *w[QKV], w[QKV_BIAS], plan.qkv_out, 0, i);
    adapt(G_QKV, qkv, x, i);
    const at::Tensor &kc = *w[K_CACHE], &vc = *w[V_CACHE];
    k.rope_write_kv.call(qkv, kc, vc, plan.cos, plan.sin, positions, slot_mapping, plan.heads, plan.kv_heads,
                         plan.head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, plan.heads, plan.head_dim});
    at::Tensor attn = at::empty({t, plan.heads, plan.head_dim}, opts);
    if (num_decode > 0)
      k.decode.call(attn.narrow(0, 0, num_decode), q.narrow(0, 0, num_decode), kc, vc, *dec_tables, *dec_lens,
                    plan.scale, plan.windows[i]);
    if (num_decode < t)
      k.prefill.call(attn.narrow(0, num_decode, t - num_decode), q.narrow(0, num_decode, t - num_decode), kc, vc,
                     *pre_tables, *pre_starts, *pre_lens, *pre_prompt, plan.scale, plan.windows[i]);
    at::Tensor flat = attn.view({t, q_size});
    at::Tensor o = project(G_O, flat, *w[O], w[O_BIAS], hidden, 0, i);
    adapt(G_O, o, flat, i);
    at::Tensor x2 = at::empty_like(h);
    k.rms_norm.call(x2, h, o, *w[POST_NORM], plan.eps);
    at::Tensor act;
    if (!plan.gated || (adapted(G_GATE_UP) && !v[G_GATE_UP].defined())) {  // adapters before the SiLU pass
      at::Tensor gate_up = project(G_GATE_UP, x2, *w[GATE_UP], w[GATE_UP_BIAS], 2 * plan.inter, plan.gated ? 1 : 0, i);
      adapt(G_GATE_UP, gate_up, x2, i);
      act = at::empty({t, plan.inter}, opts);
      k.silu_mul.call(act, gate_up);
    } else {  // the SiLU in the matmul, after the adapters where they run inside it
      act = project(G_GATE_UP, x2, *w[GATE_UP], w[GATE_UP_BIAS], plan.inter, 2, i);
    }
    at::Tensor d = project(G_DOWN, act, *w[DOWN], w[DOWN_BIAS], hidden, 0, i);
    adapt(G_DOWN, d, act, i);
    down = d;
  }
  return *down;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loragate_cpu, m) {
  m.def("decoder_plan(Tensor?[] layers, int[] windows, Tensor cos, Tensor sin, int heads, int kv_heads, "
        "int head_dim, int inter, bool amx, bool gated, float eps, float scale) -> Tensor");
  m.def("decoder_run(Tensor(a!) h, Tensor plan, Tensor positions, Tensor slot_mapping, int num_decode, "
        "Tensor? dec_tables, Tensor? dec_lens, Tensor? pre_tables, Tensor? pre_starts, Tensor? pre_lens, "
        "Tensor? pre_prompt, Tensor?[] loras) -> Tensor");
  // Any backend: oneDNN's packed weights are tensors of their own layout (MkldnnCPU).
  m.impl("decoder_plan", c10::DispatchKey::CompositeExplicitAutograd, &decoder_plan);
  m.impl("decoder_run", c10::DispatchKey::CPU, &decoder_run);
}

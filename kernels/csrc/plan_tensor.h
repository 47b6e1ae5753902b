// A kernel's per-step or per-model plan held as a byte tensor (`sgmv_group_plan`, `decoder_plan`): the tensor's
// memory is the plan itself, freed with the tensor, so a plan that holds tensors keeps their addresses valid
// for as long as it lives, and passing it through the dispatcher costs one tensor argument. A plan type has
// `uint64_t magic` (its own constant) and `const P* self = this` members: a copy of a plan's bytes, or any
// other byte tensor, is refused.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

namespace loragate {

template <typename P>
at::Tensor plan_tensor(std::unique_ptr<P> plan) {
  P* raw = plan.release();
  return at::from_blob(
      raw, {static_cast<int64_t>(sizeof(P))}, [](void* p) { delete static_cast<P*>(p); },
      at::TensorOptions().dtype(at::kByte));
}

// The plan `t` holds, if it is one of type P (`magic`); else an error saying `refusal`.
template <typename P>
const P& read_plan(const at::Tensor& t, uint64_t magic, const char* refusal) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 1 &&
                  t.size(0) == static_cast<int64_t>(sizeof(P)) && t.storage_offset() == 0,
              refusal);
  const auto* plan = static_cast<const P*>(t.const_data_ptr());
  TORCH_CHECK(plan->magic == magic && plan->self == plan, refusal);
  return *plan;
}

}  // namespace loragate

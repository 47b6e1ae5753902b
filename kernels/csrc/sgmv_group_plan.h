// The multi-LoRA group's per-step plan (`sgmv_group_cpu.cpp`), shared with the AMX linear layer
// (`linear_amx_lora.h`), which reads the same plan to add a group's adapters inside its own matmul.
//
// A group's step, checked and laid out once (`sgmv_group_plan`) and run for every layer (`sgmv_group_run`):
// each layer's call then passes three tensors through the dispatcher instead of three lists of tensors, two
// tables and a list of offsets, and does no per-module checks (per call, the dispatch and the checks cost
// more than a decode step's small adapters' arithmetic). The plan is a byte tensor whose memory is the
// `Plan` itself (`plan_tensor.h`): it holds the tensors it points into, so its addresses stay valid for as
// long as it lives. (A custom class would do the same, but passing one from Python costs ~15 us.)
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

#include "plan_tensor.h"

namespace loragate_sgmv_group {

constexpr int64_t CHUNK = 16;  // tokens per work item: 4 tiles per read of the weights from L2 or memory

struct Chunk {
  int64_t token, slot, rows;
};

struct Module {
  const void* a;  // this layer's [S, R, in], rows contiguous
  int64_t a_slot, a_row;
  const void* b;  // this layer's [S, O, R] through its strides
  int64_t b_slot, b_out, b_rank, outs, offset;
  // This layer's B in rank pairs [S, O / 16, R / 2, 32] (`sgmv_amx.h`), or null. Each slot's region holds
  // its own rank's pairs densely, [O / 16, ceil(r / 2), 32] from its start (`kernels.sgmv_native.slot_pairs`).
  const void* pairs;
  int64_t pair_slot;
};

constexpr uint64_t PLAN_MAGIC = 0x6c6f726167617465ULL;
constexpr int64_t LONG_RUN = 8;

struct Plan {
  uint64_t magic = PLAN_MAGIC;
  const Plan* self = this;        // a copy of a plan's bytes is not a plan
  std::vector<at::Tensor> held;  // the stacks whose addresses `mods` keeps
  std::vector<Module> mods;      // layer 0's addresses; `layer_bytes` moves them to a layer
  std::vector<std::array<int64_t, 3>> layer_bytes;  // per module: a, b, pairs strides over layers, bytes
  std::vector<int64_t> ranks;
  std::vector<float> scales;
  std::vector<Chunk> work;
  // Per token row below `rows`: the slot whose adapters the group applies to it, or -1 (none); and its run
  // (rows of one slot in a row) among the runs of its block of 32 rows (rows 0-31, 32-63, ...), or -1.
  std::vector<int64_t> row_slot, row_run;
  std::vector<int64_t> used;  // the slots of the adapted rows, each once
  int64_t runs = 1;  // the most runs in a block of 32 rows (at least 1)
  at::ScalarType dtype = at::kFloat;
  int64_t slots = 0, in = 0, layers = 0, width = 0, rows = 0;
  // Every module's adapters on AMX tiles (bf16; each B in rank pairs; every used rank one `loragate_amx::fits`
  // takes; outputs in whole runs of 16): the AMX linear can then add them inside its matmul
  // (`linear_amx_lora.h`).
  bool tiles = false;
  // The adapted rows come in long runs of one slot: at least `LONG_RUN` rows on average per piece of a run
  // within a 16-row tile (prefill chunks: a prompt is one run). Inside the AMX linear each piece costs a
  // few tile loads and multiplies whose latency nothing hides, so a decode step's short runs (a row per
  // sequence, a few per slot) are faster through `sgmv_group_run` after the matmul (docs/BENCHMARKS.md).
  bool long_runs = false;
};

inline const Plan& read_plan(const at::Tensor& t) {
  return loragate::read_plan<Plan>(t, PLAN_MAGIC, "sgmv_group: not a plan made by sgmv_group_plan");
}

// Module m's addresses at `layer`.
inline Module at_layer(const Plan& plan, int64_t m, int64_t layer) {
  Module md = plan.mods[m];
  const std::array<int64_t, 3>& lb = plan.layer_bytes[m];
  md.a = static_cast<const char*>(md.a) + layer * lb[0];
  md.b = static_cast<const char*>(md.b) + layer * lb[1];
  if (md.pairs != nullptr) md.pairs = static_cast<const char*>(md.pairs) + layer * lb[2];
  return md;
}

}  // namespace loragate_sgmv_group

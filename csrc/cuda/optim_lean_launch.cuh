// What one launch of the lean kernels carries (optim_lean_kernels.cuh): up to
// kLeanTensors tensors in its kernel arguments, each with its state codes and
// where its state blocks start, and the rule's hyper-parameters. Each warp
// walks state blocks [warp, total) with a stride of the grid's warps and
// finds its tensor by a binary search over the tensors' first block numbers.
// A set noop flag returns before anything is read or written.
// Included by optim_lean.cu alone, whose translation unit it is part of: its
// names stay in that unit's anonymous namespace.
#pragma once

#include <cstdint>

#include "optim_lists.cuh"
#include "optim_state_codes.cuh"

namespace amp_patch::cuda {
namespace {

using optim::StateCode;

// Up to two state lists per tensor (Adam: exp_avg, exp_avg_sq; SGD: the
// momentum buffer). A null state is absent (SGD without momentum).
constexpr int kMaxStates = 2;

struct LeanTensor {
  const void* grad;
  void* param;
  void* model;  // null: no model copy
  void* state[kMaxStates];
  float* scale[kMaxStates];  // null unless the code is block-scaled
  int64_t row_len;           // elements per row
  int64_t first_block;       // the launch's number of this tensor's first state block
  int64_t blocks_per_row;
  uint32_t key;              // stochastic rounding (bf16 params)
  int32_t index;             // in the op's lists (LAMB's norms)
  int8_t grad_dt, param_dt, model_dt;  // tensor_lists.cuh's dtype_index
  StateCode code[kMaxStates];
  bool vec;  // read and written in vectors of kLeanVec (the plan's rule)
};

constexpr int kLeanThreads = 256;  // 8 warps, each a state block at a time
constexpr int kLeanWarps = kLeanThreads / 32;
// Thread blocks per SM the registers must allow (more warps in flight hide
// more of the memory latency). At 3, on sm_90 (nvcc 13.0), Adam's specialised
// kernels take 80 registers with 4 B of spills: 37.5% occupancy, against 25% at
// 2 (87 registers, no spills).
constexpr int kLeanMinBlocks = 3;
// Elements a warp covers per chunk of a state block.
constexpr int kLeanChunk = 32 * kLeanVec;
// Chunks whose results stay in registers between the two passes (the default
// block of 256 elements is one chunk).
constexpr int kLeanCachedChunks = 1;
// Grid size cap; warps loop over the rest.
constexpr int64_t kLeanMaxGrid = int64_t{1} << 16;
constexpr int kLeanOwnBytes = 256;  // the launch's other fields, checked below
constexpr int kLeanTensors = (kParamBytes - kLeanOwnBytes) / static_cast<int>(sizeof(LeanTensor));

template <typename Hyper>
struct LeanLaunch {
  LeanTensor t[kLeanTensors];
  OptimCommon common;
  Hyper h;
  int64_t total_blocks;
  int32_t n;
  int32_t block_size;
};

}  // namespace
}  // namespace amp_patch::cuda

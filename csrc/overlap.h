// The memory-overlap rule shared by the CPU and CUDA kernels of every op that
// writes tensors: a written tensor shares memory with no other tensor of the
// call, except that out[i] may be the very same view as in[i].
//
// The kernels process tensors in an unspecified order (on CUDA, in parallel),
// so a call that breaks the rule has no defined result. The reference bodies
// in amp_patch/ops/_library.py apply the same rule with the same message.
#pragma once

#include <ATen/core/Tensor.h>

namespace amp_patch {

// Raises, naming both tensors, when the rule above is broken. `in_name` and
// `in` may be empty (in-place ops, where `out` is both read and written).
//
// Only address ranges are compared (sorted, then swept), so the cost is
// O(n log n) in the number of tensors, with no per-element work. Two
// interleaved strided views of one buffer are therefore rejected too.
void check_no_overlap(
    const char* op,
    const char* out_name,
    at::TensorList out,
    const char* in_name = "",
    at::TensorList in = {});

}  // namespace amp_patch

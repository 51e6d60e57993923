#include "overlap.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "check.h"

namespace amp_patch {
namespace {

// The bytes [first, end) that a tensor's elements span.
struct Extent {
  uintptr_t first;
  uintptr_t end;
  bool written;
  const char* list;
  size_t index;
};

Extent extent_of(const at::Tensor& t, bool written, const char* list, size_t index) {
  int64_t elems = 1;  // strides are never negative in torch
  for (int64_t d = 0; d < t.dim(); ++d) {
    elems += (t.size(d) - 1) * t.stride(d);
  }
  const auto first = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {first, first + static_cast<uintptr_t>(elems * t.itemsize()), written, list, index};
}

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.const_data_ptr() == b.const_data_ptr() && a.sizes() == b.sizes() &&
      a.strides() == b.strides() && a.itemsize() == b.itemsize();
}

}  // namespace

void check_no_overlap(
    const char* op,
    const char* out_name,
    at::TensorList out,
    const char* in_name,
    at::TensorList in) {
  std::vector<Extent> extents;
  extents.reserve(out.size() + in.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].numel() > 0) {
      extents.push_back(extent_of(out[i], true, out_name, i));
    }
  }
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].numel() > 0 && !(i < out.size() && same_view(in[i], out[i]))) {
      extents.push_back(extent_of(in[i], false, in_name, i));
    }
  }
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.first < b.first; });
  // The extent reaching furthest so far, among all and among the written ones:
  // a written extent must start past the first, a read one past the second.
  const Extent* far_any = nullptr;
  const Extent* far_written = nullptr;
  for (const Extent& e : extents) {
    const Extent* reach = e.written ? far_any : far_written;
    if (reach != nullptr && e.first < reach->end) {
      const std::string rule = in_name[0] != '\0'
          ? std::string("only ") + out_name + "[i] may be the very same tensor as " + in_name + "[i]"
          : std::string("no tensor may appear twice");
      AMP_CHECK(false, "amp_patch::", op, ": ", reach->list, "[", reach->index, "] and ", e.list,
                  "[", e.index, "] overlap in memory, so the result would depend on the order in "
                  "which the kernel processes them (", rule,
                  "; a written tensor shares memory with no other)");
    }
    if (far_any == nullptr || e.end > far_any->end) {
      far_any = &e;
    }
    if (e.written && (far_written == nullptr || e.end > far_written->end)) {
      far_written = &e;
    }
  }
}

}  // namespace amp_patch

// AMP_CHECK: TORCH_CHECK whose message is built without iostreams.
//
// TORCH_CHECK(cond, a, b, ...) formats its arguments with an std::ostringstream
// in this library's code. On the first GPU image we ran on (H200, torch 2.11,
// CXX=/opt/gcc/bin/g++), that crashed the process instead of raising, in every
// check that printed a count, an index or a shape, on the CPU and CUDA kernels
// alike, while checks that printed only text and devices raised as they should.
// cuda-gdb put the fault in std::ostream::_M_insert<long> with libstdc++'s own
// code (std::codecvt) inside amp_patch._C: a C++ runtime linked into the
// library, whose number formatting read locale tables that were not its own.
// AMP_CHECK appends the same text to an std::string (integers with
// std::to_string, floats with snprintf("%g"), as a stream prints them; devices
// through c10, which formats inside libc10) and hands TORCH_CHECK that one
// string, which it passes through without a stream. Every check in csrc/ uses
// it; tests/test_native.py keeps TORCH_CHECK, c10::str and streams out.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace amp_patch {
namespace detail {

inline void append(std::string& out, const char* text) {
  out += text;
}

inline void append(std::string& out, const std::string& text) {
  out += text;
}

inline void append(std::string& out, std::string_view text) {
  out.append(text.data(), text.size());
}

// A template, so that a string literal (which converts to bool) never lands here.
template <typename T, std::enable_if_t<std::is_same_v<T, bool>, int> = 0>
void append(std::string& out, T value) {
  out += value ? "true" : "false";
}

template <typename T,
          std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                               !std::is_same_v<T, char>,
                           int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append(std::string& out, T value) {
  char buffer[32];
  const int n = std::snprintf(buffer, sizeof(buffer), "%g", static_cast<double>(value));
  out.append(buffer, static_cast<size_t>(n));
}

inline void append(std::string& out, c10::ScalarType type) {
  out += c10::toString(type);
}

// A template: a Device converts from a string, and must not catch those.
template <typename T, std::enable_if_t<std::is_same_v<T, c10::Device>, int> = 0>
void append(std::string& out, const T& device) {
  out += device.str();
}

// A shape, as c10 prints one: [2, 3].
inline void append(std::string& out, c10::IntArrayRef sizes) {
  out += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) {
      out += ", ";
    }
    out += std::to_string(sizes[i]);
  }
  out += ']';
}

}  // namespace detail

// The arguments' text, concatenated: strings as they are, numbers, dtypes,
// devices and shapes as c10::str would print them.
template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

}  // namespace amp_patch

#define AMP_CHECK(cond, ...) TORCH_CHECK(cond, ::amp_patch::message(__VA_ARGS__))

// CPU kernels of the fused optimizer ops (schemas and reference bodies:
// amp_patch/ops/optimizer_ops.py).
//
// One call updates many tensors. Its lists (grads, params, moments, the
// optional half model copies) are lined up into rows, one per tensor index, of
// flat memory. The concatenation of all rows is cut into tasks of equal size
// (plan.h's kTaskElems) that the threads share out as Plan does for the
// loss-scaling ops (Tasks::run).
// Within a task each row is walked in tiles: fp32 tensors are handed to the
// loops where they lie, fp16/bf16 ones are widened into a stack tile first and
// narrowed back after, so a tile is read from memory once and written once.
// Adam's rows of fp32 params and moments skip the tiles (adam_mixed_loop
// converts the grads and the model copy in registers).
//
// A set `noop` flag (Apex's noop_gmem, amp_patch's found_inf) makes an op
// return before it writes anything, so a skipped step never half-applies.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "check.h"
#include "cpu/kernel_table.h"
#include "cpu/optim_table.h"
#include "cpu/plan.h"
#include "optim_args.h"

namespace amp_patch::cpu {

const OptimTable& optim_kernels() {
  // Follow the loss-scaling kernels' choice, which honours ATEN_CPU_CAPABILITY.
  static const OptimTable table = [] {
#if defined(__x86_64__) || defined(_M_X64)
    const std::string& isa = kernel_capability();
    if (isa == "AVX512") {
      return AVX512::optim_table();
    }
    if (isa == "AVX2") {
      return AVX2::optim_table();
    }
#endif
    return DEFAULT::optim_table();
  }();
  return table;
}

namespace {

constexpr int kMaxLists = 5;
// Elements per tile: five fp32 tiles (20 KB) stay in L1 between the widening,
// the update and the narrowing.
constexpr int64_t kTile = 1024;

using optim::ListArg;
using optim::Use;

// Tensor i of every list, as flat memory of numel elements.
struct Row {
  std::array<void*, kMaxLists> ptr{};
  std::array<Dt, kMaxLists> dt{};
  int64_t numel = 0;
};

Dt element_type(const at::Tensor& t, const char* op, const char* list, size_t i) {
  const at::ScalarType st = t.scalar_type();
  AMP_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "amp_patch::", op, ": ",
              list, "[", i, "] has dtype ", st,
              "; the optimizer kernels take float32, float16 and bfloat16");
  return st == at::kFloat ? kF32 : (st == at::kHalf ? kF16 : kBF16);
}

// The noop flag: amp_patch's float32 found_inf or Apex's int32 noop buffer.
bool step_skipped(const std::optional<at::Tensor>& noop, const char* op) {
  if (!noop.has_value()) {
    return false;
  }
  if (noop->scalar_type() == at::kInt) {
    check_cpu(*noop, op, "noop");
    AMP_CHECK(noop->numel() == 1, "amp_patch::", op, ": noop must have one element, got ",
                noop->numel());
    return *noop->const_data_ptr<int32_t>() != 0;
  }
  return read_scalar(*noop, op, "noop (float32, or Apex's int32)") != 0.0f;
}

float scale_or_one(const std::optional<at::Tensor>& inv_scale, const char* op) {
  return inv_scale.has_value() ? read_scalar(*inv_scale, op, "inv_scale") : 1.0f;
}

// The rows and tasks of one call, with the contiguous stand-ins for tensors
// whose elements cannot be walked as one run in the same order as the others.
class RowPlan {
 public:
  RowPlan(const char* op, c10::ArrayRef<ListArg> lists) : op_(op), lists_(lists.vec()) {
    TORCH_INTERNAL_ASSERT(!lists_.empty() && lists_.size() <= kMaxLists);
    const size_t n = lists_[0].tensors.size();
    for (const ListArg& l : lists_) {
      AMP_CHECK(l.use == Use::kAbsent || l.tensors.size() == n, "amp_patch::", op,
                  ": list lengths differ (", lists_[0].name, " has ", n, ", ", l.name, " has ",
                  l.tensors.size(), ")");
    }
    rows_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      add_row(i);
    }
    tasks_.cut(rows_.size(), [&](size_t r) { return rows_[r].numel; });
  }

  const std::vector<Row>& rows() const { return rows_; }
  // The pieces of the rows (Span::job is the row), in task order.
  const std::vector<Span>& pieces() const { return tasks_.spans(); }
  Use use(int k) const { return lists_[k].use; }
  int copy_of(int k) const { return lists_[k].copy_of; }
  int lists() const { return static_cast<int>(lists_.size()); }

  // Runs f(piece_index, piece) over every piece, the tasks spread over the threads.
  template <typename F>
  void run(const F& f) const {
    tasks_.run([&](int64_t s, const Span& piece) {
      f(s, piece);
      return false;
    });
  }

  // Copies the stand-ins of written tensors back into the caller's tensors.
  void finish() {
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

 private:
  void add_row(size_t i) {
    Row& row = rows_[i];
    const at::Tensor& lead = lists_[0].tensors[i];
    row.numel = lead.numel();
    bool flat = true;
    for (size_t k = 0; k < lists_.size(); ++k) {
      const ListArg& l = lists_[k];
      if (l.use == Use::kAbsent) {
        continue;
      }
      const at::Tensor& t = l.tensors[i];
      check_cpu(t, op_, l.name);
      AMP_CHECK(t.sizes() == lead.sizes(), "amp_patch::", op_, ": ", l.name, "[", i,
                  "] has shape ", t.sizes(), " but ", lists_[0].name, "[", i, "] has ",
                  lead.sizes());
      row.dt[k] = element_type(t, op_, l.name, i);
      if (l.use != Use::kChecked) {
        flat = flat && t.is_non_overlapping_and_dense() && t.strides() == lead.strides();
      }
    }
    if (row.numel == 0) {
      return;
    }
    for (size_t k = 0; k < lists_.size(); ++k) {
      const ListArg& l = lists_[k];
      if (l.use == Use::kAbsent || l.use == Use::kChecked) {
        continue;
      }
      const at::Tensor& t = l.tensors[i];
      if (flat || t.is_contiguous()) {
        row.ptr[k] = t.data_ptr();
        continue;
      }
      // Slow path: the row's tensors disagree on layout, so each one that is
      // not contiguous is replaced by a contiguous stand-in.
      at::Tensor stand_in = l.use == Use::kCopyOut ? at::empty(t.sizes(), t.options()) : t.contiguous();
      if (l.use != Use::kRead) {
        write_back_.emplace_back(t, stand_in);
      }
      kept_.push_back(stand_in);
      row.ptr[k] = kept_.back().data_ptr();
    }
  }

  const char* op_;
  std::vector<ListArg> lists_;
  std::vector<Row> rows_;
  Tasks tasks_;
  std::deque<at::Tensor> kept_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// Walks elements [begin, end) of one row in tiles and calls
// update(float* const* f, n), where f[k] is list k's tile as fp32 (null for
// absent and copy-out lists). Afterwards updated half tiles are narrowed back,
// and a copy-out list receives the final values of its source list.
template <typename Update>
void for_tiles(const RowPlan& plan, const Row& row, int64_t begin, int64_t end, Update&& update) {
  const KernelTable& conv = kernels();
  const int nl = plan.lists();
  // A row of fp32 tensors only needs no tile: the loops run over the whole piece.
  bool converts = false;
  for (int k = 0; k < nl; ++k) {
    const Use use = plan.use(k);
    converts = converts || use == Use::kCopyOut ||
        ((use == Use::kRead || use == Use::kUpdate) && row.dt[k] != kF32);
  }
  const int64_t tile = converts ? kTile : end - begin;
  alignas(64) float scratch[kMaxLists][kTile];
  for (int64_t b = begin; b < end; b += tile) {
    const int64_t n = std::min(tile, end - b);
    float* f[kMaxLists] = {};
    for (int k = 0; k < nl; ++k) {
      const Use use = plan.use(k);
      if (use != Use::kRead && use != Use::kUpdate) {
        continue;
      }
      if (row.dt[k] == kF32) {
        f[k] = static_cast<float*>(offset(row.ptr[k], kF32, b));
      } else {
        conv.copy[row.dt[k]][kF32](offset(row.ptr[k], row.dt[k], b), scratch[k], n);
        f[k] = scratch[k];
      }
    }
    update(static_cast<float* const*>(f), n);
    for (int k = 0; k < nl; ++k) {
      const Use use = plan.use(k);
      if (use == Use::kUpdate && row.dt[k] != kF32) {
        conv.copy[kF32][row.dt[k]](scratch[k], offset(row.ptr[k], row.dt[k], b), n);
      } else if (use == Use::kCopyOut) {
        conv.copy[kF32][row.dt[k]](f[plan.copy_of(k)], offset(row.ptr[k], row.dt[k], b), n);
      }
    }
  }
}

// Runs an elementwise update over every tile of the call, unless noop is set.
template <typename Update>
void run_elementwise(RowPlan& plan, bool skip, const Update& update) {
  if (skip) {
    return;
  }
  const auto& rows = plan.rows();
  plan.run([&](int64_t, const Span& pc) {
    const Row& row = rows[pc.job];
    for_tiles(plan, row, pc.begin, pc.end, [&](float* const* f, int64_t n) {
      update(pc.job, f, n);
    });
  });
  plan.finish();
}

// A per-tensor vector (NovoGrad's grad norms, LAMB's norms) on the CPU.
const float* per_tensor(const at::Tensor& t, size_t n, const char* op, const char* what) {
  AMP_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 &&
                  static_cast<size_t>(t.numel()) == n && t.is_contiguous(),
              "amp_patch::", op, ": ", what, " must be a contiguous 1-D float32 CPU tensor of ", n,
              " elements (one per tensor), got ", t.scalar_type(), " of shape ", t.sizes(), " on ",
              t.device());
  return t.const_data_ptr<float>();
}

// ---------------------------------------------------------------- lean state ops
// multi_tensor_adam_lean_, multi_tensor_sgd_lean_ and the two LAMB stages: the
// work unit is a chunk, a run of whole blocks of one row (a tensor whose rows
// are whole blocks is one long row). Per chunk, the grad, param and decoded state are widened into
// fp32 tiles, the ordinary fp32 loop of the op updates them, and the state is
// encoded again, the param stored (bf16: stochastically rounded) and the model
// copy written. The common rows take the ISA's fused loop instead
// (OptimTable's *_lean_fused: the same steps in registers, bit for bit). The
// chunks are grouped into tasks of about kTaskElems elements, split over the
// threads.

// Elements per chunk when blocks are small: four fp32 tiles stay in L1.
constexpr int64_t kLeanTile = 1024;

// Tensor i of a call, as flat row-major memory.
template <size_t S>
struct LeanTensor {
  const void* g = nullptr;
  Dt g_dt = kF32;
  void* p = nullptr;
  Dt p_dt = kF32;
  void* model = nullptr;  // null: no model copy
  Dt model_dt = kF32;
  std::array<void*, S> code{};
  std::array<float*, S> scale{};
  std::array<optim::StateCode, S> sc{};
  int64_t length = 0;  // of a row; blocks per row = ceil(length / block_size)
  uint32_t key = 0;
};

struct LeanChunk {
  int64_t tensor;
  int64_t begin;  // row * length + offset in the row, at a block boundary
  int64_t block;  // the index of its first block in the scales
  int64_t len;
};

template <size_t S>
class LeanPlan {
 public:
  LeanPlan(const char* op, const optim::LeanLists<S>& l, const optim::LeanHyper& h) : op_(op) {
    const size_t n = l.grads.size();
    for (size_t i = 0; i < n; ++i) {
      check_cpu(l.grads[i], op, "grads");
      check_cpu(l.params[i], op, "params");
      element_type(l.grads[i], op, "grads", i);
      if (!l.model_params.empty()) {
        check_cpu(l.model_params[i], op, "model_params");
        element_type(l.model_params[i], op, "model_params", i);
      }
      for (const optim::LeanStateArg& st : l.states) {
        if (!st.used) {
          continue;
        }
        check_cpu(st.codes[i], op, st.name);
        if (optim::block_scaled(optim::state_code(st.codes[i].scalar_type()))) {
          check_cpu(st.scales[i], op, st.scale_name);
        }
      }
    }
    used_ = {};
    for (size_t k = 0; k < S; ++k) {
      used_[k] = l.states[k].used;
    }
    block_size_ = h.block_size;
  }

  // Lines the tensors up (contiguous stand-ins where needed) and cuts the chunks.
  // An op that writes nothing (`writes` false) gets stand-ins that finish()
  // does not copy back.
  void build(const optim::LeanLists<S>& l, const optim::LeanHyper& h, bool writes = true) {
    auto state_ptr = [&](const at::Tensor& t) {
      return writes ? write_ptr(t, false) : const_cast<void*>(read_ptr(t));
    };
    const size_t n = l.grads.size();
    tensors_.resize(n);
    const int64_t bs = h.block_size;
    const int64_t chunk = bs >= kLeanTile ? bs : (kLeanTile / bs) * bs;
    max_chunk_ = 0;
    for (size_t i = 0; i < n; ++i) {
      LeanTensor<S>& t = tensors_[i];
      const at::Tensor& g = l.grads[i];
      if (g.numel() == 0) {
        continue;
      }
      t.g = read_ptr(g);
      t.g_dt = element_type(g, op_, "grads", i);
      t.p = state_ptr(l.params[i]);
      t.p_dt = element_type(l.params[i], op_, "params", i);
      if (!l.model_params.empty()) {
        t.model = write_ptr(l.model_params[i], true);
        t.model_dt = element_type(l.model_params[i], op_, "model_params", i);
      }
      for (size_t k = 0; k < S; ++k) {
        if (!used_[k]) {
          continue;
        }
        const at::Tensor& c = l.states[k].codes[i];
        t.sc[k] = optim::state_code(c.scalar_type());
        t.code[k] = state_ptr(c);
        if (optim::block_scaled(t.sc[k])) {
          t.scale[k] = l.states[k].scales[i].template mutable_data_ptr<float>();
        }
      }
      t.key = optim::lean_tensor_key(h, static_cast<int64_t>(i));
      auto [rows, length] = optim::lean_rows(g.sizes());
      if (length % bs == 0) {  // whole blocks: the rows run on as one
        length *= rows;
        rows = 1;
      }
      t.length = length;
      const int64_t nb = (length + bs - 1) / bs;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t off = 0; off < length; off += chunk) {
          const int64_t len = std::min(chunk, length - off);
          chunks_.push_back({static_cast<int64_t>(i), r * length + off, r * nb + off / bs, len});
          max_chunk_ = std::max(max_chunk_, len);
        }
      }
    }
    task_begin_.push_back(0);
    int64_t room = kTaskElems;
    for (size_t c = 0; c < chunks_.size(); ++c) {
      room -= chunks_[c].len;
      if (room <= 0) {
        task_begin_.push_back(static_cast<int64_t>(c + 1));
        room = kTaskElems;
      }
    }
    if (task_begin_.back() != static_cast<int64_t>(chunks_.size())) {
      task_begin_.push_back(static_cast<int64_t>(chunks_.size()));
    }
  }

  // Runs f(tensor, chunk, scratch) over every chunk; scratch holds `tiles`
  // fp32 tiles of the longest chunk, one set per thread.
  template <typename F>
  void run(int tiles, const F& f) const {
    const int64_t ntasks = static_cast<int64_t>(task_begin_.size()) - 1;
    if (ntasks <= 0) {
      return;
    }
    at::parallel_for(0, ntasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(tiles * max_chunk_));
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c = task_begin_[t]; c < task_begin_[t + 1]; ++c) {
          const LeanChunk& ch = chunks_[c];
          f(tensors_[ch.tensor], ch, scratch.data(), max_chunk_);
        }
      }
    });
  }

  void finish() {
    for (auto& [user, stand_in] : write_back_) {
      user.copy_(stand_in);
    }
  }

  int64_t block_size() const { return block_size_; }
  size_t chunk_count() const { return chunks_.size(); }
  // The position of a chunk that run() handed out, in the plan's order.
  size_t index_of(const LeanChunk& ch) const { return static_cast<size_t>(&ch - chunks_.data()); }
  int64_t tensor_of(size_t chunk) const { return chunks_[chunk].tensor; }

 private:
  // Row-major memory of a tensor: the tensor, or a contiguous stand-in.
  const void* read_ptr(const at::Tensor& t) {
    if (t.is_contiguous()) {
      return t.const_data_ptr();
    }
    kept_.push_back(t.contiguous());
    return kept_.back().const_data_ptr();
  }

  void* write_ptr(const at::Tensor& t, bool copy_out) {
    if (t.is_contiguous()) {
      return t.data_ptr();
    }
    at::Tensor stand_in = copy_out ? at::empty(t.sizes(), t.options()) : t.contiguous();
    write_back_.emplace_back(t, stand_in);
    kept_.push_back(stand_in);
    return kept_.back().data_ptr();
  }

  const char* op_;
  std::array<bool, S> used_{};
  int64_t block_size_ = 1;
  std::vector<LeanTensor<S>> tensors_;
  std::vector<LeanChunk> chunks_;
  std::vector<int64_t> task_begin_;
  int64_t max_chunk_ = 0;
  std::deque<at::Tensor> kept_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// Widens list memory (element `at` on) into a tile, or points into it when it is fp32.
inline float* lean_in(const KernelTable& conv, const void* mem, Dt dt, int64_t at, int64_t n,
                      float* tile) {
  if (dt == kF32) {
    return const_cast<float*>(static_cast<const float*>(mem) + at);
  }
  conv.copy[dt][kF32](offset(mem, dt, at), tile, n);
  return tile;
}

inline int64_t code_bytes(optim::StateCode c) {
  return c == optim::StateCode::kF32 ? 4 : (c == optim::StateCode::kBF16 ? 2 : 1);
}

// A state list's codes of a chunk, and its scales (null for unscaled codes).
template <size_t S>
inline void* chunk_codes(const LeanTensor<S>& t, int s, const LeanChunk& ch) {
  return t.code[s] != nullptr ? static_cast<char*>(t.code[s]) + ch.begin * code_bytes(t.sc[s])
                              : nullptr;  // an unused state (SGD without momentum)
}

template <size_t S>
inline float* chunk_scales(const LeanTensor<S>& t, int s, const LeanChunk& ch) {
  return t.scale[s] != nullptr ? t.scale[s] + ch.block : nullptr;
}

// A chunk of a tensor as the fused loops take it (a one-state tensor's second
// state null); `writes`: the loop writes the model copy of an fp32 param.
template <size_t S>
inline LeanChunkArgs fused_chunk(const LeanTensor<S>& t, const LeanChunk& ch, bool writes,
                                 float* tiles, int64_t tile, int64_t block_size) {
  const bool model = writes && t.model != nullptr && t.p_dt == kF32;
  void* v_codes = nullptr;
  float* v_scales = nullptr;
  if constexpr (S > 1) {
    v_codes = chunk_codes(t, 1, ch);
    v_scales = chunk_scales(t, 1, ch);
  }
  return {offset(t.g, t.g_dt, ch.begin), offset(t.p, t.p_dt, ch.begin), chunk_codes(t, 0, ch),
          chunk_scales(t, 0, ch), v_codes, v_scales,
          model ? offset(t.model, t.model_dt, ch.begin) : nullptr, t.model_dt, tiles, tile,
          ch.len, block_size, t.key, ch.begin};
}

// The fp32 values of state k of a chunk: the codes decoded into `tile`, or
// the fp32 state where it lies.
template <size_t S>
inline float* lean_decode(const OptimTable& k, const LeanTensor<S>& t, size_t s,
                          const LeanChunk& ch, float* tile, int64_t block_size) {
  void* codes = chunk_codes(t, static_cast<int>(s), ch);
  if (t.sc[s] == optim::StateCode::kF32) {
    return static_cast<float*>(codes);
  }
  k.lean_decode[static_cast<int>(t.sc[s])](codes, chunk_scales(t, static_cast<int>(s), ch), tile,
                                           ch.len, block_size);
  return tile;
}

// As lean_decode, but always into `tile`: the fp32 state is copied, not updated where it lies.
template <size_t S>
inline float* lean_decode_copy(const OptimTable& k, const LeanTensor<S>& t, size_t s,
                               const LeanChunk& ch, float* tile, int64_t block_size) {
  const float* x = lean_decode(k, t, s, ch, tile, block_size);
  if (x != tile) {
    std::copy(x, x + ch.len, tile);
  }
  return tile;
}

template <size_t S>
inline void lean_encode(const OptimTable& k, const LeanTensor<S>& t, size_t s,
                        const LeanChunk& ch, float* values, int64_t block_size) {
  if (t.sc[s] == optim::StateCode::kF32) {
    return;  // updated where it lies
  }
  k.lean_encode[static_cast<int>(t.sc[s])](values, chunk_codes(t, static_cast<int>(s), ch),
                                           chunk_scales(t, static_cast<int>(s), ch), ch.len,
                                           block_size);
}

// The fused tables' index of a state's code: bf16, the state's block-scaled
// code `scaled`, e4m3, fp32; -1 for any other (the tiles serve).
inline int fused_code_index(optim::StateCode c, optim::StateCode scaled) {
  using optim::StateCode;
  return c == StateCode::kBF16   ? 0
         : c == scaled           ? 1
         : c == StateCode::kE4M3 ? 2
         : c == StateCode::kF32  ? 3
                                 : -1;
}

// The fused tables' param index of a tensor, or -1 where the tiles serve it:
// fp16 or fp64 params, fp64 grads, blocks not whole kLeanFusedAlign groups.
template <size_t S>
inline int fused_param_index(const LeanTensor<S>& t, int64_t block_size) {
  if (block_size % kLeanFusedAlign != 0 || t.g_dt > kBF16) {
    return -1;
  }
  return t.p_dt == kF32 ? 0 : (t.p_dt == kBF16 ? 1 : -1);
}

// The fused loop of `table` (OptimTable's adam_lean_fused, lamb_lean_fused,
// ...) for a tensor's dtypes and codes, or null (the tiles serve).
template <typename Loop>
inline Loop fused_lean(const Loop (&table)[3][2][4][4], const LeanTensor<2>& t,
                       int64_t block_size) {
  const int mi = fused_code_index(t.sc[0], optim::StateCode::kInt8);
  const int vi = fused_code_index(t.sc[1], optim::StateCode::kSqrtU8);
  const int pi = fused_param_index(t, block_size);
  return mi < 0 || vi < 0 || pi < 0 ? nullptr : table[t.g_dt][pi][mi][vi];  // null: not compiled
}

// OptimTable's sgd_lean_fused loop for a tensor, or null (the tiles serve).
inline SgdLeanLoop fused_lean(const SgdLeanLoop (&table)[3][2][5], const LeanTensor<1>& t,
                              int64_t block_size) {
  const int pi = fused_param_index(t, block_size);
  if (pi < 0) {
    return nullptr;
  }
  if (t.code[0] == nullptr) {  // momentum 0
    return table[t.g_dt][pi][0];
  }
  const int ci = fused_code_index(t.sc[0], optim::StateCode::kInt8);
  return ci < 0 ? nullptr : table[t.g_dt][pi][ci + 1];
}


// The model copy of a chunk: the param as stored (a bf16 master's own bits,
// an fp16 param's rounded value) rounded to the model's dtype, so that the
// model is always its master rounded; `p` is the fp32 update.
template <size_t S>
inline void lean_model_copy(const KernelTable& conv, const LeanTensor<S>& t, const LeanChunk& ch,
                            const float* p) {
  if (t.model == nullptr) {
    return;
  }
  void* model = offset(t.model, t.model_dt, ch.begin);
  if (t.p_dt == kF32) {
    conv.copy[kF32][t.model_dt](p, model, ch.len);
  } else {
    conv.copy[t.p_dt][t.model_dt](offset(t.p, t.p_dt, ch.begin), model, ch.len);
  }
}

// Runs a fused loop over a chunk, call(args), with its block-scaled states'
// values in the first two scratch tiles. The loop writes an fp32 param's model
// copy; a half param's is made here, from the param as stored.
template <size_t S, typename Call>
inline void run_fused(const KernelTable& conv, const LeanTensor<S>& t, const LeanChunk& ch,
                      float* scratch, int64_t tile, int64_t block_size, const Call& call) {
  call(fused_chunk(t, ch, true, scratch, tile, block_size));
  if (t.p_dt != kF32) {
    lean_model_copy(conv, t, ch, nullptr);
  }
}

// Stores the updated fp32 param (bf16: stochastically rounded) and the model copy.
template <size_t S>
inline void lean_store_param(const OptimTable& k, const KernelTable& conv, const LeanTensor<S>& t,
                             const LeanChunk& ch, const float* p) {
  if (t.p_dt == kBF16) {
    k.stochastic_bf16(p, offset(t.p, kBF16, ch.begin), ch.len, t.key, ch.begin);
  } else if (t.p_dt != kF32) {
    conv.copy[kF32][t.p_dt](p, offset(t.p, t.p_dt, ch.begin), ch.len);
  }
  lean_model_copy(conv, t, ch, p);
}

// The last-level cache's size in bytes (sysconf's, where the C library reports
// it; else 32 MiB).
int64_t last_level_cache_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long bytes = sysconf(name);
    if (bytes > 0) {
      return bytes;
    }
  }
#endif
  return int64_t{32} << 20;
}

// Whether an Adam call's data (28 bytes an element with fp32 params and
// moments) fits in the last-level cache: its loops then divide by the bias
// corrections with a float64 multiply (AdamHyper::multiply_divisions).
// Measured on an Intel Xeon with 260 MiB of L3, one thread: 1.25 M to 5 M
// elements ran 24-29% faster so, 10 M and 20 M elements (from memory) 5-10%
// slower.
bool fits_in_cache(const std::vector<Row>& rows) {
  static const int64_t budget = last_level_cache_bytes();
  int64_t elements = 0;
  for (const Row& row : rows) {
    elements += row.numel;
  }
  return elements * 28 <= budget;
}

// The CPU side of the ops of optim_args.h. The scale and flag are read on the
// host (they live in host memory); the loops come from the ISA's table.
struct CpuBackend {
  template <typename Hyper>
  static Hyper scaled(Hyper h, const optim::Flags& flags, const char* op) {
    h.inv_scale = scale_or_one(flags.inv_scale, op);
    return h;
  }

  // An elementwise op: loop(row, f, n, hyper) over every tile of the call.
  template <size_t N, typename Hyper, typename Loop>
  static void sweep(const char* op, const optim::Lists<N>& lists, const optim::Flags& flags,
                    const Hyper& hyper, const Loop& loop) {
    RowPlan plan(op, lists);
    const Hyper h = scaled(hyper, flags, op);
    run_elementwise(plan, step_skipped(flags.noop, op),
                    [&](int64_t r, float* const* f, int64_t n) { loop(r, f, n, h); });
  }

  // Rows of fp32 params and moments (fp32 masters, or an fp32 model) go to
  // adam_mixed in one pass over the whole piece; the rest through fp32 tiles.
  // device_bc is always null here: CPU bias corrections are read into the hyper-parameters.
  static void adam(const char* op, const optim::Lists<5>& lists, const optim::Flags& flags,
                   const optim::AdamHyper& hyper, const float* /*device_bc*/ = nullptr) {
    RowPlan plan(op, lists);
    optim::AdamHyper h = scaled(hyper, flags, op);
    if (step_skipped(flags.noop, op)) {
      return;
    }
    h.multiply_divisions = fits_in_cache(plan.rows());
    const OptimTable& k = optim_kernels();
    const bool with_model = plan.use(4) == Use::kCopyOut;
    const auto& rows = plan.rows();
    plan.run([&](int64_t, const Span& pc) {
      const Row& row = rows[pc.job];
      const AdamMixedLoop mixed =
          row.dt[1] == kF32 && row.dt[2] == kF32 && row.dt[3] == kF32
              ? k.adam_mixed[row.dt[0]][with_model ? row.dt[4] : kNumDt]
              : nullptr;
      if (mixed != nullptr) {
        auto f32 = [&](int l) { return static_cast<float*>(offset(row.ptr[l], kF32, pc.begin)); };
        mixed(offset(row.ptr[0], row.dt[0], pc.begin), f32(1), f32(2), f32(3),
              with_model ? offset(row.ptr[4], row.dt[4], pc.begin) : nullptr, pc.end - pc.begin, h);
        return;
      }
      for_tiles(plan, row, pc.begin, pc.end, [&](float* const* f, int64_t n) {
        k.adam(f[0], f[1], f[2], f[3], n, h);
      });
    });
    plan.finish();
  }

  // The chunks of a lean op over Adam's two moments: each through the fused
  // loop of `table` where there is one (fused(loop, args, chunk), then the
  // model copy), else through fp32 tiles: the grads, params and decoded
  // moments, update(g, p, m, v, n, chunk) on them, then the moments encoded and
  // the params stored.
  template <typename Loop, typename Fused, typename Update>
  static void run_moment_chunks(const LeanPlan<2>& plan, const Loop (&table)[3][2][4][4],
                                int64_t bs, const Fused& fused, const Update& update) {
    const OptimTable& k = optim_kernels();
    const KernelTable& conv = kernels();
    plan.run(4, [&](const LeanTensor<2>& t, const LeanChunk& ch, float* scratch, int64_t tile) {
      if (const Loop loop = fused_lean(table, t, bs)) {
        run_fused(conv, t, ch, scratch, tile, bs,
                  [&](const LeanChunkArgs& a) { fused(loop, a, ch); });
        return;
      }
      const int64_t n = ch.len;
      const float* g = lean_in(conv, t.g, t.g_dt, ch.begin, n, scratch);
      float* p = lean_in(conv, t.p, t.p_dt, ch.begin, n, scratch + tile);
      float* m = lean_decode(k, t, 0, ch, scratch + 2 * tile, bs);
      float* v = lean_decode(k, t, 1, ch, scratch + 3 * tile, bs);
      update(g, p, m, v, n, ch);
      lean_encode(k, t, 0, ch, m, bs);
      lean_encode(k, t, 1, ch, v, bs);
      lean_store_param(k, conv, t, ch, p);
    });
  }

  // The lean ops (optim_args.h's adam_lean_op / sgd_lean_op, checked there).
  static void adam_lean(const char* op, const optim::LeanLists<2>& lists,
                        const optim::Flags& flags, const optim::AdamHyper& hyper,
                        const optim::LeanHyper& lean) {
    LeanPlan<2> plan(op, lists, lean);
    const optim::AdamHyper h = scaled(hyper, flags, op);
    if (step_skipped(flags.noop, op)) {
      return;
    }
    plan.build(lists, lean);
    const OptimTable& k = optim_kernels();
    run_moment_chunks(
        plan, k.adam_lean_fused, lean.block_size,
        [&](AdamLeanLoop loop, const LeanChunkArgs& a, const LeanChunk&) { loop(a, h); },
        [&](const float* g, float* p, float* m, float* v, int64_t n, const LeanChunk&) {
          k.adam_lean(g, p, m, v, n, h);
        });
    plan.finish();
  }

  static void sgd_lean(const char* op, const optim::LeanLists<1>& lists,
                       const optim::Flags& flags, const optim::SgdHyper& hyper,
                       const optim::LeanHyper& lean) {
    LeanPlan<1> plan(op, lists, lean);
    const optim::SgdHyper h = scaled(hyper, flags, op);
    if (step_skipped(flags.noop, op)) {
      return;
    }
    plan.build(lists, lean);
    const OptimTable& k = optim_kernels();
    const KernelTable& conv = kernels();
    const int64_t bs = lean.block_size;
    const bool with_momentum = lists.states[0].used;
    plan.run(3, [&](const LeanTensor<1>& t, const LeanChunk& ch, float* scratch, int64_t tile) {
      if (const SgdLeanLoop loop = fused_lean(k.sgd_lean_fused, t, bs)) {
        run_fused(conv, t, ch, scratch, tile, bs, [&](const LeanChunkArgs& a) { loop(a, h); });
        return;
      }
      const int64_t n = ch.len;
      const float* g = lean_in(conv, t.g, t.g_dt, ch.begin, n, scratch);
      float* p = lean_in(conv, t.p, t.p_dt, ch.begin, n, scratch + tile);
      float* mom = nullptr;
      if (with_momentum) {
        // A first step sets the buffer to the grad: its old codes are not read.
        mom = h.first_run && t.sc[0] != optim::StateCode::kF32
                  ? scratch + 2 * tile
                  : lean_decode(k, t, 0, ch, scratch + 2 * tile, bs);
      }
      k.sgd(g, p, mom, n, h);
      if (with_momentum) {
        lean_encode(k, t, 0, ch, mom, bs);
      }
      lean_store_param(k, conv, t, ch, p);
    });
    plan.finish();
  }

  // LAMB over lean state. Stage 1 decodes each chunk's moments into tiles,
  // runs the fp32 stage-1 loop on them and keeps only the sums of squares (one
  // pair per chunk, added per tensor in chunk order); stage 2 runs the same
  // loop again (the same new moments, bit for bit), then the fp32 stage-2
  // loop with the tensor's step size, and encodes and stores as the Adam op.
  static std::tuple<at::Tensor, at::Tensor> lamb_lean_moments(
      const char* op, const optim::LeanLists<2>& lists, const optim::Flags& flags,
      const optim::LambLeanArgs& args, const optim::LeanHyper& lean) {
    LeanPlan<2> plan(op, lists, lean);
    const optim::LambHyper h =
        clipped(args.hyper, flags, args.global_grad_norm, args.max_grad_norm, op);
    const int64_t n_tensors = static_cast<int64_t>(lists.grads.size());
    if (step_skipped(flags.noop, op)) {
      return lamb_norms(n_tensors, {}, [](size_t) { return int64_t{0}; });
    }
    plan.build(lists, lean, /*writes=*/false);
    const OptimTable& k = optim_kernels();
    const KernelTable& conv = kernels();
    const int64_t bs = lean.block_size;
    std::vector<std::array<double, 2>> partial(plan.chunk_count(), {0.0, 0.0});
    plan.run(4, [&](const LeanTensor<2>& t, const LeanChunk& ch, float* scratch, int64_t tile) {
      const int64_t n = ch.len;
      double* sums = partial[plan.index_of(ch)].data();
      if (const LambLeanNormsLoop fused = fused_lean(k.lamb_lean_norms_fused, t, bs)) {
        fused(fused_chunk(t, ch, false, nullptr, 0, bs), args.use_ratio, h, sums);
        return;
      }
      const float* g = lean_in(conv, t.g, t.g_dt, ch.begin, n, scratch);
      const float* p =
          args.use_ratio ? lean_in(conv, t.p, t.p_dt, ch.begin, n, scratch + tile) : nullptr;
      float* m = lean_decode_copy(k, t, 0, ch, scratch + 2 * tile, bs);
      float* v = lean_decode_copy(k, t, 1, ch, scratch + 3 * tile, bs);
      k.lamb_moments(g, p, m, v, n, h, sums);
    });
    plan.finish();
    return lamb_norms(n_tensors, partial, [&](size_t c) { return plan.tensor_of(c); });
  }

  static void lamb_lean_apply(const char* op, const optim::LeanLists<2>& lists,
                              const optim::Flags& flags, const optim::LambLeanArgs& args,
                              const at::Tensor& param_norms, const at::Tensor& update_norms,
                              float lr, const optim::LeanHyper& lean) {
    LeanPlan<2> plan(op, lists, lean);
    const optim::LambHyper h =
        clipped(args.hyper, flags, args.global_grad_norm, args.max_grad_norm, op);
    const std::vector<float> ratio =
        lamb_ratios(op, lists.grads.size(), param_norms, update_norms, lr, args.use_ratio);
    if (step_skipped(flags.noop, op)) {
      return;
    }
    plan.build(lists, lean);
    const OptimTable& k = optim_kernels();
    run_moment_chunks(
        plan, k.lamb_lean_fused, lean.block_size,
        [&](LambLeanLoop loop, const LeanChunkArgs& a, const LeanChunk& ch) {
          loop(a, ratio[ch.tensor], h);
        },
        [&](const float* g, float* p, float* m, float* v, int64_t n, const LeanChunk& ch) {
          std::array<double, 2> unused{0.0, 0.0};
          k.lamb_moments(g, args.use_ratio ? p : nullptr, m, v, n, h, unused.data());
          k.lamb_apply(p, m, v, n, ratio[ch.tensor], h);
        });
    plan.finish();
  }

  static void sgd(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                  const optim::SgdHyper& hyper) {
    sweep(op, lists, flags, hyper, [](int64_t, float* const* f, int64_t n, const auto& h) {
      optim_kernels().sgd(f[0], f[1], f[2], n, h);
    });
  }

  static void adagrad(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                      const optim::AdagradHyper& hyper) {
    sweep(op, lists, flags, hyper, [](int64_t, float* const* f, int64_t n, const auto& h) {
      optim_kernels().adagrad(f[0], f[1], f[2], n, h);
    });
  }

  static void novograd(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                       const optim::NovoGradHyper& hyper, const at::Tensor& grad_norms,
                       float bias_correction2, float eps) {
    const size_t n_tensors = lists[0].tensors.size();
    const float* norms = per_tensor(grad_norms, n_tensors, op, "grad_norms");
    std::vector<float> denom(n_tensors);
    for (size_t i = 0; i < n_tensors; ++i) {
      denom[i] = norms[i] / bias_correction2 + eps;
    }
    sweep(op, lists, flags, hyper, [&](int64_t r, float* const* f, int64_t n, const auto& h) {
      optim_kernels().novograd(f[0], f[1], f[2], n, denom[r], h);
    });
  }

  // LAMB's rule with inv_scale read and the global grad-norm clipping divisor set.
  static optim::LambHyper clipped(const optim::LambHyper& hyper, const optim::Flags& flags,
                                  const at::Tensor& global_grad_norm, float max_grad_norm,
                                  const char* op) {
    optim::LambHyper h = scaled(hyper, flags, op);
    const float norm = read_scalar(global_grad_norm, op, "global_grad_norm") * h.inv_scale;
    h.clip = max_grad_norm > 0.0f && norm > max_grad_norm ? norm / max_grad_norm : 1.0f;
    return h;
  }

  // LAMB's per-tensor step size: lr, times ||p|| / ||u|| where the ratio
  // applies and both norms are non-zero.
  static std::vector<float> lamb_ratios(const char* op, size_t n_tensors,
                                        const at::Tensor& param_norms,
                                        const at::Tensor& update_norms, float lr,
                                        bool use_ratio) {
    const float* pn = per_tensor(param_norms, n_tensors, op, "param_norms");
    const float* un = per_tensor(update_norms, n_tensors, op, "update_norms");
    std::vector<float> ratio(n_tensors, lr);
    for (size_t i = 0; use_ratio && i < n_tensors; ++i) {
      if (pn[i] != 0.0f && un[i] != 0.0f) {
        ratio[i] = lr * (pn[i] / un[i]);
      }
    }
    return ratio;
  }

  // Per-tensor norms from partial sums of squares (partial[i] belongs to
  // tensor tensor_of(i)), added in their order: the result does not depend on
  // which thread summed which part.
  template <typename TensorOf>
  static std::tuple<at::Tensor, at::Tensor> lamb_norms(
      int64_t n, const std::vector<std::array<double, 2>>& partial, const TensorOf& tensor_of) {
    std::vector<std::array<double, 2>> sums(n, {0.0, 0.0});
    for (size_t i = 0; i < partial.size(); ++i) {
      sums[tensor_of(i)][0] += partial[i][0];
      sums[tensor_of(i)][1] += partial[i][1];
    }
    const auto fp32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor param_norms = at::zeros({n}, fp32);
    at::Tensor update_norms = at::zeros({n}, fp32);
    float* pn = param_norms.mutable_data_ptr<float>();
    float* un = update_norms.mutable_data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      pn[i] = static_cast<float>(std::sqrt(sums[i][0]));
      un[i] = static_cast<float>(std::sqrt(sums[i][1]));
    }
    return {param_norms, update_norms};
  }

  static std::tuple<at::Tensor, at::Tensor> lamb_moments(
      const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
      const optim::LambHyper& hyper, const at::Tensor& global_grad_norm, float max_grad_norm) {
    RowPlan plan(op, lists);
    const optim::LambHyper h = clipped(hyper, flags, global_grad_norm, max_grad_norm, op);
    const int64_t n = static_cast<int64_t>(lists[0].tensors.size());
    if (step_skipped(flags.noop, op)) {
      return lamb_norms(n, {}, [](size_t) { return int64_t{0}; });
    }
    // One pair of partial sums per piece, added per tensor in piece order: the
    // result does not depend on the thread count.
    std::vector<std::array<double, 2>> partial(plan.pieces().size(), {0.0, 0.0});
    const OptimTable& k = optim_kernels();
    const auto& rows = plan.rows();
    plan.run([&](int64_t s, const Span& pc) {
      for_tiles(plan, rows[pc.job], pc.begin, pc.end, [&](float* const* f, int64_t len) {
        k.lamb_moments(f[0], f[1], f[2], f[3], len, h, partial[s].data());
      });
    });
    plan.finish();
    return lamb_norms(n, partial, [&](size_t i) { return plan.pieces()[i].job; });
  }

  static void lamb_apply(const char* op, const optim::Lists<4>& lists, const optim::Flags& flags,
                         const optim::LambHyper& hyper, const at::Tensor& param_norms,
                         const at::Tensor& update_norms, float lr, bool use_ratio) {
    const std::vector<float> ratio =
        lamb_ratios(op, lists[0].tensors.size(), param_norms, update_norms, lr, use_ratio);
    sweep(op, lists, flags, hyper, [&](int64_t r, float* const* f, int64_t n, const auto& h) {
      optim_kernels().lamb_apply(f[0], f[1], f[2], n, ratio[r], h);
    });
  }
};

}  // namespace
}  // namespace amp_patch::cpu

namespace amp_patch::cpu {

// adam_device_step_ on the CPU: the counter and the flag are read and written
// here, and the corrections are the host step's (optim::bias_correction), so
// that a device-kept counter gives the bits of a host int.
at::Tensor adam_device_step_cpu(const at::Tensor& step, const at::Tensor& found_inf,
                                const at::Tensor& betas, bool bias_correction) {
  constexpr const char* op = "adam_device_step_";
  check_cpu(step, op, "step");
  check_cpu(found_inf, op, "found_inf");
  check_cpu(betas, op, "betas");
  optim::check_device_step_args(op, step, found_inf, betas);
  const bool clean = *found_inf.const_data_ptr<float>() == 0.0f;  // NaN skips too
  double count = 0.0;
  AT_DISPATCH_ALL_TYPES(step.scalar_type(), op, [&] {
    scalar_t* counter = step.data_ptr<scalar_t>();
    if (clean) {
      *counter += scalar_t(1);
    }
    count = static_cast<double>(*counter);
  });
  at::Tensor out = at::empty({2}, step.options().dtype(at::kFloat));
  float* bc = out.data_ptr<float>();
  const double* beta = betas.const_data_ptr<double>();
  for (int i = 0; i < 2; ++i) {
    bc[i] = bias_correction ? static_cast<float>(1.0 - std::pow(beta[i], count)) : 1.0f;
  }
  return out;
}

}  // namespace amp_patch::cpu

TORCH_LIBRARY_IMPL(amp_patch, CPU, m) {
  using amp_patch::cpu::CpuBackend;
  m.impl("adam_device_step_", &amp_patch::cpu::adam_device_step_cpu);
  namespace optim = amp_patch::optim;
  m.impl("multi_tensor_adam_", &optim::adam_op<CpuBackend>);
  m.impl("multi_tensor_sgd_", &optim::sgd_op<CpuBackend>);
  m.impl("multi_tensor_adagrad_", &optim::adagrad_op<CpuBackend>);
  m.impl("multi_tensor_novograd_", &optim::novograd_op<CpuBackend>);
  m.impl("multi_tensor_lamb_stage1_", &optim::lamb_stage1_op<CpuBackend>);
  m.impl("multi_tensor_lamb_stage2_", &optim::lamb_stage2_op<CpuBackend>);
  m.impl("multi_tensor_adam_lean_", &optim::adam_lean_op<CpuBackend>);
  m.impl("multi_tensor_sgd_lean_", &optim::sgd_lean_op<CpuBackend>);
  m.impl("multi_tensor_lamb_lean_stage1_", &optim::lamb_lean_stage1_op<CpuBackend>);
  m.impl("multi_tensor_lamb_lean_stage2_", &optim::lamb_lean_stage2_op<CpuBackend>);
}

// The hot path of the O1 casting wrappers, in the CPython API.
//
// amp_patch/patching/wrappers.py builds, for every patched op, a Python wrapper
// that implements the whole policy. When this extension is loaded, the object
// installed on the attribute is a CastWrapper around that Python wrapper: it
// scans the arguments, casts plain tensors and looks weights up in the
// session's weight cache itself, and calls the original through vectorcall.
// Whatever it does not handle goes to the Python wrapper unchanged (the
// "fallback"), so both paths make the same decisions by construction:
//   - tensors nested in lists, tuples or dicts that need a cast;
//   - tensor subclasses (FakeTensor and FunctionalTensor under torch.compile,
//     user subclasses with __torch_function__);
//   - an active TorchFunctionMode (a cast from Python would reach it);
//   - refusals (banned ops on half inputs, fp32 in-place ops on half tensors)
//     and sequence promotion with mixed dtypes.
//
// The weight cache stays a Python object (amp_patch/patching/cache.py): on a
// hit this reads its entry; on a miss of a param it has seen before it makes
// the cast and writes the entry and counters as WeightCastCache._make would,
// and otherwise calls _make, so the entries and counters are the same whichever
// path made them. The entry layout is cache._Entry (WeightCastCache.ENTRY):
// (cast, version, data_ptr, made_with_grad), keyed by (id(param), dtype).
#include "o1_wrappers.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <vector>

namespace amp_patch::o1 {
namespace {

// The order of Policy in wrappers.py (_NATIVE_POLICY).
enum Policy : int {
  kHalf = 0,
  kFp32 = 1,
  kPromote = 2,
  kSequencePromote = 3,
  kBanned = 4,
  kInPlaceFp32 = 5,
  kInPlace = 6,
  // kPromote for an op whose own type promotion computes what the cast to the
  // widest would (lists.NATIVE_PROMOTION): see promotes_natively.
  kNativePromote = 7,
};

// One bit per dtype that O1 casts from or to.
enum : unsigned { kBitF32 = 1u, kBitF16 = 2u, kBitBF16 = 4u };
constexpr unsigned kCastable = kBitF32 | kBitF16 | kBitBF16;
constexpr unsigned kHalves = kBitF16 | kBitBF16;
// Deeper nesting than this is left to the Python wrapper.
constexpr int kMaxDepth = 8;

inline unsigned dtype_bit(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kBitF32;
    case at::kHalf:
      return kBitF16;
    case at::kBFloat16:
      return kBitBF16;
    default:
      return 0;
  }
}

inline at::ScalarType bit_dtype(unsigned bit) {
  return bit == kBitF32 ? at::kFloat : bit == kBitF16 ? at::kHalf : at::kBFloat16;
}

PyObject* s_enabled = nullptr;
PyObject* s_entries = nullptr;
PyObject* s_make = nullptr;
PyObject* s_out = nullptr;
PyObject* s_tensors = nullptr;
PyObject* s_refs = nullptr;
PyObject* s_entry_type = nullptr;
PyObject* s_casts = nullptr;
PyObject* s_digest = nullptr;
PyObject* s_digest_multiplier = nullptr;
PyObject* s_digest_mod = nullptr;
// torch.float32, torch.float16, torch.bfloat16, indexed by the bit's position.
PyObject* g_dtype_objects[3] = {nullptr, nullptr, nullptr};

PyObject* dtype_object(unsigned bit) {
  return g_dtype_objects[bit == kBitF32 ? 0 : bit == kBitF16 ? 1 : 2];
}

struct CastWrapper {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* dict;
  PyObject* original;
  PyObject* fallback;
  PyObject* state;
  PyObject* cache;
  int policy;
  unsigned target_bit;  // kHalf: the session's half dtype; kFp32: fp32; else 0
};

// What a scan of the arguments found.
struct Scan {
  unsigned top = 0;     // dtype bits of the positional and keyword tensors
  unsigned nested = 0;  // dtype bits of tensors inside lists, tuples and dicts
  bool python = false;  // something only the Python wrapper handles
};

inline bool is_plain_scalar(PyTypeObject* tp) {
  return tp == &PyLong_Type || tp == &PyFloat_Type || tp == &PyBool_Type ||
      tp == &PyUnicode_Type || tp == Py_TYPE(Py_None);
}

inline bool is_tensor_subclass(PyObject* obj) {
  return PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// Adds the dtype bits of the tensors in obj (nested lists, tuples and dicts) to
// scan->nested; sets scan->python for a tensor subclass or too deep a nesting.
void collect(PyObject* obj, Scan* scan, int depth) {
  PyTypeObject* tp = Py_TYPE(obj);
  if (THPVariable_CheckTypeExact(tp)) {
    scan->nested |= dtype_bit(THPVariable_Unpack(obj).scalar_type());
    return;
  }
  if (is_plain_scalar(tp)) {
    return;
  }
  if (PyList_Check(obj) || PyTuple_Check(obj) || PyDict_Check(obj)) {
    if (depth >= kMaxDepth) {
      scan->python = true;
      return;
    }
    if (PyDict_Check(obj)) {
      Py_ssize_t pos = 0;
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      while (!scan->python && PyDict_Next(obj, &pos, &key, &value)) {
        collect(value, scan, depth + 1);
      }
      return;
    }
    // PySequence_Fast_ITEMS covers lists and tuples (subclasses included) without copying.
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < n && !scan->python; ++i) {
      collect(items[i], scan, depth + 1);
    }
    return;
  }
  if (is_tensor_subclass(obj)) {
    scan->python = true;
  }
}

inline bool is_out(PyObject* kwnames, Py_ssize_t k) {
  PyObject* name = PyTuple_GET_ITEM(kwnames, k);
  return name == s_out || PyUnicode_Compare(name, s_out) == 0;
}

// Scans args[first:] and the keyword values (but out=, which receives the result).
Scan scan_args(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, Py_ssize_t first) {
  Scan scan;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = first; i < nargs + nkw && !scan.python; ++i) {
    if (i >= nargs && is_out(kwnames, i - nargs)) {
      continue;
    }
    PyObject* obj = args[i];
    PyTypeObject* tp = Py_TYPE(obj);
    if (THPVariable_CheckTypeExact(tp)) {
      scan.top |= dtype_bit(THPVariable_Unpack(obj).scalar_type());
    } else if (!is_plain_scalar(tp)) {
      collect(obj, &scan, 0);
    }
  }
  return scan;
}

struct GilRelease {
  PyThreadState* saved;
  GilRelease() : saved(PyEval_SaveThread()) {}
  ~GilRelease() {
    PyEval_RestoreThread(saved);
  }
};

// A new reference to tensor obj cast to the dtype of `bit` (torch's bindings also
// cast without the GIL).
PyObject* plain_cast(PyObject* obj, unsigned bit) {
  HANDLE_TH_ERRORS
  const at::Tensor& t = THPVariable_Unpack(obj);
  at::Tensor out;
  {
    GilRelease no_gil;
    out = t.to(bit_dtype(bit));
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// WeightCastCache._make's common case, in C: the cache enabled and the param
// seen before (its weak reference made by an earlier miss, in Python). Makes
// the cast and writes the same entry (a cache._Entry) and counters as _make.
// Returns a new reference to the cast; nullptr with no error set leaves the
// miss to _make.
PyObject* make_entry(CastWrapper* self, PyObject* obj, unsigned bit, PyObject* id, PyObject* key,
                     PyObject* entries) {
  PyObject* enabled = PyObject_GetAttr(self->cache, s_enabled);
  if (enabled == nullptr) {
    return nullptr;
  }
  const int on = PyObject_IsTrue(enabled);
  Py_DECREF(enabled);
  PyObject* refs = on > 0 ? PyObject_GetAttr(self->cache, s_refs) : nullptr;
  if (refs == nullptr) {
    return nullptr;
  }
  const int known = PyDict_Check(refs) ? PyDict_Contains(refs, id) : 0;
  Py_DECREF(refs);
  PyObject* entry_type = known > 0 ? PyObject_GetAttr(self->cache, s_entry_type) : nullptr;
  if (entry_type == nullptr) {
    return nullptr;
  }
  PyObject* cast = PyType_Check(entry_type) ? plain_cast(obj, bit) : nullptr;
  PyObject* entry = nullptr;
  if (cast != nullptr) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    PyObject* values = Py_BuildValue("(OLNO)", cast, static_cast<long long>(t._version()),
                                     PyLong_FromVoidPtr(t.data_ptr()),
                                     at::GradMode::is_enabled() ? Py_True : Py_False);
    // tuple.__new__(_Entry, values): the named tuple without its Python __new__.
    PyObject* new_args = values ? PyTuple_Pack(1, values) : nullptr;
    entry = new_args ? PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(entry_type), new_args,
                                           nullptr)
                     : nullptr;
    Py_XDECREF(new_args);
    Py_XDECREF(values);
  }
  Py_DECREF(entry_type);
  bool ok = entry != nullptr && PyDict_SetItem(entries, key, entry) == 0;
  Py_XDECREF(entry);
  // casts += 1; digest = (digest * DIGEST_MULTIPLIER + numel + 1) % DIGEST_MOD, as _make.
  PyObject* casts = ok ? PyObject_GetAttr(self->cache, s_casts) : nullptr;
  PyObject* digest = ok && casts ? PyObject_GetAttr(self->cache, s_digest) : nullptr;
  PyObject* mult = digest ? PyObject_GetAttr(self->cache, s_digest_multiplier) : nullptr;
  PyObject* mod = mult ? PyObject_GetAttr(self->cache, s_digest_mod) : nullptr;
  ok = mod != nullptr;
  if (ok) {
    const long long c = PyLong_AsLongLong(casts);
    const long long d = PyLong_AsLongLong(digest);
    const long long k = PyLong_AsLongLong(mult);
    const long long q = PyLong_AsLongLong(mod);
    const long long n = THPVariable_Unpack(obj).numel();
    ok = !PyErr_Occurred() && q > 0;
    if (ok) {
      const auto next = static_cast<long long>(
          (static_cast<__int128>(d) * k + n + 1) % static_cast<__int128>(q));
      PyObject* c1 = PyLong_FromLongLong(c + 1);
      PyObject* d1 = PyLong_FromLongLong(next);
      ok = c1 && d1 && PyObject_SetAttr(self->cache, s_casts, c1) == 0 &&
          PyObject_SetAttr(self->cache, s_digest, d1) == 0;
      Py_XDECREF(c1);
      Py_XDECREF(d1);
    }
  }
  Py_XDECREF(casts);
  Py_XDECREF(digest);
  Py_XDECREF(mult);
  Py_XDECREF(mod);
  if (!ok) {
    Py_XDECREF(cast);
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_RuntimeError, "amp_patch O1: the weight cache's layout changed");
    }
    return nullptr;
  }
  return cast;
}

// WeightCastCache.lookup(param, dtype), reading the Python cache's entries.
PyObject* cached_cast(CastWrapper* self, PyObject* obj, unsigned bit) {
  HANDLE_TH_ERRORS
  PyObject* dtype = dtype_object(bit);
  PyObject* entries = PyObject_GetAttr(self->cache, s_entries);
  if (entries == nullptr) {
    return nullptr;
  }
  PyObject* result = nullptr;
  PyObject* id = PyLong_FromVoidPtr(obj);
  PyObject* key = id ? PyTuple_Pack(2, id, dtype) : nullptr;
  PyObject* entry = key && PyDict_Check(entries) ? PyDict_GetItemWithError(entries, key) : nullptr;
  if (entry != nullptr && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) >= 4) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    const long long version = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
    void* ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 2));
    const int with_grad = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 3));
    if (!PyErr_Occurred() && version == t._version() && ptr == t.data_ptr() &&
        (with_grad || !at::GradMode::is_enabled())) {
      result = PyTuple_GET_ITEM(entry, 0);
      Py_INCREF(result);
    }
  }
  if (result == nullptr && key != nullptr && !PyErr_Occurred() && PyDict_Check(entries)) {
    result = make_entry(self, obj, bit, id, key, entries);
  }
  if (result == nullptr && !PyErr_Occurred()) {
    result = PyObject_CallMethodObjArgs(self->cache, s_make, obj, dtype, nullptr);
  }
  Py_XDECREF(key);
  Py_XDECREF(id);
  Py_DECREF(entries);
  return result;
  END_HANDLE_TH_ERRORS
}

// Whether torch's own type promotion gives the op exactly what casting to the
// widest dtype would: two plain tensors, both fp32, fp16 or bf16, and both
// 0-dim or neither (a 0-dim tensor does not promote a dimensioned one). The
// elementwise ops widen each element exactly, so the values are the same, and
// on the grads' way back autograd narrows as the cast's backward would.
bool promotes_natively(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  int tensors = 0;
  bool zero_dim[2] = {false, false};
  for (Py_ssize_t i = 0; i < total; ++i) {
    if (i >= nargs && is_out(kwnames, i - nargs)) {
      continue;
    }
    PyObject* obj = args[i];
    if (!THPVariable_CheckTypeExact(Py_TYPE(obj))) {
      if (is_plain_scalar(Py_TYPE(obj))) {
        continue;
      }
      return false;  // a container or another object: as the Python wrapper, cast
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (tensors == 2 || dtype_bit(t.scalar_type()) == 0) {
      return false;
    }
    zero_dim[tensors++] = t.dim() == 0;
  }
  return tensors == 2 && zero_dim[0] == zero_dim[1];
}

PyObject* call_fallback(CastWrapper* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

// Calls the original with every plain tensor of args[first:] and the keyword
// values (but out=) whose bit is in `from` cast to the dtype of `to`; fp32
// leaves that require grad go through the weight cache when use_cache.
PyObject* call_cast(CastWrapper* self, PyObject* const* args, size_t nargsf, PyObject* kwnames,
                    Py_ssize_t first, unsigned from, unsigned to, bool use_cache) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  PyObject* small[16];
  std::vector<PyObject*> large;
  PyObject** cast = small;
  if (total > 16) {
    large.resize(total);
    cast = large.data();
  }
  PyObject* result = nullptr;
  bool failed = false;
  for (Py_ssize_t i = 0; i < total; ++i) {
    PyObject* obj = args[i];
    cast[i] = obj;
    if (i < first || failed || (i >= nargs && is_out(kwnames, i - nargs)) ||
        !THPVariable_CheckTypeExact(Py_TYPE(obj))) {
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    const unsigned bit = dtype_bit(t.scalar_type());
    if (!(bit & from)) {
      continue;
    }
    PyObject* out = (use_cache && bit == kBitF32 && self->cache != Py_None && t.requires_grad() &&
                     t.is_leaf())
        ? cached_cast(self, obj, to)
        : plain_cast(obj, to);
    if (out == nullptr) {
      failed = true;
      continue;
    }
    cast[i] = out;  // owned: released below
  }
  if (!failed) {
    result = PyObject_Vectorcall(self->original, cast, nargs, kwnames);
  }
  for (Py_ssize_t i = first; i < total; ++i) {
    if (cast[i] != args[i]) {
      Py_DECREF(cast[i]);
    }
  }
  return result;
}

PyObject* wrapper_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<CastWrapper*>(self_);
  PyObject* enabled = PyObject_GetAttr(self->state, s_enabled);
  if (enabled == nullptr) {
    return nullptr;
  }
  const int on = enabled == Py_True ? 1 : enabled == Py_False ? 0 : PyObject_IsTrue(enabled);
  Py_DECREF(enabled);
  if (on < 0) {
    return nullptr;
  }
  if (!on) {
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
  }
  if (at::impl::torch_function_mode_enabled()) {
    return call_fallback(self, args, nargsf, kwnames);
  }
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  switch (self->policy) {
    case kHalf:
    case kFp32: {
      const unsigned from = kCastable & ~self->target_bit;
      const Scan scan = scan_args(args, nargs, kwnames, 0);
      if (scan.python || (scan.nested & from)) {
        return call_fallback(self, args, nargsf, kwnames);
      }
      if (!(scan.top & from)) {
        break;
      }
      return call_cast(self, args, nargsf, kwnames, 0, from, self->target_bit,
                       self->policy == kHalf);
    }
    case kPromote:
    case kNativePromote: {
      const Scan scan = scan_args(args, nargs, kwnames, 0);
      const unsigned seen = scan.top | scan.nested;
      if (scan.python) {
        return call_fallback(self, args, nargsf, kwnames);
      }
      // One castable dtype (or none): nothing to promote.
      if (seen == 0 || (seen & (seen - 1)) == 0) {
        break;
      }
      if (scan.nested) {
        return call_fallback(self, args, nargsf, kwnames);
      }
      if (self->policy == kNativePromote && promotes_natively(args, nargs, kwnames)) {
        break;
      }
      // Two or more of fp32, fp16, bf16: the widest is fp32 (fp16 with bf16 included).
      return call_cast(self, args, nargsf, kwnames, 0, kHalves, kBitF32, false);
    }
    case kSequencePromote: {
      PyObject* seq = nargs > 0 ? args[0] : nullptr;
      if (seq == nullptr && kwnames != nullptr) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); ++k) {
          if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, k), s_tensors) == 0) {
            seq = args[nargs + k];
          }
        }
      }
      if (seq == nullptr) {
        break;
      }
      Scan scan;
      collect(seq, &scan, 0);
      const unsigned seen = scan.nested;
      if (scan.python || (seen & (seen - 1)) != 0) {
        return call_fallback(self, args, nargsf, kwnames);
      }
      break;
    }
    case kBanned: {
      const Scan scan = scan_args(args, nargs, kwnames, 0);
      if (scan.python || ((scan.top | scan.nested) & kHalves)) {
        return call_fallback(self, args, nargsf, kwnames);
      }
      break;
    }
    case kInPlaceFp32:
    case kInPlace: {
      if (nargs == 0) {
        break;
      }
      PyObject* this_ = args[0];
      if (!THPVariable_CheckTypeExact(Py_TYPE(this_))) {
        if (is_tensor_subclass(this_)) {
          return call_fallback(self, args, nargsf, kwnames);
        }
        break;
      }
      const unsigned bit = dtype_bit(THPVariable_Unpack(this_).scalar_type());
      if (bit == 0) {
        break;
      }
      if (self->policy == kInPlaceFp32 && bit != kBitF32) {
        return call_fallback(self, args, nargsf, kwnames);  // it raises
      }
      const unsigned from = kCastable & ~bit;
      const Scan scan = scan_args(args, nargs, kwnames, 1);
      if (scan.python || (scan.nested & from)) {
        return call_fallback(self, args, nargsf, kwnames);
      }
      if (!(scan.top & from)) {
        break;
      }
      return call_cast(self, args, nargsf, kwnames, 1, from, bit, false);
    }
    default:
      return call_fallback(self, args, nargsf, kwnames);
  }
  return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

int wrapper_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<CastWrapper*>(self_);
  Py_VISIT(self->dict);
  Py_VISIT(self->original);
  Py_VISIT(self->fallback);
  Py_VISIT(self->state);
  Py_VISIT(self->cache);
  return 0;
}

int wrapper_clear(PyObject* self_) {
  auto* self = reinterpret_cast<CastWrapper*>(self_);
  Py_CLEAR(self->dict);
  Py_CLEAR(self->original);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->state);
  Py_CLEAR(self->cache);
  return 0;
}

void wrapper_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  wrapper_clear(self);
  Py_TYPE(self)->tp_free(self);
}

// A method on a class (Tensor.softmax): bind like a function. With
// Py_TPFLAGS_METHOD_DESCRIPTOR, x.softmax(0) skips this and calls with x first.
PyObject* wrapper_descr_get(PyObject* self, PyObject* obj, PyObject*) {
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  return PyMethod_New(self, obj);
}

PyObject* wrapper_repr(PyObject* self_) {
  auto* self = reinterpret_cast<CastWrapper*>(self_);
  return PyUnicode_FromFormat("<amp_patch O1 wrapper of %R>", self->original);
}

PyObject* wrapper_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"original", "fallback", "state", "cache", "policy", "target",
                                 nullptr};
  PyObject* original = nullptr;
  PyObject* fallback = nullptr;
  PyObject* state = nullptr;
  PyObject* cache = nullptr;
  int policy = 0;
  PyObject* target = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOiO:CastWrapper", const_cast<char**>(kwlist),
                                   &original, &fallback, &state, &cache, &policy, &target)) {
    return nullptr;
  }
  if (!PyCallable_Check(original) || !PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "CastWrapper: original and fallback must be callable");
    return nullptr;
  }
  if (policy < kHalf || policy > kNativePromote) {
    PyErr_Format(PyExc_ValueError, "CastWrapper: policy must be 0..7, got %d", policy);
    return nullptr;
  }
  unsigned target_bit = 0;
  if (target != Py_None) {
    target_bit = THPDtype_Check(target)
        ? dtype_bit(reinterpret_cast<THPDtype*>(target)->scalar_type)
        : 0;
    if (target_bit == 0) {
      PyErr_Format(PyExc_TypeError,
                   "CastWrapper: target must be torch.float32, float16, bfloat16 or None, got %R",
                   target);
      return nullptr;
    }
  }
  if ((policy == kHalf || policy == kFp32) && target_bit == 0) {
    PyErr_SetString(PyExc_ValueError, "CastWrapper: the half and fp32 policies need a target dtype");
    return nullptr;
  }
  auto* self = reinterpret_cast<CastWrapper*>(type->tp_alloc(type, 0));
  if (self == nullptr) {
    return nullptr;
  }
  self->vectorcall = wrapper_call;
  self->dict = nullptr;
  Py_INCREF(original);
  self->original = original;
  Py_INCREF(fallback);
  self->fallback = fallback;
  Py_INCREF(state);
  self->state = state;
  Py_INCREF(cache);
  self->cache = cache;
  self->policy = policy;
  self->target_bit = target_bit;
  return reinterpret_cast<PyObject*>(self);
}

// __dict__ as a data descriptor, so that inspect.getattr_static sees the instance attributes.
PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject CastWrapperType = {PyVarObject_HEAD_INIT(nullptr, 0)};

int intern(PyObject** slot, const char* text) {
  *slot = PyUnicode_InternFromString(text);
  return *slot ? 0 : -1;
}

int load_dtypes() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) {
    return -1;
  }
  const char* names[3] = {"float32", "float16", "bfloat16"};
  for (int i = 0; i < 3; ++i) {
    g_dtype_objects[i] = PyObject_GetAttrString(torch, names[i]);
    if (g_dtype_objects[i] == nullptr) {
      Py_DECREF(torch);
      return -1;
    }
  }
  Py_DECREF(torch);
  return 0;
}

}  // namespace

int add_types(PyObject* module) {
  if (intern(&s_enabled, "enabled") || intern(&s_entries, "_entries") ||
      intern(&s_make, "_make") || intern(&s_out, "out") || intern(&s_tensors, "tensors") ||
      intern(&s_refs, "_refs") || intern(&s_entry_type, "ENTRY") || intern(&s_casts, "casts") ||
      intern(&s_digest, "digest") || intern(&s_digest_multiplier, "DIGEST_MULTIPLIER") ||
      intern(&s_digest_mod, "DIGEST_MOD") ||
      load_dtypes()) {
    return -1;
  }
  CastWrapperType.tp_name = "amp_patch._C.CastWrapper";
  CastWrapperType.tp_doc =
      "CastWrapper(original, fallback, state, cache, policy, target)\n\n"
      "An O1 casting wrapper: casts the arguments of `original` by `policy` (the index\n"
      "of amp_patch.patching.wrappers.Policy, or 7: PROMOTE left to torch's own type\n"
      "promotion where it is exact) and calls it; hands anything it does not\n"
      "handle itself to the Python wrapper `fallback`, which implements the same policy.";
  CastWrapperType.tp_basicsize = sizeof(CastWrapper);
  CastWrapperType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
      Py_TPFLAGS_METHOD_DESCRIPTOR;
  CastWrapperType.tp_new = wrapper_new;
  CastWrapperType.tp_dealloc = wrapper_dealloc;
  CastWrapperType.tp_traverse = wrapper_traverse;
  CastWrapperType.tp_clear = wrapper_clear;
  CastWrapperType.tp_call = PyVectorcall_Call;
  CastWrapperType.tp_vectorcall_offset = offsetof(CastWrapper, vectorcall);
  CastWrapperType.tp_descr_get = wrapper_descr_get;
  CastWrapperType.tp_dictoffset = offsetof(CastWrapper, dict);
  CastWrapperType.tp_getattro = PyObject_GenericGetAttr;
  CastWrapperType.tp_setattro = PyObject_GenericSetAttr;
  CastWrapperType.tp_repr = wrapper_repr;
  CastWrapperType.tp_getset = wrapper_getset;
  if (PyType_Ready(&CastWrapperType) < 0) {
    return -1;
  }
  Py_INCREF(&CastWrapperType);
  if (PyModule_AddObject(module, "CastWrapper", reinterpret_cast<PyObject*>(&CastWrapperType)) < 0) {
    Py_DECREF(&CastWrapperType);
    return -1;
  }
  return 0;
}

}  // namespace amp_patch::o1

// Conversions between C++ vectors and 1-D numpy arrays at the Python boundary, without
// per-element Python objects. Shared by the cache manager and scheduler bindings.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kv_cache_types.h"

namespace kvtool {

namespace nb = nanobind;

template <typename T>
using NumpyArray1D = nb::ndarray<nb::numpy, T, nb::ndim<1>>;

// A parameter type that accepts any object, so that to_vector can name a bad argument in its
// error; its name is what the stubs show.
inline bool accept_any(PyObject*) { return true; }
struct IntArrayLike : nb::object {
  NB_OBJECT_DEFAULT(IntArrayLike, nb::object, "numpy.ndarray | list[int]", accept_any)
};

// Moves the vector onto the heap; the numpy array owns it (freed with the array).
template <typename T>
NumpyArray1D<T> to_numpy(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray1D<T>(owned->data(), {owned->size()}, owner);
}

// A 1-D integer sequence (numpy array of any integer dtype, or a list of ints) as a vector of T.
// Throws std::invalid_argument naming `name` when obj is not one, or a value does not fit T.
// A list or tuple of exact ints read with the C API, several times faster than try_cast per item
// (a 2k-token prompt is converted twice per bench request: pre-check and admission). False, with
// `out` unspecified, when an item is not an exact int or does not fit T: the caller falls back.
// The value of an int that CPython stores in one digit (below 2**30 in magnitude: every token id),
// read from the object without a call; false for a larger one (the caller asks the C API).
inline bool one_digit_int_value(PyObject* item, long long& value) {
#if PY_VERSION_HEX >= 0x030C0000
  auto* number = reinterpret_cast<PyLongObject*>(item);
  if (!PyUnstable_Long_IsCompact(number)) return false;
  value = static_cast<long long>(PyUnstable_Long_CompactValue(number));
  return true;
#elif PY_VERSION_HEX >= 0x030B0000 && !defined(Py_LIMITED_API)
  const Py_ssize_t size = Py_SIZE(item);  // the number of digits, negative for a negative int
  if (size < -1 || size > 1) return false;
  value = size == 0 ? 0 : static_cast<long long>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]) * size;
  return true;
#else
  (void)item;
  (void)value;
  return false;
#endif
}

// An exact int's value (a bool or another subclass is no token id); false when it is something
// else or does not fit a long long.
inline bool exact_int_value(PyObject* item, long long& value) {
  if (!PyLong_CheckExact(item)) return false;
  if (one_digit_int_value(item, value)) return true;
  int overflow = 0;
  value = PyLong_AsLongLongAndOverflow(item, &overflow);
  return overflow == 0;
}

template <typename T>
bool fast_sequence_to_vector(PyObject* sequence, std::vector<T>& out) {
  const bool is_list = PyList_CheckExact(sequence);
  const Py_ssize_t n = is_list ? PyList_GET_SIZE(sequence) : PyTuple_GET_SIZE(sequence);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = is_list ? PyList_GET_ITEM(sequence, i) : PyTuple_GET_ITEM(sequence, i);
    long long value = 0;
    if (!exact_int_value(item, value)) return false;
    if (value < 0 || (sizeof(T) == 4 && value > static_cast<long long>(INT32_MAX))) return false;
    out[static_cast<size_t>(i)] = static_cast<T>(value);
  }
  return true;
}

template <typename T>
std::vector<T> to_vector(nb::handle obj, const char* name) {
  if (PyList_CheckExact(obj.ptr()) || PyTuple_CheckExact(obj.ptr())) {
    std::vector<T> out;
    if (fast_sequence_to_vector(obj.ptr(), out)) return out;
  }
  using Array = nb::ndarray<const T, nb::ndim<1>, nb::device::cpu>;
  Array array;
  bool is_array = nb::try_cast(obj, array, /*convert=*/false);
  if (!is_array) {
    // Another integer dtype (numpy's default int64, say) is converted; floats are refused.
    nb::ndarray<nb::ndim<1>, nb::device::cpu> any_array;
    if (nb::try_cast(obj, any_array, /*convert=*/false)) {
      const auto code = static_cast<nb::dlpack::dtype_code>(any_array.dtype().code);
      if (code != nb::dlpack::dtype_code::Int && code != nb::dlpack::dtype_code::UInt) {
        throw std::invalid_argument(std::string(name) + " must be an integer array; got a non-integer dtype");
      }
      is_array = nb::try_cast(obj, array, /*convert=*/true);
    }
  }
  if (is_array) {
    const T* data = array.data();
    const size_t n = array.shape(0);
    const int64_t stride = array.stride(0);
    if (stride == 1) return std::vector<T>(data, data + n);  // one pass, no zero-fill first
    std::vector<T> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = data[static_cast<int64_t>(i) * stride];
    return out;
  }
  std::vector<T> out;
  if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) {
    out.reserve(nb::len(obj));
    for (nb::handle item : obj) {
      T value;
      if (!nb::try_cast(item, value, /*convert=*/false)) {
        throw std::invalid_argument(std::string(name) + " must hold integers that fit " +
                                    (sizeof(T) == 4 ? "int32" : "uint64") + "; got " +
                                    nb::cast<std::string>(nb::repr(item)));
      }
      out.push_back(value);
    }
    return out;
  }
  throw std::invalid_argument(std::string(name) +
                              " must be a 1-D numpy integer array or a list of ints; got " +
                              nb::cast<std::string>(nb::repr(nb::type_name(obj.type()))));
}

// take_copy_ops() / a ScheduledBatch's copy ops as one struct of arrays, so the runtime can run a
// batched copy without a Python loop per operation. Index i of every array is operation i, in
// the order the operations must run. Bound as kvtool._core.CopyOpArrays: its attributes are
// read-only numpy views (made on access, kept alive by the object) that stride over the
// operations themselves, so handing a batch to Python copies nothing.
struct CopyOpArrays {
  std::vector<CopyOp> ops;
  std::vector<BlockDigest> tier3_keys;  // one per operation into or out of the third tier, in order
  size_t size() const { return ops.size(); }
};

// A SequenceSpec from the keyword arguments of the Python methods.
inline SequenceSpec to_sequence_spec(IntArrayLike token_ids, IntArrayLike extra_ids, uint64_t lora_task_id,
                                     uint64_t cache_salt, int32_t priority,
                                     std::vector<RetentionRange> retention = {}) {
  SequenceSpec spec;
  spec.token_ids = to_vector<TokenId>(token_ids, "token_ids");
  if (!extra_ids.is_none()) spec.extra_ids = to_vector<ExtraId>(extra_ids, "extra_ids");
  spec.lora_task_id = lora_task_id;
  spec.cache_salt = cache_salt;
  spec.priority = priority;
  spec.retention = std::move(retention);
  return spec;
}

}  // namespace kvtool

// Python bindings of copy operations: one CopyOp, and CopyOpArrays, the struct of numpy views the
// runtime reads a step's copies from without converting them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <string>

#include "bindings.h"
#include "numpy_arrays.h"

namespace nb = nanobind;

namespace kvtool {

namespace {

// A read-only numpy view of the field of type T at byte offset `offset` of every copy operation,
// striding over the operations owned by the Python object it is read from.
template <typename T>
nb::ndarray<nb::numpy, const T, nb::ndim<1>> field_view(const CopyOpArrays& a, size_t offset) {
  static_assert(sizeof(CopyOp) % sizeof(T) == 0, "a CopyOp spans whole elements of each field");
  const T* first =
      a.ops.empty() ? nullptr : reinterpret_cast<const T*>(reinterpret_cast<const char*>(a.ops.data()) + offset);
  return nb::ndarray<nb::numpy, const T, nb::ndim<1>>(first, {a.ops.size()}, nb::handle(),
                                                      {static_cast<int64_t>(sizeof(CopyOp) / sizeof(T))});
}

const char* pool_name(PoolKind pool) {
  static const char* const names[] = {"PRIMARY", "SECONDARY", "DISK", "REMOTE"};
  return names[static_cast<int>(pool)];
}


}  // namespace

void bind_copy_ops(nb::module_& m) {
  nb::class_<CopyOp>(m, "CopyOp", "One block copy the runtime runs before the next forward.")
      .def_ro("src_pool", &CopyOp::src_pool)
      .def_ro("src_block_id", &CopyOp::src_block_id)
      .def_ro("dst_pool", &CopyOp::dst_pool)
      .def_ro("dst_block_id", &CopyOp::dst_block_id)
      .def_ro("num_tokens", &CopyOp::num_tokens, "Tokens from the start of the block.")
      .def("__repr__", [](const CopyOp& op) {
        return std::string("CopyOp(") + pool_name(op.src_pool) + ":" + std::to_string(op.src_block_id) +
               " -> " + pool_name(op.dst_pool) + ":" + std::to_string(op.dst_block_id) +
               ", num_tokens=" + std::to_string(op.num_tokens) + ")";
      });

  nb::class_<CopyOpArrays>(
      m, "CopyOpArrays",
      "Copy operations as a struct of 1-D numpy arrays; index i of each array is operation i, in "
      "the order the operations must run. Pools are PoolKind values (0 primary, 1 secondary).")
      .def_prop_ro(
          "src_pool",
          [](const CopyOpArrays& a) { return field_view<uint8_t>(a, offsetof(CopyOp, src_pool)); },
          nb::rv_policy::reference_internal, "uint8 [num_ops]")
      .def_prop_ro(
          "src_block_ids", [](const CopyOpArrays& a) { return field_view<int32_t>(a, offsetof(CopyOp, src_block_id)); },
          nb::rv_policy::reference_internal, "int32 [num_ops]")
      .def_prop_ro(
          "dst_pool",
          [](const CopyOpArrays& a) { return field_view<uint8_t>(a, offsetof(CopyOp, dst_pool)); },
          nb::rv_policy::reference_internal, "uint8 [num_ops]")
      .def_prop_ro(
          "dst_block_ids", [](const CopyOpArrays& a) { return field_view<int32_t>(a, offsetof(CopyOp, dst_block_id)); },
          nb::rv_policy::reference_internal, "int32 [num_ops]")
      .def_prop_ro(
          "num_tokens", [](const CopyOpArrays& a) { return field_view<int32_t>(a, offsetof(CopyOp, num_tokens)); },
          nb::rv_policy::reference_internal, "int32 [num_ops]: tokens from the start of each block")
      .def_prop_ro(
          "tier3_keys",
          [](const CopyOpArrays& a) {
            nb::list keys;
            for (const BlockDigest& k : a.tier3_keys) keys.append(nb::bytes(reinterpret_cast<const char*>(k.data()), k.size()));
            return keys;
          },
          "list[bytes]: the 32-byte key of each operation into or out of the third tier (DISK / REMOTE), in "
          "operation order.")
      .def("__len__", [](const CopyOpArrays& a) { return a.size(); })
      .def(
          "to_list", [](const CopyOpArrays& a) { return a.ops; },
          "The operations as a list of CopyOp (for tests and debugging).");
}

}  // namespace kvtool

// Block copy: moves whole KV block slabs between pools in one launch.
//
// A block slab is [num_layers, 2, tokens_per_block, num_kv_heads, head_dim], contiguous, so a
// copy op is (src address, dst address) of bytes_per_block bytes. Addresses may point into
// device memory or into pinned host memory mapped into the device's address space (UVA), which
// makes one kernel serve offload (device -> host), onboard (host -> device) and device -> device
// copies. Each CTA moves one bytes_per_cta slice of one op with 16-byte vectors, UNROLL loads in
// flight per thread (reads over PCIe / C2C need many outstanding requests).
//
// Pointer tables live in device memory; byte_offset, num_bytes and bytes_per_cta are multiples of 16
// and every address is 16-byte aligned (checked by the launcher).

typedef unsigned long long u64;
typedef long long i64;

namespace {
constexpr int NUM_THREADS = 256;
constexpr int UNROLL = 4;
}  // namespace

// grid: (num_ops, ceil(num_bytes / bytes_per_cta)); block: 256. Op i copies bytes
// [byte_offset, byte_offset + num_bytes) of its block: the whole block, or one layer of it when the
// runtime copies layer by layer so the forward can start on the first layers while later ones move.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) kvt_block_copy(
    const u64* __restrict__ src_addresses, const u64* __restrict__ dst_addresses, i64 byte_offset, i64 num_bytes,
    i64 bytes_per_cta) {
  const int op = blockIdx.x;  // x: up to 2^31 - 1 ops (y and z stop at 65535)
  const uint4* src = reinterpret_cast<const uint4*>(src_addresses[op] + byte_offset);
  uint4* dst = reinterpret_cast<uint4*>(dst_addresses[op] + byte_offset);
  const i64 begin = static_cast<i64>(blockIdx.y) * (bytes_per_cta / 16);
  const i64 end_bytes = static_cast<i64>(blockIdx.y + 1) * bytes_per_cta;
  const i64 end = (end_bytes < num_bytes ? end_bytes : num_bytes) / 16;
  for (i64 i = begin + threadIdx.x; i < end; i += NUM_THREADS * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const i64 j = i + u * NUM_THREADS;
      if (j < end) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const i64 j = i + u * NUM_THREADS;
      if (j < end) dst[j] = v[u];
    }
  }
}

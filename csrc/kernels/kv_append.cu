// KV append: stores the step's new keys and values into the paged cache at their slots.
//
// slot = block_id * tokens_per_block + offset; a negative slot is padding and is skipped.
// One CTA per token; its threads copy the token's K and V rows (2 * num_kv_heads * head_dim
// 16-bit values) as 16-byte vectors. Pure data movement: the same code serves fp16 and bf16,
// and every size is a runtime argument (one compiled specialization per architecture).
#include "common.cuh"

using kvt::half_bits;
using kvt::i64;

// grid: (num_tokens); block: 128.
extern "C" __global__ void __launch_bounds__(128) kvt_kv_append(
    const half_bits* __restrict__ key, i64 key_token_stride, i64 key_head_stride,        // [num_tokens, kvh, hd]
    const half_bits* __restrict__ value, i64 value_token_stride, i64 value_head_stride,  // [num_tokens, kvh, hd]
    const long long* __restrict__ slot_mapping,                                            // [num_tokens]
    half_bits* __restrict__ kv_cache, i64 block_stride, i64 kv_stride, i64 token_stride,
    i64 head_stride,  // [num_blocks, 2, tpb, kvh, hd] strided
    int num_kv_heads, int head_dim, int tokens_per_block) {
  const int token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const i64 block = slot / tokens_per_block;
  const int offset = static_cast<int>(slot % tokens_per_block);
  const int vectors_per_head = head_dim / 8;
  const int vectors_per_side = num_kv_heads * vectors_per_head;  // K or V of one token
  half_bits* dst_token = kv_cache + block * block_stride + static_cast<i64>(offset) * token_stride;
  for (int idx = threadIdx.x; idx < 2 * vectors_per_side; idx += blockDim.x) {
    const int side = idx / vectors_per_side;  // 0 = K, 1 = V
    const int rest = idx % vectors_per_side;
    const int head = rest / vectors_per_head;
    const int chunk = rest % vectors_per_head;
    const half_bits* src = side == 0
        ? key + static_cast<i64>(token) * key_token_stride + static_cast<i64>(head) * key_head_stride
        : value + static_cast<i64>(token) * value_token_stride + static_cast<i64>(head) * value_head_stride;
    half_bits* dst = dst_token + side * kv_stride + static_cast<i64>(head) * head_stride;
    *reinterpret_cast<uint4*>(dst + chunk * 8) = *reinterpret_cast<const uint4*>(src + chunk * 8);
  }
}

// Shared device helpers for kvtool's CUDA kernels.
//
// Deliberately header-free (no <cuda_fp16.h>, no <cstdint>): the same sources compile with nvcc
// and with NVRTC without an include path for the toolkit. 16-bit floats are carried as raw
// `unsigned short` bit patterns; conversions and tensor-core ops are inline PTX (sm_80+).
//
// Specialization macros (set with -D by kvtool/kernels/compiler.py):
//   KVT_DTYPE_BF16      1 for bfloat16 activations and KV cache, 0 for float16
//   KVT_HEAD_DIM        64 or 128
//   KVT_TOKENS_PER_BLOCK  power of two (16..128)
#pragma once

#ifndef KVT_DTYPE_BF16
#define KVT_DTYPE_BF16 0
#endif

namespace kvt {

typedef unsigned short half_bits;  // one fp16 / bf16 value, bit pattern
typedef long long i64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- scalar conversions -------------------------------------------------------------------

__device__ __forceinline__ float to_float(half_bits h) {
#if KVT_DTYPE_BF16
  return __uint_as_float(static_cast<unsigned>(h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ half_bits from_float(float f) {
  half_bits h;
#if KVT_DTYPE_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

// Two floats -> one 32-bit register holding {lo in bits 0..15, hi in bits 16..31}, the
// element order mma.sync fragments and little-endian memory both use.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
#if KVT_DTYPE_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// The two 16-bit values of a 32-bit word as floats (lo = bits 0..15).
__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi) {
#if KVT_DTYPE_BF16
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
#else
  lo = to_float(static_cast<half_bits>(w & 0xffffu));
  hi = to_float(static_cast<half_bits>(w >> 16));
#endif
}

// 8 consecutive 16-bit values (one 16-byte vector) -> 8 floats.
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  unpack2(v.x, f[0], f[1]);
  unpack2(v.y, f[2], f[3]);
  unpack2(v.z, f[4], f[5]);
  unpack2(v.w, f[6], f[7]);
}

// 2^x with the hardware approximation: ex2.approx(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- shared memory, async copies, tensor cores (sm_80+) --------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; when `valid` is false nothing is read and the 16 bytes are zeroed
// (src-size 0), so rows past a sequence's end or in released (-1) blocks are never touched.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)),
               "l"(gmem_src), "r"(src_size)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane l gives the address of row (l % 8) of matrix (l / 8). Lane t
// receives, in register i, row t/4, columns 2*(t%4) and 2*(t%4)+1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(smem_row)));
}

// As ldmatrix_x4 but transposed: lane t receives rows 2*(t%4) and 2*(t%4)+1 of column t/4.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(smem_row)));
}

// The same two with a shared-state-space address (from smem_addr plus byte offsets): a constant
// offset folds into the instruction's immediate, so unrolled loops need no per-access address.
__device__ __forceinline__ void ldmatrix_x4_shared(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                   unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans_shared(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                         unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D[16x8] += A[16x16] (row-major fragments a0..a3) * B[16x8] (col-major fragments b0, b1),
// fp32 accumulation. Fragment layouts (groupID g = lane/4, t = lane%4):
//   a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   b0: (k=2t..2t+1, n=g)  b1: (k=2t+8.., n=g)
//   c0,c1: (g, 2t..2t+1)  c2,c3: (g+8, 2t..2t+1)
__device__ __forceinline__ void mma_16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
#if KVT_DTYPE_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// ---- paged KV cache addressing -----------------------------------------------------------

// One layer's view of the pool: [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] with
// arbitrary element strides for the first four dims (the block stride spans all layers) and a
// contiguous head_dim.
struct CacheLayout {
  i64 block_stride;  // elements between blocks (num_layers * 2 * tpb * kvh * hd for pool[:, layer])
  i64 kv_stride;     // elements between K (0) and V (1)
  i64 token_stride;  // elements between tokens of a block
  i64 head_stride;   // elements between kv heads
};

}  // namespace kvt

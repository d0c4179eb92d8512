// The bf16 streaming GEMV pieces the one-token CUDA kernels share (ffi/cuda_bf16_experts.cu, ffi/cuda_bf16_gemv.cu): a
// warp owns output rows and reads each row in 16-byte vectors, lane l taking vectors l, l + 32, ...; every load of a
// row pair is issued before the first product; sums are float32, each lane's in order, then a butterfly of shuffles
// (every lane holds the same sum).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jaxk3 {
namespace bf16 {

constexpr int kChunk = 10;  // 16-byte vectors a lane and row in flight (2 rows: 20 loads, 80 registers); a 2304-wide
                            // input (Kimi-Linear's hidden size) is 9 a lane: one round trip a row pair

// One 16-byte weight load that skips L1 (each weight byte is read once) and asks L2 for the 256-byte block around it.
__device__ __forceinline__ uint4 Stream16(const uint4* a) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}

__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }  // bf16 -> float32
__device__ __forceinline__ float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// acc += the 8 products of a weight vector and an input vector (8 bf16 each), in order.
__device__ __forceinline__ float Dot8(float acc, uint4 w, uint4 x) {
  acc = fmaf(Lo(w.x), Lo(x.x), acc);
  acc = fmaf(Hi(w.x), Hi(x.x), acc);
  acc = fmaf(Lo(w.y), Lo(x.y), acc);
  acc = fmaf(Hi(w.y), Hi(x.y), acc);
  acc = fmaf(Lo(w.z), Lo(x.z), acc);
  acc = fmaf(Hi(w.z), Hi(x.z), acc);
  acc = fmaf(Lo(w.w), Lo(x.w), acc);
  return fmaf(Hi(w.w), Hi(x.w), acc);
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// kN of a row pair's vectors a lane in registers: [base, base + kN) of each row's M.
template <int kN>
struct Rows2 {
  uint4 w0[kN], w1[kN];
};

template <int kN>
__device__ __forceinline__ void Load2(Rows2<kN>& R, const uint4* r0, const uint4* r1, int base, int M, int lane) {
#pragma unroll
  for (int c = 0; c < kN; ++c) {
    if (base + c < M) {
      const int j = (base + c) * 32 + lane;
      R.w0[c] = Stream16(r0 + j);
      R.w1[c] = Stream16(r1 + j);
    }
  }
}

template <int kN>
__device__ __forceinline__ void Use2(const Rows2<kN>& R, const uint4* xs, int base, int M, int lane, float& a0,
                                     float& a1) {
#pragma unroll
  for (int c = 0; c < kN; ++c) {
    if (base + c < M) {
      const uint4 xv = xs[(base + c) * 32 + lane];
      a0 = Dot8(a0, R.w0[c], xv);
      a1 = Dot8(a1, R.w1[c], xv);
    }
  }
}

// The dots of two rows r0, r1 ([M * 32] vectors each) with the input xs (shared memory, the same layout), every lane
// holding both sums on return; the chunks from `base0` on (FinishRows2: the first kN vectors `first` already loaded,
// e.g. before the input was ready).
__device__ __forceinline__ void RestRows2(const uint4* r0, const uint4* r1, const uint4* xs, int M, int lane, int base0,
                                          float a0, float a1, float& d0, float& d1) {
  for (int base = base0; base < M; base += kChunk) {
    Rows2<kChunk> R;
    Load2(R, r0, r1, base, M, lane);
    Use2(R, xs, base, M, lane, a0, a1);
  }
  d0 = WarpSum(a0);
  d1 = WarpSum(a1);
}

__device__ __forceinline__ void DotRows2(const uint4* r0, const uint4* r1, const uint4* xs, int M, int lane, float& d0,
                                         float& d1) {
  RestRows2(r0, r1, xs, M, lane, 0, 0.0f, 0.0f, d0, d1);
}

template <int kN>
__device__ __forceinline__ void FinishRows2(const Rows2<kN>& first, const uint4* r0, const uint4* r1, const uint4* xs,
                                            int M, int lane, float& d0, float& d1) {
  float a0 = 0.0f, a1 = 0.0f;
  Use2(first, xs, 0, M, lane, a0, a1);
  RestRows2(r0, r1, xs, M, lane, kN, a0, a1, d0, d1);
}

}  // namespace bf16
}  // namespace jaxk3

// The MXFP4 x token products on mma.sync m16n8k16 (float16 in, float32 sums) that the one-token experts kernels share
// (cuda_mxfp4_gate_up.cu, cuda_mxfp4_down.cu).  A warp multiplies 16 weight rows by one token: lane (g = lane / 4,
// t = lane % 4) is the A-fragment thread of rows g and g + 8 and, per 128-code chunk, loads the 16 bytes (32 codes,
// one E8M0 scale group) of each row at group t, decodes each 32-bit word into four float16 pairs (codes (0, 4),
// (2, 6), (1, 5), (3, 7)) times the row's scale, and passes them to the mma as they are.  The mma's K order within a
// step is free, so the token is laid out in that order instead (each 8 inputs permuted [0, 4, 2, 6, 1, 5, 3, 7]:
// jaxk3/kernels/mxfp4_cuda.py's PERM); for one token only lanes 0-3 carry it (B's column 0), and column 0 of D holds
// the rows' sums in lanes t = 0 (d[0]: row g, d[2]: row g + 8); the wide form puts token g in lanes g (column g).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace jaxk3 {
namespace mxfp4 {

constexpr int kChunk = 128;   // codes of a row per warp iteration: 4 lanes x 32 (a scale group each)

// Four float16 pairs of a word's eight E2M1 codes, each code's bits placed as float16's (code · 2^-14, exactly:
// magnitude bits to exponent bits 10-11 and mantissa bit 9, the sign to bit 15), then times the pair of scales s2
// (2^(s − 113) each; the product is the weight, exact for s in [104, 128]).
__device__ __forceinline__ void Decode(uint32_t w, uint32_t s2, uint32_t& p0, uint32_t& p1, uint32_t& p2,
                                       uint32_t& p3) {
  const uint32_t m = 0x0E000E00u, s = 0x80008000u;
  const uint32_t r0 = ((w << 9) & m) | ((w << 12) & s);  // codes 0, 4: low nibbles of bytes 0, 2
  const uint32_t r1 = ((w << 1) & m) | ((w << 4) & s);   // codes 2, 6: low nibbles of bytes 1, 3
  const uint32_t r2 = ((w << 5) & m) | ((w << 8) & s);   // codes 1, 5: high nibbles of bytes 0, 2
  const uint32_t r3 = ((w >> 3) & m) | (w & s);          // codes 3, 7: high nibbles of bytes 1, 3
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p0) : "r"(r0), "r"(s2));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p1) : "r"(r1), "r"(s2));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p2) : "r"(r2), "r"(s2));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p3) : "r"(r3), "r"(s2));
}

__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// An E8M0 byte in [104, 128] as the float16 2^(s − 113) twice (exponent field s − 98).  Nothing here checks the range:
// the stacks' `MXFP4.f16` mark says it holds (checkpoint.mark_experts_f16 checks every scale at load), as for the
// Pallas float16 form.
__device__ __forceinline__ uint32_t Scale2(uint8_t s) {
  const uint32_t h = (static_cast<uint32_t>(s) - 98u) << 10;
  return h | (h << 16);
}

// One iteration's loads of a lane: its two rows' 16 code bytes (a scale group each) and their scale bytes.
struct Tile {
  uint4 c0, c8;
  uint8_t s0, s8;
};

// How a kernel loads (template flags): kL2, each weight load asks L2 for the whole aligned 256-byte block around it
// (PTX's L2::256B prefetch size: one DRAM fill serves a row's next three iterations instead of 64 bytes at a time);
// kWide, the B fragments come from global memory (each lane g token g's row, up to 8 tokens, kept in L1) instead of
// token 0's from shared memory, and the weight loads do not allocate in L1 (L1::no_allocate) so the tokens stay.
constexpr int kL2 = 1, kWide = 2;

// Where a kernel's input (the gate-up kernel's token, the down kernel's slots' activations) comes from, in float16
// times 2^k in the lanes' order: kIn16, XLA made it (copied to shared memory); kInRaw, bf16 as it is, made float16 by
// the CTA in shared memory; kInWide, up to kMaxTokens tokens' rows XLA made, lane g reading token g's from global
// memory through L1 (nothing in shared memory).
constexpr int kIn16 = 0, kInRaw = 1, kInWide = 2;
constexpr int kMaxTokens = 8;  // kInWide: the mma's N

// The load flags of an instance <input form, L2 hint>.
__host__ __device__ constexpr int LoadFlags(int in, bool hint_l2) { return (hint_l2 ? kL2 : 0) | (in == kInWide ? kWide : 0); }

#define JAXK3_MXFP4_LD(q, t) "ld.global.nc" q "." t
template <int kFlags>
__device__ __forceinline__ uint4 Load16(const uint8_t* a) {
  if constexpr (kFlags == 0) {
    return __ldg(reinterpret_cast<const uint4*>(a));
  } else {
    uint4 v;
    if constexpr (kFlags == (kL2 | kWide)) {
      asm(JAXK3_MXFP4_LD(".L1::no_allocate.L2::256B", "v4.u32") " {%0, %1, %2, %3}, [%4];"
          : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
    } else if constexpr (kFlags == kL2) {
      asm(JAXK3_MXFP4_LD(".L2::256B", "v4.u32") " {%0, %1, %2, %3}, [%4];"
          : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
    } else {
      asm(JAXK3_MXFP4_LD(".L1::no_allocate", "v4.u32") " {%0, %1, %2, %3}, [%4];"
          : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
    }
    return v;
  }
}

template <int kFlags>
__device__ __forceinline__ uint8_t Load1(const uint8_t* a) {
  if constexpr (kFlags == 0) {
    return __ldg(a);
  } else {
    uint32_t v;
    if constexpr (kFlags == (kL2 | kWide)) {
      asm(JAXK3_MXFP4_LD(".L1::no_allocate.L2::256B", "u8") " %0, [%1];" : "=r"(v) : "l"(a));
    } else if constexpr (kFlags == kL2) {
      asm(JAXK3_MXFP4_LD(".L2::256B", "u8") " %0, [%1];" : "=r"(v) : "l"(a));
    } else {
      asm(JAXK3_MXFP4_LD(".L1::no_allocate", "u8") " %0, [%1];" : "=r"(v) : "l"(a));
    }
    return static_cast<uint8_t>(v);
  }
}
#undef JAXK3_MXFP4_LD

template <int kFlags = 0>
__device__ __forceinline__ void Load(Tile& T, const uint8_t* row0, const uint8_t* srow0, size_t row_bytes,
                                     size_t srow_bytes, int code) {
  T.c0 = Load16<kFlags>(row0 + code / 2);
  T.c8 = Load16<kFlags>(row0 + 8 * row_bytes + code / 2);
  T.s0 = Load1<kFlags>(srow0 + code / 32);
  T.s8 = Load1<kFlags>(srow0 + 8 * srow_bytes + code / 32);
}

// Word j of a tile: rows g's and g + 8's 32-bit words (times their scale pairs sg, s8) against the token's octet xj,
// two mma steps.
__device__ __forceinline__ void Step(float (&d)[4], uint32_t w0, uint32_t w8, uint32_t sg, uint32_t s8, uint4 xj) {
  uint32_t p0, p1, p2, p3, q0, q1, q2, q3;
  Decode(w0, sg, p0, p1, p2, p3);
  Decode(w8, s8, q0, q1, q2, q3);
  // A = {row g k(2t, 2t+1), row g+8 k(2t, 2t+1), row g k(2t+8, 2t+9), row g+8 k(2t+8, 2t+9)}
  Mma(d, p0, q0, p1, q1, xj.x, xj.y);  // codes (0, 4) and (2, 6) of the word
  Mma(d, p2, q2, p3, q3, xj.z, xj.w);  // codes (1, 5) and (3, 7)
}

// The tile's 8 mma steps.  The B registers of lane (g, t): token g's 32 permuted inputs of group t, from `xs` (shared
// memory, token 0's row, lanes 0-3) or with kWide from `xs` in global memory (token g's row, through L1); lanes
// without a token (has_x false) hold zeros, so their columns of D stay 0.
template <int kFlags = 0>
__device__ __forceinline__ void Multiply(float (&d)[4], const Tile& T, const uint4* xs, int code, bool has_x) {
  const uint32_t sg = Scale2(T.s0), s8 = Scale2(T.s8);
  const uint32_t w0[4] = {T.c0.x, T.c0.y, T.c0.z, T.c0.w};
  const uint32_t w8[4] = {T.c8.x, T.c8.y, T.c8.z, T.c8.w};
  uint4 xw[4];  // kWide: the tile's four token octets, all loaded before the first product (L1's latency once a tile)
  if constexpr ((kFlags & kWide) != 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) xw[j] = has_x ? __ldg(xs + code / 8 + j) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint4 xj;
    if constexpr ((kFlags & kWide) != 0) {
      xj = xw[j];
    } else {
      xj = has_x ? xs[code / 8 + j] : make_uint4(0, 0, 0, 0);
    }
    Step(d, w0[j], w8[j], sg, s8, xj);
  }
}

// A tile's 8 mma steps with the token's four octets already in registers (the streaming kernel 2's, from its ring).
__device__ __forceinline__ void MultiplyRegs(float (&d)[4], const Tile& T, const uint4 (&xw)[4]) {
  const uint32_t sg = Scale2(T.s0), s8 = Scale2(T.s8);
  const uint32_t w0[4] = {T.c0.x, T.c0.y, T.c0.z, T.c0.w};
  const uint32_t w8[4] = {T.c8.x, T.c8.y, T.c8.z, T.c8.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) Step(d, w0[j], w8[j], sg, s8, xw[j]);
}

// The wide form's D of one warp as [row][token] in shared memory (its 16 rows x 8 tokens): lane (g, t) holds rows g,
// g + 8 of tokens 2t, 2t + 1 (PTX's f32 accumulator layout of m16n8).
__device__ __forceinline__ void TokensToShared(float (&red)[16][kMaxTokens], int lane, const float (&d)[4]) {
  const int g = lane / 4, t = lane % 4;
  red[g][2 * t] = d[0];
  red[g][2 * t + 1] = d[1];
  red[g + 8][2 * t] = d[2];
  red[g + 8][2 * t + 1] = d[3];
}

// A lane's first kDepth tiles of its row pair (rows g and g + 8 from row0 / srow0), from code `first` on.
template <int kDepth, int kFlags = 0>
__device__ __forceinline__ void Prefetch(Tile (&T)[kDepth], const uint8_t* row0, const uint8_t* srow0,
                                         size_t row_bytes, size_t srow_bytes, int first, int iters) {
#pragma unroll
  for (int k = 0; k < kDepth; ++k)
    if (k < iters) Load<kFlags>(T[k], row0, srow0, row_bytes, srow_bytes, first + k * kChunk);
}

// The row pair's products over `iters` chunks into d, `Prefetch`'s tiles first: each tile refilled with the one
// kDepth chunks on right after its products, so kDepth chunks' loads stay in flight.
template <int kDepth, int kFlags = 0>
__device__ __forceinline__ void Stream(float (&d)[4], Tile (&T)[kDepth], const uint8_t* row0, const uint8_t* srow0,
                                       size_t row_bytes, size_t srow_bytes, const uint4* xs, int first, int iters,
                                       bool has_x) {
  for (int it = 0; it < iters; it += kDepth) {
#pragma unroll
    for (int k = 0; k < kDepth; ++k) {
      if (it + k < iters) {
        Multiply<kFlags>(d, T[k], xs, first + (it + k) * kChunk, has_x);
        if (it + k + kDepth < iters)
          Load<kFlags>(T[k], row0, srow0, row_bytes, srow_bytes, first + (it + k + kDepth) * kChunk);
      }
    }
  }
}

// ---- The streaming form (the kernels' `stages` > 0): a warp's weight loads go through a ring of kStages
// iterations in shared memory by cp.async, so no register is held while they are in flight (the register form holds
// kDepth = 4 tiles, 79 registers, and so 6 CTAs an SM).  Each lane copies, and reads back, only its own bytes: its two
// rows' 16 code bytes and the aligned 4-byte word holding its scale byte of each row (the four lanes t of a row copy
// the same word, each into its own slot), so a lane never waits for another's copies and no barrier is needed.

template <int kStages>
struct Ring {
  uint4 c[kStages][2][32];     // [stage][row g, row g + 8][lane]: conflict-free 16-byte reads of a warp
  uint32_t s[kStages][2][32];  // the scale word of the lane's group (byte t of it)
};

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One lane's 16-byte (codes, .cg: L2 only) or 4-byte (a scale word, .ca) asynchronous copy to shared address `s`,
// asking L2 for the whole 256-byte block around it (the register form's `kL2`).
__device__ __forceinline__ void CopyAsync16L2(uint32_t s, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CopyAsync4L2(uint32_t s, const void* gmem) {
  asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CommitGroup() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Until at most n of this thread's committed groups are still in flight (so all but the newest n have landed).
template <int n>
__device__ __forceinline__ void WaitGroup() { asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory"); }

__device__ __forceinline__ uint4 LoadShared16(uint32_t s) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(s));
  return v;
}
__device__ __forceinline__ uint32_t LoadShared4(uint32_t s) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(s));
  return v;
}

// A lane's place in its warp's ring: shared addresses of its stage-0 slots, each stage `kCodeStage` / `kScaleStage`
// bytes on (rows g + 8: half a stage on).
template <int kStages>
struct RingLane {
  static constexpr uint32_t kCodeStage = 2 * 32 * sizeof(uint4), kScaleStage = 2 * 32 * sizeof(uint32_t);
  uint32_t c, s;
  __device__ __forceinline__ RingLane(Ring<kStages>& R, int lane)
      : c(SharedAddress(&R.c[0][0][lane])), s(SharedAddress(&R.s[0][0][lane])) {}

  // One iteration's copies into `stage`: the row pair's 16 code bytes at `codes` (row g; row g + 8 `row8` bytes on)
  // and the scale words at `scales` (the word holding group t's byte: 4-byte aligned while a row's scale bytes,
  // input / 32, are a multiple of 4 and the word starts at a multiple of 4 groups, as both kernels' chunks do; the
  // handlers check the scale buffers are).
  __device__ __forceinline__ void Load(int stage, const uint8_t* codes, size_t row8, const uint8_t* scales,
                                       size_t srow8) const {
    const uint32_t cs = c + stage * kCodeStage, ss = s + stage * kScaleStage;
    CopyAsync16L2(cs, codes);
    CopyAsync16L2(cs + kCodeStage / 2, codes + row8);
    CopyAsync4L2(ss, scales);
    CopyAsync4L2(ss + kScaleStage / 2, scales + srow8);
  }

  // The tile this lane copied into `stage`, once its group has landed (WaitGroup).
  __device__ __forceinline__ Tile Read(int stage, int t) const {
    const uint32_t cs = c + stage * kCodeStage, ss = s + stage * kScaleStage;
    Tile T;
    T.c0 = LoadShared16(cs);
    T.c8 = LoadShared16(cs + kCodeStage / 2);
    T.s0 = static_cast<uint8_t>(LoadShared4(ss) >> (8 * t));
    T.s8 = static_cast<uint8_t>(LoadShared4(ss + kScaleStage / 2) >> (8 * t));
    return T;
  }
};

// The streaming kernels' grid for `items` items where `fit` CTAs fit the GPU at once (occupancy x SMs) and `cap` > 0
// caps it (the tests'): the rounds of items a CTA takes that many CTAs need, then the fewest CTAs taking that many
// rounds, so that every CTA takes the same number of items, or one fewer (1536 items over 924 CTAs would leave 312 of
// them one item and the rest two; 768 CTAs take two each).
inline long long StreamGrid(long long items, long long fit, long long cap) {
  long long n = items < fit ? items : fit;
  if (cap > 0 && cap < n) n = cap;
  if (n < 1) return 1;
  const long long rounds = (items + n - 1) / n;
  return (items + rounds - 1) / rounds;
}

// ---- A kernel's bf16 input (the token, or each slot's activations) made float16 in the lanes' order by the kernel
// itself (the "raw" form: no XLA fusions before it), as `moe_experts.f16_scaled` and `mxfp4_cuda.lanes_order` make it.

// One 16-byte global -> shared copy that holds no register (cp.async; sm_80+): a CTA issues all of its input's copies
// back to back, then waits once (CopyWait), instead of a load and a store per round trip.
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void CopyWait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The helpers below are host code too (tests/native/mxfp4_raw_input.cu runs them on the CPU against
// `moe_experts.f16_scaled` and `mxfp4_cuda.lanes_order`).

__host__ __device__ __forceinline__ float AsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// The largest bf16 magnitude's bits among eight bf16 values and m (bf16 magnitudes order as unsigned integers; a NaN's
// above the infinity's).
__host__ __device__ __forceinline__ uint32_t MaxMagnitude(uint4 v, uint32_t m) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = w[i] & 0x7FFFu, hi = (w[i] >> 16) & 0x7FFFu;
    m = lo > m ? lo : m;
    m = hi > m ? hi : m;
  }
  return m;
}

// k of `f16_scaled` from the largest magnitude's bf16 bits: the one putting it in [2^14, 2^15) (frexp's exponent e of
// m in [2^(e-1), 2^e): k = 15 - e, clipped to [-126, 126]); 0 for zeros and for a NaN (where(m > 0) is false there),
// 15 for an infinity (frexp gives e = 0); 126 for a subnormal largest magnitude (its e is below -111; XLA on the CPU
// flushes it to zero and takes k = 0: values that small are zeros either way after float16's rounding unless scaled).
__host__ __device__ __forceinline__ int ScaleExponent(uint32_t mbits) {
  if (mbits == 0 || mbits > 0x7F80u) return 0;
  if (mbits == 0x7F80u) return 15;
  const int biased = static_cast<int>(mbits >> 7);  // m in [2^(biased - 127), 2^(biased - 126)): e = biased - 126
  if (biased == 0) return 126;
  const int k = 141 - biased;
  return k > 126 ? 126 : k;  // (>= -113 for a finite m)
}

// 2^k as a float for k in [-126, 127].
__host__ __device__ __forceinline__ float Pow2(int k) { return AsFloat(static_cast<uint32_t>(k + 127) << 23); }

// Eight bf16 values (little-endian halves v0..v7) times s = 2^k, each rounded to float16 (round to nearest even), in
// the lanes' order: words (v0, v4), (v2, v6), (v1, v5), (v3, v7) — PERM = [0, 4, 2, 6, 1, 5, 3, 7].
__host__ __device__ __forceinline__ uint4 ToLanes(uint4 v, float s) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float f[8];
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = AsFloat(w[i] << 16) * s;
    f[2 * i + 1] = AsFloat(w[i] & 0xFFFF0000u) * s;
  }
  uint32_t o[4];
  const int lo[4] = {0, 2, 1, 3};
  for (int j = 0; j < 4; ++j) {
    const __half2 h = __floats2half2_rn(f[lo[j]], f[lo[j] + 4]);
    memcpy(&o[j], &h, sizeof o[j]);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace mxfp4
}  // namespace jaxk3

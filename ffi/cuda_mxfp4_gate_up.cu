// jaxk3_mxfp4_gate_up (platform "CUDA"): one token's gate | up GEMVs over the selected MXFP4 experts and their GLU,
// on the tensor cores: a[u, 0, i] = act(W1[ids[u]] x, W3[ids[u]] x)[i], bf16.  The first of the `moe_experts` kernels
// at one token (jaxk3/kernels/mxfp4_cuda.py calls it; kernel 2 follows: Pallas, or cuda_mxfp4_down.cu).  No state, no
// communication: command-buffer compatible.
//
// The arithmetic is the Pallas float16 form's (docs/ARCHITECTURE.md, moe_experts): every weight code · 2^(s − 127) is
// a float16 exactly for E8M0 bytes s in [104, 128] (the stacks are checked at load), the token is a float16 exactly
// after a power of two (x16, its inverse xinv), and mma.sync m16n8k16 multiplies them exactly and sums in float32.
//
// A CTA owns 16 rows of I for one slot: warps 0, 1 the gate rows over the two halves of the input, warps 2, 3 the up
// rows.  In a warp, lane (g = lane / 4, t = lane % 4) is the mma's A-fragment thread for rows g and g + 8; per
// iteration it loads the 16 bytes (32 codes, one scale group) of each row at group t of a 128-code chunk, decodes
// each 32-bit word into four float16 pairs (codes (0, 4), (2, 6), (1, 5), (3, 7) of the word: bytes 16 bits apart,
// so two shifts and masks a pair) and feeds two mma steps with them.  The token's B fragment (column 0 only: lanes
// 0-3) holds the same codes' inputs, laid out in that order (x16: each 8 inputs permuted [0, 4, 2, 6, 1, 5, 3, 7]) by
// XLA, or in the raw form (x bf16) by the CTA itself in shared memory (cuda_mxfp4.h).  The K dimension's order
// inside an mma is free, so no data moves between lanes.  Template instances <input form, l2> (kIn16, kInRaw,
// kInWide: up to 8 tokens, each lane g token g's B column; l2: the weight loads with L2's 256-byte prefetch size);
// each was timed on a GPU (docs/PERF.md, nineteenth to twenty-seventh sessions).  The streaming form (`stages` 4, 6, 8:
// GateUpStreamKernel below) does the same products in persistent CTAs with the weights through shared memory, and is
// moe_experts' default (4 stages at one token, 8 in the wide form; twenty-seventh session).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "cuda_mxfp4.h"
#include "cuda_persistent_grid.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

using mxfp4::kChunk;
using mxfp4::kIn16;
using mxfp4::kInRaw;
using mxfp4::kInWide;
using mxfp4::kMaxTokens;
using mxfp4::Prefetch;
using mxfp4::Stream;
using mxfp4::Tile;

constexpr int kRows = 16;     // rows of I per CTA: one m16 tile of gate rows and one of up rows
constexpr int kWarps = 4;     // (gate, up) x (first, second half of the input)
constexpr int kDepth = 4;     // iterations' loads in flight per lane (79 registers: 6 CTAs an SM; docs/PERF.md)
constexpr int kMaxIn = 16384; // the token in shared memory: In x 2 bytes (32 KB at most)

struct Params {
  const int* ids;               // [U] the slots' experts (< 0 or >= E: the slot's outputs are zeros)
  const uint4* x;               // [In / 8] the token as float16, permuted (see above), times 2^k; kInRaw: bf16 as it
                                // is; kInWide: [nb, In / 8], the tokens' float16 rows, each times its own 2^k
  const float* xinv;            // [1] 2^-k (kInRaw: not read); kInWide: [nb]
  const uint8_t* gate_packed;   // [E, Rg, In / 2]
  const uint8_t* gate_scale;    // [E, Rg, In / 32]
  const uint8_t* up_packed;     // [E, Ru, In / 2]
  const uint8_t* up_scale;      // [E, Ru, In / 32]
  __nv_bfloat16* out;           // [U, I]; kInWide: [U, Bp, I] (rows nb..Bp-1 zeros)
  long long gate_rows, up_rows, up_off;  // rows per expert of each buffer; the up rows' offset in theirs
  int E, I, In, act;
  float beta, linear_beta;
  int nb, Bp;                   // kInWide: the tokens given, the output's rows (nb <= Bp <= 8)
  int U;                        // slots (the register form's grid.y)
};

__device__ __forceinline__ float Act(float a, float b, int act, float beta, float linear_beta) {
  const float sig = 1.0f / (1.0f + expf(-a));
  if (act == 0) return a * sig * b;  // SiLU-GLU
  return beta * tanhf(a / beta) * sig * (linear_beta * tanhf(b / linear_beta));  // SiTU-GLU
}

// The CTA's copy of the token in shared memory, permuted float16 octets (In / 8).  kRaw: from the bf16 token as it
// is, scaled and permuted here (cp.async copies, the CTA's largest magnitude, then in place), returning 2^-k; else the
// float16 XLA made, copied as it is (2^-k is *p.xinv, read after the products).
template <bool kRaw>
__device__ __forceinline__ float TokenToShared(const Params& p, uint4* xs) {
  const int n = p.In / 8;
  if constexpr (!kRaw) {  // (kIn16)
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = p.x[i];
    __syncthreads();
    return 1.0f;
  } else {
    __shared__ uint32_t top[kWarps];
    for (int i = threadIdx.x; i < n; i += blockDim.x) mxfp4::CopyAsync16(xs + i, p.x + i);
    mxfp4::CopyWait();
    __syncthreads();
    uint32_t m = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = mxfp4::MaxMagnitude(xs[i], m);
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if (threadIdx.x % 32 == 0) top[threadIdx.x / 32] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, top[w]);
    const int k = mxfp4::ScaleExponent(m);
    const float s = mxfp4::Pow2(k);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = mxfp4::ToLanes(xs[i], s);  // its own octets
    __syncthreads();
    return mxfp4::Pow2(-k);
  }
}

// The wide form at least 6 CTAs an SM (80 registers, no spills; its tile's four token loads issued together took 82,
// 5 CTAs); the others unbounded (0: as measured, 79 registers; a bound of 1 gave 83).
template <int kIn, bool kHintL2>
__global__ void __launch_bounds__(kWarps * 32, kIn == kInWide ? 6 : 0) GateUpKernel(Params p) {
  constexpr int kFlags = mxfp4::LoadFlags(kIn, kHintL2);
  extern __shared__ uint4 xs[];  // the token's In / 8 permuted float16 octets, read by lanes 0-3 of every warp
  __shared__ float red[kWarps][kRows];
  const int u = blockIdx.y, i0 = blockIdx.x * kRows;
  const int e = p.ids[u];
  if (e < 0 || e >= p.E) {  // an empty slot: zeros, as the Pallas kernel writes
    if constexpr (kIn == kInWide) {
      for (int q = threadIdx.x; q < kRows * p.Bp; q += blockDim.x)
        p.out[(static_cast<size_t>(u) * p.Bp + q / kRows) * p.I + i0 + q % kRows] = __float2bfloat16(0.0f);
    } else {
      if (threadIdx.x < kRows) p.out[static_cast<size_t>(u) * p.I + i0 + threadIdx.x] = __float2bfloat16(0.0f);
    }
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bool up = warp >= 2;
  const size_t row_bytes = p.In / 2, srow_bytes = p.In / 32;
  const long long rows = up ? p.up_rows : p.gate_rows;
  const long long r = (up ? p.up_off : 0) + i0 + g;
  const uint8_t* row0 = (up ? p.up_packed : p.gate_packed) + (static_cast<long long>(e) * rows + r) * row_bytes;
  const uint8_t* srow0 = (up ? p.up_scale : p.gate_scale) + (static_cast<long long>(e) * rows + r) * srow_bytes;
  const int half = p.In / 2, iters = half / kChunk;
  const int first = (warp % 2) * half + 32 * t;  // this lane's first code (its group in the first chunk)
  // The lanes holding a token: one token, lanes 0-3 (B's column 0; the rest zeros, as measured), but in the raw form
  // every lane reads token 0 (D's 8 columns all its sums, column 0 the one read: no zeroing of the others' B
  // registers, 8 instructions a tile); the wide form, lanes of tokens g < nb.
  const bool has_x = kIn == kInWide ? g < p.nb : (kIn == kInRaw || g == 0);

  Tile T[kDepth];  // kDepth tiles in flight: each refilled right after its products
  Prefetch<kDepth, kFlags>(T, row0, srow0, row_bytes, srow_bytes, first, iters);
  float raw_inv = 1.0f;
  if constexpr (kIn != kInWide) raw_inv = TokenToShared<kIn == kInRaw>(p, xs);
  const uint4* x = kIn == kInWide ? p.x + static_cast<size_t>(has_x ? g : 0) * (p.In / 8) : xs;

  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  Stream<kDepth, kFlags>(d, T, row0, srow0, row_bytes, srow_bytes, x, first, iters, has_x);

  if constexpr (kIn == kInWide) {  // D: rows g, g + 8 x tokens 2t, 2t + 1; the tokens' columns past nb are zeros
    __shared__ float wred[kWarps][kRows][kMaxTokens];
    mxfp4::TokensToShared(wred[warp], lane, d);
    __syncthreads();
    for (int q = threadIdx.x; q < kRows * p.Bp; q += blockDim.x) {
      const int i = q % kRows, b = q / kRows;
      const float inv = b < p.nb ? p.xinv[b] : 0.0f;
      const float h1 = (wred[0][i][b] + wred[1][i][b]) * inv, h3 = (wred[2][i][b] + wred[3][i][b]) * inv;
      p.out[(static_cast<size_t>(u) * p.Bp + b) * p.I + i0 + i] =
          __float2bfloat16(Act(h1, h3, p.act, p.beta, p.linear_beta));
    }
  } else {
    if (t == 0) {  // column 0 of D: rows g (d[0]) and g + 8 (d[2])
      red[warp][g] = d[0];
      red[warp][g + 8] = d[2];
    }
    __syncthreads();
    if (threadIdx.x < kRows) {
      const int i = threadIdx.x;
      const float inv = kIn == kInRaw ? raw_inv : *p.xinv;
      const float h1 = (red[0][i] + red[1][i]) * inv, h3 = (red[2][i] + red[3][i]) * inv;
      p.out[static_cast<size_t>(u) * p.I + i0 + i] = __float2bfloat16(Act(h1, h3, p.act, p.beta, p.linear_beta));
    }
  }
}

// ---- The streaming form (`stages` > 0; the products and the epilogue are the register form's, bit for bit).  Where
// the time of the register form goes (nineteenth session, Nsight Compute, K3's TP 2 share): 46.2 us at 43% of DRAM's
// throughput with 35% of the warps resident (79 registers), stalled on its global loads; and each CTA streams only 14
// iterations a warp, so it starts cold (the slot's expert read, then the first loads) and drains its last loads with
// nothing behind them, 1.94 waves of CTAs.  Here the CTAs are persistent, one grid of as many as fit (occupancy x SMs),
// each taking the items (slot u, 16-row block) c, c + grid, ...; each warp's loads go through a ring of kStages
// iterations in shared memory (cp.async: no registers held in flight) that runs on across the CTA's items, so the
// next item's first loads are in flight while this one's last products and its epilogue run; the slots' experts are
// read once a CTA, into shared memory.  The copies ask L2 for 256-byte blocks, as the `l2` form's loads.
constexpr int kMaxStreamSlots = 512;  // the slots' experts in shared memory (2 KB)

template <int kIn, int kStages>
__global__ void __launch_bounds__(kWarps * 32) GateUpStreamKernel(Params p) {
  static_assert(kIn == kIn16 || kIn == kInWide, "the streaming form takes XLA's float16 copies");
  using Ring = mxfp4::Ring<kStages>;
  constexpr int kCols = kIn == kInWide ? kMaxTokens : 1;  // D's columns the epilogue reads
  extern __shared__ uint4 dyn[];
  Ring& R = reinterpret_cast<Ring*>(dyn)[threadIdx.x / 32];
  uint4* xs = reinterpret_cast<uint4*>(reinterpret_cast<Ring*>(dyn) + kWarps);  // kIn16: the token, In / 8 octets
  __shared__ int sid[kMaxStreamSlots];
  __shared__ float red[2][kWarps][kRows][kCols];  // by item parity: one barrier an item
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = threadIdx.x; i < p.U; i += blockDim.x) sid[i] = p.ids[i];
  __syncthreads();

  const int nblk = p.I / kRows, items = nblk * p.U;
  const int mine = items > static_cast<int>(blockIdx.x) ? (items - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  const bool up = warp >= 2;
  const size_t row_bytes = p.In / 2, srow_bytes = p.In / 32;
  const long long rows = up ? p.up_rows : p.gate_rows, off = up ? p.up_off : 0;
  const uint8_t* packed = up ? p.up_packed : p.gate_packed;
  const uint8_t* scale = up ? p.up_scale : p.gate_scale;
  const int iters = p.In / 2 / kChunk;
  const int first = (warp % 2) * (p.In / 2) + 32 * t;  // this lane's first code of an item
  const size_t row8 = 8 * row_bytes, srow8 = 8 * srow_bytes;
  // Item k of this CTA: its slot, first row, and this lane's first code and scale word (false: an empty slot,
  // nothing loaded, zeros out).
  auto at = [&](int k, int& u, int& i0, const uint8_t*& codes, const uint8_t*& scales) {
    const int item = static_cast<int>(blockIdx.x) + k * static_cast<int>(gridDim.x);
    u = item / nblk;
    i0 = (item - u * nblk) * kRows;
    const int e = sid[u];
    if (e < 0 || e >= p.E) return false;
    const long long r = static_cast<long long>(e) * rows + off + i0 + g;
    codes = packed + r * row_bytes + first / 2;
    scales = scale + r * srow_bytes + (first / 32 - t);
    return true;
  };
  const mxfp4::RingLane<kStages> ring(R, lane);

  // The issuing cursor, kStages - 1 iterations ahead of the products, its pointers advanced a chunk a step; a group
  // is committed each step (empty past the CTA's last item), so that WaitGroup<kStages - 1> always means "the
  // oldest group has landed".
  int ik = 0, iit = 0, istage = 0, iu, ii0;
  const uint8_t *icodes = nullptr, *iscales = nullptr;
  bool ilive = mine > 0 && at(0, iu, ii0, icodes, iscales);
  auto issue = [&]() {
    if (ik < mine) {
      if (ilive) {
        ring.Load(istage, icodes, row8, iscales, srow8);
        icodes += kChunk / 2;
        iscales += kChunk / 32;
      }
      if (++iit == iters) {
        iit = 0;
        if (++ik < mine) ilive = at(ik, iu, ii0, icodes, iscales);
      }
      istage = istage + 1 == kStages ? 0 : istage + 1;
    }
    mxfp4::CommitGroup();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue();
  if constexpr (kIn == kIn16) {  // the token, once a CTA (XLA's float16 copy, as the register form's)
    for (int i = threadIdx.x; i < p.In / 8; i += blockDim.x) xs[i] = p.x[i];
    __syncthreads();
  }
  const bool has_x = kIn == kInWide ? g < p.nb : g == 0;
  const uint4* x = (kIn == kInWide ? p.x + static_cast<size_t>(has_x ? g : 0) * (p.In / 8) : xs) + first / 8;
  constexpr int kMul = kIn == kInWide ? mxfp4::kWide : 0;  // Multiply's token loads (global through L1, or shared)

  int stage = 0;
  for (int k = 0; k < mine; ++k) {
    int u, i0;
    const uint8_t *codes, *scales;
    const bool live = at(k, u, i0, codes, scales);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint4* xk = x;  // the token's octets of this lane's chunk, kChunk / 8 on an iteration
    for (int it = 0; it < iters; ++it) {
      issue();
      mxfp4::WaitGroup<kStages - 1>();
      if (live) mxfp4::Multiply<kMul>(d, ring.Read(stage, t), xk, 0, has_x);
      xk += kChunk / 8;
      stage = stage + 1 == kStages ? 0 : stage + 1;
    }
    float(&rd)[kWarps][kRows][kCols] = red[k & 1];
    if constexpr (kIn == kInWide) {
      mxfp4::TokensToShared(rd[warp], lane, d);
    } else if (t == 0) {  // column 0 of D: rows g (d[0]) and g + 8 (d[2])
      rd[warp][g][0] = d[0];
      rd[warp][g + 8][0] = d[2];
    }
    __syncthreads();
    const int cols = kIn == kInWide ? p.Bp : 1;
    for (int q = threadIdx.x; q < kRows * cols; q += blockDim.x) {
      const int i = q % kRows, b = q / kRows;
      const float inv = kIn == kInWide ? (b < p.nb ? p.xinv[b] : 0.0f) : *p.xinv;
      const float h1 = (rd[0][i][b] + rd[1][i][b]) * inv, h3 = (rd[2][i][b] + rd[3][i][b]) * inv;
      p.out[(static_cast<size_t>(u) * cols + b) * p.I + i0 + i] =  // an empty slot: zeros, as the register form
          __float2bfloat16(live ? Act(h1, h3, p.act, p.beta, p.linear_beta) : 0.0f);
    }
  }
}

// The streaming form's instance, launch and grid (mxfp4::StreamGrid: at most as many CTAs as fit at once, each taking
// the same number of items or one fewer; `ctas` > 0 the tests' cap, so that each CTA takes many items).
template <int kIn>
ffi::Error LaunchStream(cudaStream_t stream, const Params& p, int stages, long long ctas, const char* name) {
  auto* kernel = stages == 4 ? GateUpStreamKernel<kIn, 4> : stages == 6 ? GateUpStreamKernel<kIn, 6>
                                                                         : GateUpStreamKernel<kIn, 8>;
  const size_t ring = stages == 4 ? sizeof(mxfp4::Ring<4>) : stages == 6 ? sizeof(mxfp4::Ring<6>) : sizeof(mxfp4::Ring<8>);
  const size_t smem = kWarps * ring + (kIn == kIn16 ? static_cast<size_t>(p.In) * 2 : 0);
  // Dynamic shared memory past 48 KB with the static (the slots' experts, `red`) needs the opt-in: set to the
  // instance's largest (the token at kMaxIn), the same every call, so that no call lowers it under another's launch.
  const int most = static_cast<int>(kWarps * ring + (kIn == kIn16 ? 2 * kMaxIn : 0));
  long long fit = 0;
  cudaError_t e = ResidentCtas(kernel, kWarps * 32, smem, most, fit);
  if (e != cudaSuccess) return Internal(std::string(name) + ": the streaming form's launch setup: " + cudaGetErrorString(e));
  if (fit < 1)
    return InvalidArgument(std::string(name) + ": the streaming form with " + std::to_string(stages) + " stages (" +
                           std::to_string(smem) + " bytes of shared memory a CTA) does not fit an SM");
  const long long items = static_cast<long long>(p.I / kRows) * p.U;
  const unsigned grid = static_cast<unsigned>(mxfp4::StreamGrid(items, fit, ctas));
  kernel<<<grid, kWarps * 32, smem, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return Internal(std::string(name) + ": launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error CudaMxfp4GateUp(cudaStream_t stream, ffi::AnyBuffer ids, ffi::AnyBuffer x, ffi::AnyBuffer xinv,
                           ffi::AnyBuffer gate_packed, ffi::AnyBuffer gate_scale, ffi::AnyBuffer up_packed,
                           ffi::AnyBuffer up_scale, ffi::Result<ffi::AnyBuffer> out, int64_t up_off, int64_t act,
                           float beta, float linear_beta, int64_t l2, int64_t stages, int64_t ctas) {
  const char* name = "jaxk3_mxfp4_gate_up";
  const auto gp = gate_packed.dimensions(), gs = gate_scale.dimensions(), upk = up_packed.dimensions(),
             us = up_scale.dimensions(), od = out->dimensions();
  if (ids.element_type() != ffi::DataType::S32 || ids.dimensions().size() != 1)
    return InvalidArgument(std::string(name) + ": ids must be int32 [U], got " + DimsText(ids.dimensions()));
  // The input's form from its dtype and rank: float16 [In] (kIn16), bfloat16 [In] (kInRaw), float16 [nb, In] (kInWide)
  const bool raw = x.element_type() == ffi::DataType::BF16, wide = x.dimensions().size() == 2;
  if ((!raw && x.element_type() != ffi::DataType::F16) || (raw && wide) || x.dimensions().size() < 1 ||
      x.dimensions().size() > 2 || (wide && (x.dimensions()[0] < 1 || x.dimensions()[0] > kMaxTokens)))
    return InvalidArgument(std::string(name) + ": x must be float16 [In] (scaled, permuted), bfloat16 [In] (as it is) " +
                           "or float16 [tokens, In] for 1 to " + std::to_string(kMaxTokens) + " tokens, got " +
                           DimsText(x.dimensions()));
  const int64_t nb = wide ? x.dimensions()[0] : 1;
  if (xinv.element_type() != ffi::DataType::F32 || xinv.element_count() != nb)
    return InvalidArgument(std::string(name) + ": xinv must be " + std::to_string(nb) + " float32 (2^-k a token), got " +
                           DimsText(xinv.dimensions()));
  if (out->element_type() != ffi::DataType::BF16)
    return InvalidArgument(std::string(name) + ": the output must be bfloat16");
  for (const ffi::AnyBuffer* b : {&gate_packed, &gate_scale, &up_packed, &up_scale}) {
    if (b->element_type() != ffi::DataType::U8 || b->dimensions().size() != 3)
      return InvalidArgument(std::string(name) + ": MXFP4 codes and scales must be uint8 [E, rows, cols], got " +
                             DimsText(b->dimensions()));
  }
  const int64_t U = ids.dimensions()[0], In = x.dimensions()[wide ? 1 : 0], E = gp[0];
  const int64_t I = od.size() == 3 ? od[2] : -1, Bp = od.size() == 3 ? od[1] : -1;
  if (od.size() != 3 || od[0] != U || (wide ? Bp < nb || Bp > kMaxTokens : Bp != 1))
    return InvalidArgument(std::string(name) + ": the output must be [U, " +
                           (wide ? std::to_string(nb) + " to " + std::to_string(kMaxTokens) : std::string("1")) +
                           ", I] for U = " + std::to_string(U) + ", got " + DimsText(od));
  if (U < 1 || U > 65535)
    return InvalidArgument(std::string(name) + ": 1 to 65535 slots (ids [U]), got " + std::to_string(U));
  if (In < 2 * kChunk || In % (2 * kChunk) != 0 || In > kMaxIn || I < kRows || I % kRows != 0)
    return InvalidArgument(std::string(name) + ": the input width " + std::to_string(In) + " must be a positive " +
                           "multiple of " + std::to_string(2 * kChunk) + " up to " + std::to_string(kMaxIn) +
                           " and I " + std::to_string(I) + " of " + std::to_string(kRows));
  if (gp[2] != In / 2 || upk[2] != In / 2 || gs[2] != In / 32 || us[2] != In / 32 || gs[0] != E || upk[0] != E ||
      us[0] != E || gs[1] != gp[1] || us[1] != upk[1])
    return InvalidArgument(std::string(name) + ": codes " + DimsText(gp) + ", " + DimsText(upk) + " and scales " + DimsText(gs) +
                           ", " + DimsText(us) + " do not match an input of " + std::to_string(In));
  if (gp[1] < I || up_off < 0 || up_off + I > upk[1])
    return InvalidArgument(std::string(name) + ": I = " + std::to_string(I) + " gate rows and up rows from " +
                           std::to_string(up_off) + " do not fit the experts' " + std::to_string(gp[1]) + " and " +
                           std::to_string(upk[1]) + " rows");
  if (act != 0 && act != 1) return InvalidArgument(std::string(name) + ": act must be 0 (silu) or 1 (situ)");
  if (l2 != 0 && l2 != 1) return InvalidArgument(std::string(name) + ": l2 must be 0 or 1");
  if (ctas < 0) return InvalidArgument(std::string(name) + ": ctas must be 0 (as many as fit) or a cap, got " +
                                      std::to_string(ctas));
  if (stages != 0 && stages != 4 && stages != 6 && stages != 8)
    return InvalidArgument(std::string(name) + ": stages must be 0 (the register form) or 4, 6 or 8, got " +
                           std::to_string(stages));
  if (stages != 0 && (raw || U > kMaxStreamSlots || reinterpret_cast<uintptr_t>(gate_scale.untyped_data()) % 4 ||
                      reinterpret_cast<uintptr_t>(up_scale.untyped_data()) % 4))
    return InvalidArgument(std::string(name) + ": the streaming form (stages " + std::to_string(stages) + ") takes " +
                           "float16 inputs, at most " + std::to_string(kMaxStreamSlots) + " slots (got " +
                           std::to_string(U) + ") and 4-byte aligned scales");
  if (reinterpret_cast<uintptr_t>(gate_packed.untyped_data()) % 16 || reinterpret_cast<uintptr_t>(up_packed.untyped_data()) % 16 ||
      reinterpret_cast<uintptr_t>(x.untyped_data()) % 16)
    return InvalidArgument(std::string(name) + ": the codes and the input must be 16-byte aligned");
  Params p{static_cast<const int*>(ids.untyped_data()), static_cast<const uint4*>(x.untyped_data()),
           static_cast<const float*>(xinv.untyped_data()), static_cast<const uint8_t*>(gate_packed.untyped_data()),
           static_cast<const uint8_t*>(gate_scale.untyped_data()), static_cast<const uint8_t*>(up_packed.untyped_data()),
           static_cast<const uint8_t*>(up_scale.untyped_data()), static_cast<__nv_bfloat16*>(out->untyped_data()),
           gp[1], upk[1], up_off, static_cast<int>(E), static_cast<int>(I), static_cast<int>(In),
           static_cast<int>(act), beta, linear_beta, static_cast<int>(nb), static_cast<int>(Bp), static_cast<int>(U)};
  if (stages != 0)
    return wide ? LaunchStream<kInWide>(stream, p, static_cast<int>(stages), ctas, name)
                : LaunchStream<kIn16>(stream, p, static_cast<int>(stages), ctas, name);
  const dim3 grid(static_cast<unsigned>(I / kRows), static_cast<unsigned>(U));
  const size_t smem = wide ? 0 : static_cast<size_t>(In) * 2;
  auto* kernel = wide ? (l2 ? GateUpKernel<kInWide, true> : GateUpKernel<kInWide, false>)
                 : raw ? (l2 ? GateUpKernel<kInRaw, true> : GateUpKernel<kInRaw, false>)
                       : (l2 ? GateUpKernel<kIn16, true> : GateUpKernel<kIn16, false>);
  kernel<<<grid, kWarps * 32, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Internal(std::string(name) + ": launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_mxfp4_gate_up, CudaMxfp4GateUp,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("up_off")
                                  .Attr<int64_t>("act")
                                  .Attr<float>("beta")
                                  .Attr<float>("linear_beta")
                                  .Attr<int64_t>("l2")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("ctas"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

// jaxk3_mxfp4_down (platform "CUDA"): one token's down projections over the selected MXFP4 experts and their
// combine, on the tensor cores: y[p, 0, o] = Σ over the slots u of part p of coef[u] · (W2[ids[u]] a[u])[o], fp32, the
// G parts' partial sums added by XLA in the consumer.  The second of the `moe_experts` kernels at one token
// (jaxk3/kernels/mxfp4_cuda.py's `down`), the same products as the first (cuda_mxfp4.h): each slot's activations
// a[u] in float16 times 2^k_u (its inverse ainv[u]), the lanes' order.  No state: command-buffer compatible.
//
// A CTA owns 16 output rows and one part of the slots; its 4 warps take the part's slots in turn (warp w: slots
// w, w + 4, ...), each slot over its whole I, and sum in shared memory.  The part's activations sit in shared memory:
// float16 copies XLA made, or in the raw form (a bf16) copied by cp.async and scaled there, each warp its own slots;
// or, for up to 8 tokens (kInWide), nowhere: lane g reads token g's activations from global memory through L1, and
// D's columns are the tokens.  Template instances <input form, l2> as the gate-up kernel's.  The streaming form
// (`stages` 4, 6, 8, one token: DownStreamKernel below) takes (part, 16-row block) items in persistent CTAs, its
// warps splitting each slot's I, the codes and activations through a ring in shared memory.
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

constexpr int kRows = 16;           // output rows per CTA: one m16 tile
constexpr int kWarps = 4;           // slots of the part in turn
constexpr int kDepth = 4;           // iterations' loads in flight per lane (as the gate-up kernel)
constexpr int kMaxSmem = 47 * 1024; // the part's activations (per x I x 2 bytes) beside `red`: under 48 KB

struct Params {
  const int* ids;        // [U] the slots' experts (< 0 or >= E: the slot adds nothing)
  const float* coef;     // [nb, U] each token's routing weight of each slot (0 where it did not choose it)
  const uint4* a;        // [U, nb, I / 8] each slot's activations in float16 times 2^k_(u, b), permuted (nb = 1 but
                         // for kInWide); kInRaw: [U, I / 8] bf16 as it is
  const float* ainv;     // [U, nb] 2^-k (kInRaw: not read)
  const uint8_t* packed; // [E, Out, I / 2]
  const uint8_t* scale;  // [E, Out, I / 32]
  float* out;            // [G, nb, Out]
  int E, U, I, Out, per; // per: slots a part
  int nb;                // tokens (1 but for kInWide)
  int G;                 // parts (the output's first dim; the register form's grid.y)
};

// A warp's slot: its rows' code and scale pointers, or false for an empty slot (an expert out of [0, E)).
__device__ __forceinline__ bool SlotRows(const Params& p, int u, int o0, int g, const uint8_t*& row0,
                                         const uint8_t*& srow0) {
  const int e = p.ids[u];
  if (e < 0 || e >= p.E) return false;
  row0 = p.packed + (static_cast<long long>(e) * p.Out + o0 + g) * (p.I / 2);
  srow0 = p.scale + (static_cast<long long>(e) * p.Out + o0 + g) * (p.I / 32);
  return true;
}

// kRaw: the part's activations arrived in shared memory as bf16 (cp.async); each warp scales and permutes its own slots
// (w, w + 4, ...: the ones it multiplies) in place and keeps each one's 2^-k in sinv (`moe_experts.f16_scaled` per slot).
template <bool kRaw>
__device__ __forceinline__ void ScaleSlots(uint4* as, float* sinv, int slots, int octets, int warp, int lane) {
  if constexpr (kRaw) {
    for (int s = warp; s < slots; s += kWarps) {  // warp-uniform
      uint4* slot = as + static_cast<size_t>(s) * octets;
      uint32_t m = 0;
      for (int i = lane; i < octets; i += 32) m = mxfp4::MaxMagnitude(slot[i], m);
      const int k = mxfp4::ScaleExponent(__reduce_max_sync(0xFFFFFFFFu, m));
      const float sc = mxfp4::Pow2(k);
      for (int i = lane; i < octets; i += 32) slot[i] = mxfp4::ToLanes(slot[i], sc);
      if (lane == 0) sinv[s] = mxfp4::Pow2(-k);
    }
    __syncwarp();
  }
}

// At least 6 CTAs an SM (80 registers, no spills: nvcc --resource-usage): the raw form's scaling beside the
// prefetched tiles took 96 otherwise, 5 CTAs (the gate-up kernel's measured 79 registers, 6 CTAs, were the faster).
// The wide form's four token columns of sums need 96 (at 80 it spilled 84 bytes): 5.
template <int kIn, bool kHintL2>
__global__ void __launch_bounds__(kWarps * 32, kIn == kInWide ? 5 : 6) DownKernel(Params p) {
  constexpr int kFlags = mxfp4::LoadFlags(kIn, kHintL2);
  extern __shared__ uint4 as[];  // the part's slots' activations, [per, I / 8]; kInRaw: then each slot's 2^-k, [per]
  const int part = blockIdx.y, o0 = blockIdx.x * kRows;
  const int first_slot = part * p.per, slots = min(p.per, p.U - first_slot);  // <= 0: an empty part, zeros
  const int octets = p.I / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // The lanes holding a token: one token, lanes 0-3 (B's column 0; the rest zeros, as measured), but in the raw form
  // every lane reads token 0 (D's 8 columns all its sums, column 0 the one read: no zeroing of the others' B
  // registers, 8 instructions a tile); the wide form, lanes of tokens g < nb.
  const bool has_x = kIn == kInWide ? g < p.nb : (kIn == kInRaw || g == 0);
  const size_t row_bytes = p.I / 2, srow_bytes = p.I / 32;
  const int iters = p.I / kChunk;

  // The warp's first slot's loads go out before the activations are copied (each slot after it: at its start).
  Tile T[kDepth];
  const uint8_t *row0 = nullptr, *srow0 = nullptr;
  bool live = warp < slots && SlotRows(p, first_slot + warp, o0, g, row0, srow0);
  if (live) Prefetch<kDepth, kFlags>(T, row0, srow0, row_bytes, srow_bytes, 32 * t, iters);
  float* sinv = reinterpret_cast<float*>(as + static_cast<size_t>(p.per) * octets);
  if constexpr (kIn != kInWide) {
    const uint4* a = p.a + static_cast<size_t>(first_slot) * octets;
    if constexpr (kIn == kInRaw) {
      for (int i = threadIdx.x; i < slots * octets; i += blockDim.x) mxfp4::CopyAsync16(as + i, a + i);
      mxfp4::CopyWait();
    } else {
      for (int i = threadIdx.x; i < slots * octets; i += blockDim.x) as[i] = a[i];
    }
    __syncthreads();
    ScaleSlots<kIn == kInRaw>(as, sinv, slots, octets, warp, lane);
  }

  // Rows g and g + 8 of D, tokens 2t and 2t + 1 (one token: lanes t = 0's column 0 only hold real sums)
  float tot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s = warp; s < slots; s += kWarps) {  // warp-uniform
    const int u = first_slot + s;
    if (s != warp) {
      live = SlotRows(p, u, o0, g, row0, srow0);
      if (live) Prefetch<kDepth, kFlags>(T, row0, srow0, row_bytes, srow_bytes, 32 * t, iters);
    }
    if (!live) continue;
    const uint4* x = kIn == kInWide ? p.a + (static_cast<size_t>(u) * p.nb + (has_x ? g : 0)) * octets
                                    : as + static_cast<size_t>(s) * octets;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    Stream<kDepth, kFlags>(d, T, row0, srow0, row_bytes, srow_bytes, x, 32 * t, iters, has_x);
    if constexpr (kIn == kInWide) {
      const int b0 = 2 * t, b1 = 2 * t + 1;
      const size_t ua = static_cast<size_t>(u) * p.nb;  // slot u's row of ainv
      const float c0 = b0 < p.nb ? p.coef[static_cast<size_t>(b0) * p.U + u] * p.ainv[ua + b0] : 0.0f;
      const float c1 = b1 < p.nb ? p.coef[static_cast<size_t>(b1) * p.U + u] * p.ainv[ua + b1] : 0.0f;
      tot[0] += c0 * d[0];
      tot[1] += c1 * d[1];
      tot[2] += c0 * d[2];
      tot[3] += c1 * d[3];
    } else {
      const float c = p.coef[u] * (kIn == kInRaw ? sinv[s] : p.ainv[u]);
      tot[0] += c * d[0];
      tot[2] += c * d[2];
    }
  }
  if constexpr (kIn == kInWide) {
    __shared__ float wred[kWarps][kRows][kMaxTokens];
    mxfp4::TokensToShared(wred[warp], lane, tot);
    __syncthreads();
    for (int q = threadIdx.x; q < kRows * p.nb; q += blockDim.x) {
      const int i = q % kRows, b = q / kRows;
      p.out[(static_cast<size_t>(part) * p.nb + b) * p.Out + o0 + i] =
          wred[0][i][b] + wred[1][i][b] + wred[2][i][b] + wred[3][i][b];
    }
  } else {
    __shared__ float red[kWarps][kRows];
    if (t == 0) {
      red[warp][g] = tot[0];
      red[warp][g + 8] = tot[2];
    }
    __syncthreads();
    if (threadIdx.x < kRows) {
      const int i = threadIdx.x;
      p.out[static_cast<size_t>(part) * p.Out + o0 + i] = red[0][i] + red[1][i] + red[2][i] + red[3][i];
    }
  }
}

// ---- The streaming form at one token (`stages` 4, 6, 8; moe_experts.Config.cuda_stages with cuda_down): persistent
// CTAs taking the items (part, 16-row block) c, c + grid, ...; the CTA's 4 warps split each slot's I by 128-code chunks
// (warp w: chunks w, w + 4, ...), so that a part of one slot keeps all four busy and the items are many (the register
// form's 4 parts of 4 slots made 896 CTAs at K3's shapes: 1.13 waves of 6 an SM).  Each warp's codes, scale words and
// its slot's activation octets (lanes 0-3, the B column) go through a ring in shared memory (cuda_mxfp4.h's, plus the
// octets), running on across slots and items as kernel 1's; nothing is staged per part.  Sums: each warp its chunks
// of a slot, times the slot's coef · 2^-k, then the 4 warps' in shared memory: another order than the register
// form's (a slot's whole I in one warp), within the float16 forms' tolerance.
constexpr int kMaxStreamSlots = 512;  // the slots' experts in shared memory (2 KB)

template <int kStages>
struct DownRing {
  mxfp4::Ring<kStages> w;    // the row pair's codes and scale words
  uint4 x[kStages][4][4];    // [stage][octet q][lane t = 0..3 (g = 0)]: the slot's 4 activation octets of group t,
                             // a q's four lanes 64 contiguous bytes (no bank conflict)
};

template <int kStages>
__global__ void __launch_bounds__(kWarps * 32) DownStreamKernel(Params p) {
  extern __shared__ uint4 dyn[];
  DownRing<kStages>& R = reinterpret_cast<DownRing<kStages>*>(dyn)[threadIdx.x / 32];
  __shared__ int sid[kMaxStreamSlots];
  __shared__ float red[2][kWarps][kRows];  // by item parity: one barrier an item
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = threadIdx.x; i < p.U; i += blockDim.x) sid[i] = p.ids[i];
  __syncthreads();

  const int nblk = p.Out / kRows, items = nblk * p.G;
  const int mine = items > static_cast<int>(blockIdx.x) ? (items - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  const int iters = p.I / kChunk, octets = p.I / 8;
  const int nw = iters > warp ? (iters - 1 - warp) / kWarps + 1 : 0;  // this warp's chunks of a slot
  const size_t row_bytes = p.I / 2, srow_bytes = p.I / 32, row8 = 8 * row_bytes, srow8 = 8 * srow_bytes;
  const bool has_x = g == 0;
  const mxfp4::RingLane<kStages> ring(R.w, lane);
  const uint32_t xs = mxfp4::SharedAddress(&R.x[0][0][t]);  // (lanes g = 0 use it)
  constexpr uint32_t kXStage = 4 * 4 * sizeof(uint4), kXOctet = 4 * sizeof(uint4);
  // Item k of this CTA: its part, the part's first slot and slot count (0: an empty part), its first row.
  auto at = [&](int k, int& first, int& o0) {
    const int item = static_cast<int>(blockIdx.x) + k * static_cast<int>(gridDim.x);
    const int part = item / nblk;
    o0 = (item - part * nblk) * kRows;
    first = part * p.per;
    return max(0, min(p.per, p.U - first));
  };
  auto live = [&](int u) { return sid[u] >= 0 && sid[u] < p.E; };

  // The issuing cursor over this warp's steps (live slots of each item's part x its chunks), kStages - 1 ahead of the
  // products; one group committed a step, empty past the last.
  int ik = 0, is = 0, ij = 0, istage = 0;
  const uint8_t *icodes = nullptr, *iscales = nullptr;
  const uint4* iact = nullptr;
  auto seek = [&]() {  // (ik, is) on to the next live slot, its pointers at the warp's first chunk; ik = mine: none
    if (nw == 0) ik = mine;
    for (; ik < mine; ++ik, is = 0) {
      int first, o0;
      const int ns = at(ik, first, o0);
      for (; is < ns; ++is) {
        const int u = first + is;
        if (!live(u)) continue;
        const long long r = static_cast<long long>(sid[u]) * p.Out + o0 + g;
        icodes = p.packed + r * row_bytes + warp * (kChunk / 2) + 16 * t;
        iscales = p.scale + r * srow_bytes + warp * (kChunk / 32);
        iact = p.a + static_cast<size_t>(u) * octets + warp * (kChunk / 8) + 4 * t;
        ij = 0;
        return;
      }
    }
  };
  seek();
  auto issue = [&]() {
    if (ik < mine) {
      ring.Load(istage, icodes, row8, iscales, srow8);
      if (has_x) {
#pragma unroll
        for (int q = 0; q < 4; ++q) mxfp4::CopyAsync16L2(xs + istage * kXStage + q * kXOctet, iact + q);
      }
      icodes += kWarps * kChunk / 2;
      iscales += kWarps * kChunk / 32;
      iact += kWarps * kChunk / 8;
      if (++ij == nw) {
        ++is;
        seek();
      }
      istage = istage + 1 == kStages ? 0 : istage + 1;
    }
    mxfp4::CommitGroup();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue();

  int stage = 0;
  for (int k = 0; k < mine; ++k) {
    int first, o0;
    const int ns = nw > 0 ? at(k, first, o0) : (at(k, first, o0), 0);
    float tot[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // rows g (tot[0]) and g + 8 (tot[2]) of D's column 0
    for (int s = 0; s < ns; ++s) {
      const int u = first + s;
      if (!live(u)) continue;
      const float c = __ldg(p.coef + u) * __ldg(p.ainv + u);  // (in flight over the slot's products)
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int j = 0; j < nw; ++j) {
        issue();
        mxfp4::WaitGroup<kStages - 1>();
        uint4 xw[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          xw[q] = has_x ? mxfp4::LoadShared16(xs + stage * kXStage + q * kXOctet) : make_uint4(0, 0, 0, 0);
        mxfp4::MultiplyRegs(d, ring.Read(stage, t), xw);
        stage = stage + 1 == kStages ? 0 : stage + 1;
      }
      tot[0] += c * d[0];
      tot[2] += c * d[2];
    }
    float(&rd)[kWarps][kRows] = red[k & 1];
    if (t == 0) {
      rd[warp][g] = tot[0];
      rd[warp][g + 8] = tot[2];
    }
    __syncthreads();
    if (threadIdx.x < kRows) {
      const int i = threadIdx.x, part = (static_cast<int>(blockIdx.x) + k * static_cast<int>(gridDim.x)) / nblk;
      p.out[static_cast<size_t>(part) * p.Out + o0 + i] = rd[0][i] + rd[1][i] + rd[2][i] + rd[3][i];
    }
  }
}

// The streaming form's instance, launch and grid (mxfp4::StreamGrid, as kernel 1's; `ctas` > 0 the tests' cap).
ffi::Error LaunchDownStream(cudaStream_t stream, const Params& p, int stages, long long ctas, const std::string& name) {
  auto* kernel = stages == 4 ? DownStreamKernel<4> : stages == 6 ? DownStreamKernel<6> : DownStreamKernel<8>;
  const size_t smem = kWarps * (stages == 4 ? sizeof(DownRing<4>) : stages == 6 ? sizeof(DownRing<6>)
                                                                                : sizeof(DownRing<8>));
  long long fit = 0;  // (past 48 KB with the static: the opt-in, the same value every call)
  cudaError_t e = ResidentCtas(kernel, kWarps * 32, smem, static_cast<int>(smem), fit);
  if (e != cudaSuccess) return Internal(name + ": the streaming form's launch setup: " + cudaGetErrorString(e));
  if (fit < 1)
    return InvalidArgument(name + ": the streaming form with " + std::to_string(stages) + " stages (" +
                           std::to_string(smem) + " bytes of shared memory a CTA) does not fit an SM");
  const long long n = mxfp4::StreamGrid(static_cast<long long>(p.Out / kRows) * p.G, fit, ctas);
  kernel<<<static_cast<unsigned>(n), kWarps * 32, smem, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return Internal(name + ": launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error CudaMxfp4Down(cudaStream_t stream, ffi::AnyBuffer ids, ffi::AnyBuffer coef, ffi::AnyBuffer a,
                         ffi::AnyBuffer ainv, ffi::AnyBuffer packed, ffi::AnyBuffer scale,
                         ffi::Result<ffi::AnyBuffer> out, int64_t l2, int64_t stages, int64_t ctas) {
  const std::string name = "jaxk3_mxfp4_down";
  if (ids.element_type() != ffi::DataType::S32 || ids.dimensions().size() != 1)
    return InvalidArgument(name + ": ids must be int32 [U], got " + DimsText(ids.dimensions()));
  const int64_t U = ids.dimensions()[0];
  if (U < 1) return InvalidArgument(name + ": at least one slot, got ids " + DimsText(ids.dimensions()));
  // The activations' form from their dtype and rank: float16 [U, I] (kIn16), bfloat16 [U, I] (kInRaw), float16
  // [U, tokens, I] (kInWide)
  const auto ad = a.dimensions(), pd = packed.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  const bool raw = a.element_type() == ffi::DataType::BF16, wide = ad.size() == 3;
  if ((!raw && a.element_type() != ffi::DataType::F16) || (raw && wide) || ad.size() < 2 || ad.size() > 3 ||
      ad[0] != U || (wide && (ad[1] < 1 || ad[1] > kMaxTokens)))
    return InvalidArgument(name + ": a must be float16 [U, I] (scaled, permuted), bfloat16 [U, I] (as it is) or " +
                           "float16 [U, tokens, I] for 1 to " + std::to_string(kMaxTokens) + " tokens, for U = " +
                           std::to_string(U) + ", got " + DimsText(ad));
  const int64_t nb = wide ? ad[1] : 1;
  if (coef.element_type() != ffi::DataType::F32 || coef.element_count() != nb * U)
    return InvalidArgument(name + ": coef must be float32 [tokens, U] with " + std::to_string(nb * U) +
                           " values, got " + DimsText(coef.dimensions()));
  if (ainv.element_type() != ffi::DataType::F32 || ainv.element_count() != U * nb)
    return InvalidArgument(name + ": ainv must be float32 [U, tokens] with " + std::to_string(U * nb) +
                           " values, got " + DimsText(ainv.dimensions()));
  if (l2 != 0 && l2 != 1) return InvalidArgument(name + ": l2 must be 0 or 1");
  const int64_t I = ad[ad.size() - 1];
  if (packed.element_type() != ffi::DataType::U8 || scale.element_type() != ffi::DataType::U8 || pd.size() != 3 ||
      sd.size() != 3 || pd[2] != I / 2 || sd[2] != I / 32 || sd[0] != pd[0] || sd[1] != pd[1])
    return InvalidArgument(name + ": codes " + DimsText(pd) + " and scales " + DimsText(sd) + " must be uint8 [E, Out, I/2] "
                           "and [E, Out, I/32] for I = " + std::to_string(I));
  const int64_t E = pd[0], Out = pd[1];
  if (out->element_type() != ffi::DataType::F32 || od.size() != 3 || od[1] != nb || od[2] != Out || od[0] < 1)
    return InvalidArgument(name + ": the output must be float32 [G, " + std::to_string(nb) + ", Out] for Out = " +
                           std::to_string(Out) + ", got " + DimsText(od));
  const int64_t G = od[0], per = (U + G - 1) / G;
  if (I < kChunk || I % kChunk != 0 || Out < kRows || Out % kRows != 0 || G > 65535)
    return InvalidArgument(name + ": I " + std::to_string(I) + " must be a positive multiple of " +
                           std::to_string(kChunk) + ", Out " + std::to_string(Out) + " of " + std::to_string(kRows) +
                           ", and the parts " + std::to_string(G) + " at most 65535");
  if (stages != 0 && stages != 4 && stages != 6 && stages != 8)
    return InvalidArgument(name + ": stages must be 0 (the register form) or 4, 6 or 8, got " + std::to_string(stages));
  if (ctas < 0) return InvalidArgument(name + ": ctas must be 0 (as many as fit) or a cap, got " + std::to_string(ctas));
  if (stages != 0 && (raw || wide || U > kMaxStreamSlots || reinterpret_cast<uintptr_t>(scale.untyped_data()) % 4))
    return InvalidArgument(name + ": the streaming form (stages " + std::to_string(stages) + ") takes one token's " +
                           "float16 activations [U, I], at most " + std::to_string(kMaxStreamSlots) + " slots (got " +
                           std::to_string(U) + ") and 4-byte aligned scales");
  if (stages == 0 && !wide && per * I * 2 + per * 4 > kMaxSmem)
    return InvalidArgument(name + ": a part's " + std::to_string(per) + " slots of I " + std::to_string(I) +
                           " activations do not fit " + std::to_string(kMaxSmem) + " bytes of shared memory");
  if (reinterpret_cast<uintptr_t>(packed.untyped_data()) % 16 || reinterpret_cast<uintptr_t>(a.untyped_data()) % 16)
    return InvalidArgument(name + ": the codes and the activations must be 16-byte aligned");
  Params p{static_cast<const int*>(ids.untyped_data()), static_cast<const float*>(coef.untyped_data()),
           static_cast<const uint4*>(a.untyped_data()), static_cast<const float*>(ainv.untyped_data()),
           static_cast<const uint8_t*>(packed.untyped_data()), static_cast<const uint8_t*>(scale.untyped_data()),
           static_cast<float*>(out->untyped_data()), static_cast<int>(E), static_cast<int>(U), static_cast<int>(I),
           static_cast<int>(Out), static_cast<int>(per), static_cast<int>(nb), static_cast<int>(G)};
  if (stages != 0) return LaunchDownStream(stream, p, static_cast<int>(stages), ctas, name);
  const dim3 grid(static_cast<unsigned>(Out / kRows), static_cast<unsigned>(G));
  const size_t smem = wide ? 0 : static_cast<size_t>(per * I * 2 + (raw ? per * 4 : 0));
  auto* kernel = wide ? (l2 ? DownKernel<kInWide, true> : DownKernel<kInWide, false>)
                 : raw ? (l2 ? DownKernel<kInRaw, true> : DownKernel<kInRaw, false>)
                       : (l2 ? DownKernel<kIn16, true> : DownKernel<kIn16, false>);
  kernel<<<grid, kWarps * 32, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Internal(name + ": launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_mxfp4_down, CudaMxfp4Down,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("l2")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("ctas"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

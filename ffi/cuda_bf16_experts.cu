// jaxk3_bf16_gate_up, jaxk3_bf16_down (platform "CUDA"): `moe_experts`' two kernels for one token of bf16 experts
// (jaxk3/kernels/bf16_cuda.py calls them), as plain streaming GEMVs on the CUDA cores:
//   gate_up  a[u, 0, i] = act(W1[e_u] x, W3[e_u] x)[i] in bf16, for the U routed slots and, with `shared`, slot U the
//            shared experts' gate | up; the slots' experts e_u given (ids) or ranked here from the router's logits
//            (`route_k` > 0: sigmoid, + bias, top-k in lax.top_k's order, renormalised and scaled), then written out
//            with their weights for the down kernel;
//   down     y[0, o] = Σ_u coef[u] · (W2[e_u] a[u])[o] (+ the shared experts' down row of a[U]), fp32, one sum; with
//            `residual`, the block's residual add in its epilogue instead: bf16(float(h[o]) + y[0, o]) (the new
//            residual stream, as XLA's add and rounding of the two would give it, bit for bit).
//
// Why not Pallas: at one token Pallas's element-wise kernels stream the 48B's experts at 3.0-3.2 TB/s (docs/PERF.md,
// sixth session) in 576-program grids of 32-row tiles.  Here a warp owns one output (a row pair of gate | up, or one
// row of down over every slot) and issues all of its 16-byte weight loads before its first product: every warp of
// every CTA keeps 4-8 KB in flight, the CTAs are persistent (as many as fit, each warp striding over the outputs), and
// the sums are the warp's lanes' (a butterfly of shuffles: every lane holds the same sum).  No state, no
// communication: command-buffer compatible.
//
// Products and sums are float32 (the weights and inputs are bf16, exact in float32), as in the reference
// (`moe_experts.experts_partial`); the order of the sums is the lanes' (each lane its 8-wide vectors, then the
// butterfly), so the results agree with it to float32 rounding, not bitwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "common.h"
#include "cuda_bf16_rows.h"
#include "cuda_bf16_route.h"
#include "cuda_persistent_grid.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

constexpr int kWarps = 8;        // warps per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSlots = 64;    // U + 1
constexpr int kMaxExperts = 1024;  // route: the logits ranked in shared memory
constexpr int kMaxIn = 16384;    // gate_up: the token in shared memory (32 KB)
constexpr int kMaxDownSmem = 96 * 1024;  // down: the slots' activations in shared memory

__device__ __forceinline__ float Act(float a, float b, int act, float beta, float linear_beta) {
  const float sig = 1.0f / (1.0f + expf(-a));
  if (act == 0) return a * sig * b;  // SiLU-GLU
  return beta * tanhf(a / beta) * sig * (linear_beta * tanhf(b / linear_beta));  // SiTU-GLU
}

// ------------------------------------------------------------------------------------------------ gate_up
struct GateUpParams {
  const void* sel0;        // route_k 0: ids [U] int32; else the router's logits [E] float32
  const float* sel1;       // route_k 0: the slots' weights [U] (copied to coef_out); else the selection bias [E]
  const uint4* x;          // [In / 8] the token, bf16
  const uint4* gate;       // [E, gate_rows, In / 8]
  const uint4* up;         // [E, up_rows, In / 8] (the same buffer as gate in the serving layout's join)
  const uint4* shared;     // [2 I, In / 8] the shared experts' gate | up rows (read with has_shared)
  __nv_bfloat16* out;      // [P, I], P = U + has_shared
  int* ids_out;            // [U] the slots' experts
  float* coef_out;         // [U] their weights
  long long gate_rows, up_rows, up_off;
  int E, U, I, In, act, has_shared, route_k, renorm;
  float beta, linear_beta, scale;
};

// The CTA's slots (experts and weights) in shared memory: given, or ranked from the logits (every CTA the same way).
__device__ void Slots(const GateUpParams& p, int* ids, float* coef, float* scratch) {
  const int t = threadIdx.x;
  if (p.route_k == 0) {
    for (int u = t; u < p.U; u += kThreads) {
      ids[u] = static_cast<const int*>(p.sel0)[u];
      coef[u] = p.sel1[u];
    }
    __syncthreads();
    return;
  }
  float* s = scratch;             // [E] sigmoid(logit)
  float* c = scratch + p.E;       // [E] the selection score s + bias
  const float* logits = static_cast<const float*>(p.sel0);
  for (int j = t; j < p.E; j += kThreads) {
    const float sj = bf16route::Sigmoid(logits[j]);
    s[j] = sj;
    c[j] = sj + p.sel1[j];
  }
  for (int u = t; u < p.U; u += kThreads) ids[u] = INT_MAX;
  __syncthreads();
  for (int j = t; j < p.E; j += kThreads) {  // each expert offers itself to the slot of its rank
    const int rank = bf16route::Rank(c, p.E, j);
    if (rank < p.U) atomicMin(&ids[rank], j);  // NaN scores can share a rank: the lowest index, deterministically
  }
  __syncthreads();
  if (t == 0) bf16route::Settle(ids, coef, s, p.U, p.renorm != 0, p.scale);
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) Bf16GateUpKernel(GateUpParams p) {
  extern __shared__ uint4 xs[];  // [In / 8] the token, then (route) 2 E floats
  __shared__ int ids[kMaxSlots];
  __shared__ float coef[kMaxSlots];
  const int n8 = p.In / 8;
  WaitForPredecessors();  // the token and the router's logits (or the slots) are the kernels' before this one
  for (int i = threadIdx.x; i < n8; i += kThreads) xs[i] = p.x[i];
  Slots(p, ids, coef, reinterpret_cast<float*>(xs + n8));  // (its barriers cover the token's copy)
  if (blockIdx.x == 0) {
    for (int u = threadIdx.x; u < p.U; u += kThreads) {
      p.ids_out[u] = ids[u];
      p.coef_out[u] = coef[u];
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int M = p.In / 256;  // vectors per lane and row
  const long long P = p.U + p.has_shared, items = P * p.I;
  for (long long it = static_cast<long long>(blockIdx.x) * kWarps + warp; it < items;
       it += static_cast<long long>(gridDim.x) * kWarps) {
    const int u = static_cast<int>(it / p.I), i = static_cast<int>(it % p.I);
    const uint4 *g, *up;
    if (u < p.U) {
      const int e = ids[u];
      if (e < 0 || e >= p.E) {  // an expert out of range: the slot's outputs are zeros
        if (lane == 0) p.out[it] = __float2bfloat16_rn(0.0f);
        continue;
      }
      g = p.gate + (e * p.gate_rows + i) * n8;
      up = p.up + (e * p.up_rows + p.up_off + i) * n8;
    } else {
      g = p.shared + static_cast<long long>(i) * n8;
      up = p.shared + static_cast<long long>(p.I + i) * n8;
    }
    float ag, au;
    bf16::DotRows2(g, up, xs, M, lane, ag, au);
    if (lane == 0) p.out[it] = __float2bfloat16_rn(Act(ag, au, p.act, p.beta, p.linear_beta));
  }
}

// ------------------------------------------------------------------------------------------------ down
struct DownParams {
  const int* ids;          // [U]
  const float* coef;       // [U]
  const uint4* a;          // [P, I / 8] the slots' activations, bf16
  const uint4* w2;         // [E, Out, I / 8]
  const uint4* shared;     // [Out, I / 8] the shared experts' down rows (read with has_shared)
  const __nv_bfloat16* residual;  // [Out] the residual stream (read with has_residual)
  void* out;               // [Out] float32, or with has_residual bf16
  int E, U, I, Out, has_shared, has_residual;
};

// kMv = I / 256 vectors per lane and row; kSlots slots' rows in flight at once (16 loads a lane).  At most 80 registers
// (3 CTAs an SM): the 48B's 2304 output rows are then one row a warp, all resident at once (2 CTAs an SM would leave
// 192 warps a second row; the I = 256 and 512 instances spill 12-20 bytes for it).
template <int kMv>
__global__ void __launch_bounds__(kThreads, 3) Bf16DownKernel(DownParams p) {
  constexpr int kSlots = kMv >= 16 ? 1 : 16 / kMv;
  extern __shared__ uint4 as[];  // [P, I / 8]
  __shared__ int ids[kMaxSlots];
  __shared__ float coef[kMaxSlots];
  const int n8 = p.I / 8, P = p.U + p.has_shared;
  WaitForPredecessors();  // kernel 1's activations, experts and weights, and the residual stream
  for (int i = threadIdx.x; i < P * n8; i += kThreads) as[i] = p.a[i];
  for (int u = threadIdx.x; u < P; u += kThreads) {
    const bool routed = u < p.U;
    const int e = routed ? p.ids[u] : 0;
    ids[u] = routed ? (e >= 0 && e < p.E ? e : -1) : INT_MAX;  // -1: skipped; INT_MAX: the shared experts
    coef[u] = routed ? p.coef[u] : 1.0f;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int o = blockIdx.x * kWarps + warp; o < p.Out; o += gridDim.x * kWarps) {
    float acc = 0.0f;
    for (int u0 = 0; u0 < P; u0 += kSlots) {
      uint4 w[kSlots][kMv];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int u = u0 + s;
        if (u < P && ids[u] >= 0) {
          const uint4* row = ids[u] == INT_MAX ? p.shared + static_cast<long long>(o) * n8
                                               : p.w2 + (static_cast<long long>(ids[u]) * p.Out + o) * n8;
#pragma unroll
          for (int m = 0; m < kMv; ++m) w[s][m] = bf16::Stream16(row + m * 32 + lane);
        }
      }
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int u = u0 + s;
        if (u < P && ids[u] >= 0) {
          float d = 0.0f;
#pragma unroll
          for (int m = 0; m < kMv; ++m) d = bf16::Dot8(d, w[s][m], as[u * n8 + m * 32 + lane]);
          acc = fmaf(coef[u], d, acc);  // each lane's share of coef[u] · (W2[e_u] a[u])[o]
        }
      }
    }
    acc = bf16::WarpSum(acc);
    if (lane == 0) {
      if (p.has_residual)
        static_cast<__nv_bfloat16*>(p.out)[o] = __float2bfloat16_rn(__bfloat162float(p.residual[o]) + acc);
      else
        static_cast<float*>(p.out)[o] = acc;
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool Bf16(const ffi::AnyBuffer& b, size_t rank) {
  return b.element_type() == ffi::DataType::BF16 && b.dimensions().size() == rank;
}

ffi::Error CudaBf16GateUp(cudaStream_t stream, ffi::AnyBuffer sel0, ffi::AnyBuffer sel1, ffi::AnyBuffer x,
                          ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer shared,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ids_out,
                          ffi::Result<ffi::AnyBuffer> coef_out, int64_t up_off, int64_t act, float beta,
                          float linear_beta, int64_t has_shared, int64_t route_k, int64_t renorm, float scale,
                          int64_t ctas, int64_t pdl) {
  const char* name = "jaxk3_bf16_gate_up";
  if (!Bf16(x, 1) || !Bf16(gate, 3) || !Bf16(up, 3) || !Bf16(*out, 3))
    return InvalidArgument(std::string(name) + ": x [In], the experts [E, rows, In] and the output [P, 1, I] must be "
                           "bfloat16, got x " + DimsText(x.dimensions()) + ", gate " + DimsText(gate.dimensions()) +
                           ", up " + DimsText(up.dimensions()) + ", out " + DimsText(out->dimensions()));
  const auto gd = gate.dimensions(), ud = up.dimensions(), od = out->dimensions();
  const int64_t In = x.dimensions()[0], E = gd[0], I = od[2];
  const int64_t U = route_k > 0 ? route_k : sel0.dimensions().size() == 1 ? sel0.dimensions()[0] : -1;
  const int64_t P = U + (has_shared ? 1 : 0);
  if (route_k < 0 || route_k > E || has_shared < 0 || has_shared > 1 || U < 1 || P > kMaxSlots)
    return InvalidArgument(std::string(name) + ": 1 to " + std::to_string(kMaxSlots) + " slots with the shared " +
                           "experts' (route_k " + std::to_string(route_k) + ", shared " + std::to_string(has_shared) +
                           ", E " + std::to_string(E) + ")");
  const ffi::DataType want0 = route_k > 0 ? ffi::DataType::F32 : ffi::DataType::S32;
  const int64_t n_sel = route_k > 0 ? E : U;
  if (sel0.element_type() != want0 || sel0.element_count() != n_sel || sel1.element_type() != ffi::DataType::F32 ||
      sel1.element_count() != n_sel)
    return InvalidArgument(std::string(name) + (route_k > 0 ? ": the logits and bias must be float32 [E]"
                                                            : ": the ids must be int32 [U] and the weights float32 [U]") +
                           ", got " + DimsText(sel0.dimensions()) + " and " + DimsText(sel1.dimensions()));
  if (od[0] != P || od[1] != 1 || ids_out->element_type() != ffi::DataType::S32 || ids_out->element_count() != U ||
      coef_out->element_type() != ffi::DataType::F32 || coef_out->element_count() != U)
    return InvalidArgument(std::string(name) + ": the outputs must be a [" + std::to_string(P) + ", 1, I] bf16, ids [" +
                           std::to_string(U) + "] int32 and weights [" + std::to_string(U) + "] float32, got " +
                           DimsText(od));
  if (In < 256 || In % 256 || In > kMaxIn || gd[2] != In || ud[2] != In || ud[0] != E || I < 1 || gd[1] < I ||
      up_off < 0 || up_off + I > ud[1] || (route_k > 0 && E > kMaxExperts))
    return InvalidArgument(std::string(name) + ": the input width " + std::to_string(In) + " must be a multiple of " +
                           "256 up to " + std::to_string(kMaxIn) + ", the experts " + DimsText(gd) + " and " +
                           DimsText(ud) + " hold I = " + std::to_string(I) + " gate rows and up rows from " +
                           std::to_string(up_off) + ", and at most " + std::to_string(kMaxExperts) + " are ranked");
  if (has_shared && (!Bf16(shared, 2) || shared.dimensions()[0] != 2 * I || shared.dimensions()[1] != In))
    return InvalidArgument(std::string(name) + ": the shared experts' gate | up must be bfloat16 [" +
                           std::to_string(2 * I) + ", " + std::to_string(In) + "], got " + DimsText(shared.dimensions()));
  if (act != 0 && act != 1) return InvalidArgument(std::string(name) + ": act must be 0 (silu) or 1 (situ)");
  if (!Aligned16(x.untyped_data()) || !Aligned16(gate.untyped_data()) || !Aligned16(up.untyped_data()) ||
      !Aligned16(shared.untyped_data()))
    return InvalidArgument(std::string(name) + ": the token and the experts must be 16-byte aligned");
  GateUpParams p{sel0.untyped_data(), static_cast<const float*>(sel1.untyped_data()),
                 static_cast<const uint4*>(x.untyped_data()), static_cast<const uint4*>(gate.untyped_data()),
                 static_cast<const uint4*>(up.untyped_data()), static_cast<const uint4*>(shared.untyped_data()),
                 static_cast<__nv_bfloat16*>(out->untyped_data()), static_cast<int*>(ids_out->untyped_data()),
                 static_cast<float*>(coef_out->untyped_data()), gd[1], ud[1], up_off, static_cast<int>(E),
                 static_cast<int>(U), static_cast<int>(I), static_cast<int>(In), static_cast<int>(act),
                 static_cast<int>(has_shared), static_cast<int>(route_k), renorm != 0 ? 1 : 0, beta, linear_beta,
                 scale};
  const size_t smem = static_cast<size_t>(In) * 2 + (route_k > 0 ? static_cast<size_t>(E) * 8 : 0);
  return LaunchPersistent(Bf16GateUpKernel, kThreads, smem, kMaxDownSmem, kWarps, P * I, ctas, pdl, name, stream, p);
}

ffi::Error CudaBf16Down(cudaStream_t stream, ffi::AnyBuffer ids, ffi::AnyBuffer coef, ffi::AnyBuffer a,
                        ffi::AnyBuffer w2, ffi::AnyBuffer shared, ffi::AnyBuffer residual,
                        ffi::Result<ffi::AnyBuffer> out, int64_t has_shared, int64_t has_residual, int64_t ctas,
                        int64_t pdl) {
  const char* name = "jaxk3_bf16_down";
  const ffi::DataType out_type = has_residual ? ffi::DataType::BF16 : ffi::DataType::F32;
  if (!Bf16(a, 3) || !Bf16(w2, 3) || out->element_type() != out_type || out->dimensions().size() != 2 ||
      has_residual < 0 || has_residual > 1)
    return InvalidArgument(std::string(name) + ": a [P, 1, I] and the experts [E, Out, I] must be bfloat16 and the "
                           "output [1, Out] float32 (with the residual: bfloat16), got a " + DimsText(a.dimensions()) +
                           ", w2 " + DimsText(w2.dimensions()) + ", out " + DimsText(out->dimensions()) +
                           ", residual " + std::to_string(has_residual));
  const auto ad = a.dimensions(), wd = w2.dimensions();
  const int64_t U = ids.element_count(), P = ad[0], I = ad[2], E = wd[0], Out = wd[1];
  if (has_shared < 0 || has_shared > 1 || U < 1 || P != U + has_shared || P > kMaxSlots || ad[1] != 1 ||
      ids.element_type() != ffi::DataType::S32 || coef.element_type() != ffi::DataType::F32 ||
      coef.element_count() != U)
    return InvalidArgument(std::string(name) + ": ids int32 [U] and weights float32 [U] for the [U + shared, 1, I] "
                           "activations, at most " + std::to_string(kMaxSlots) + " slots, got ids " +
                           DimsText(ids.dimensions()) + ", weights " + DimsText(coef.dimensions()) + ", a " +
                           DimsText(ad) + ", shared " + std::to_string(has_shared));
  const int mv = static_cast<int>(I / 256);
  const size_t smem = static_cast<size_t>(P * I) * 2;
  if (wd[2] != I || I % 256 || (mv != 1 && mv != 2 && mv != 4 && mv != 8) || smem > kMaxDownSmem ||
      out->dimensions()[0] != 1 || out->dimensions()[1] != Out)
    return InvalidArgument(std::string(name) + ": I = " + std::to_string(I) + " must be 256, 512, 1024 or 2048 (the " +
                           "experts " + DimsText(wd) + "), the activations at most " + std::to_string(kMaxDownSmem) +
                           " bytes, the output [1, " + std::to_string(Out) + "]");
  if (has_shared && (!Bf16(shared, 2) || shared.dimensions()[0] != Out || shared.dimensions()[1] != I))
    return InvalidArgument(std::string(name) + ": the shared experts' down must be bfloat16 [" + std::to_string(Out) +
                           ", " + std::to_string(I) + "], got " + DimsText(shared.dimensions()));
  if (has_residual && (residual.element_type() != ffi::DataType::BF16 || residual.element_count() != Out))
    return InvalidArgument(std::string(name) + ": the residual must be bfloat16 [1, " + std::to_string(Out) + "], got " +
                           DimsText(residual.dimensions()));
  if (!Aligned16(a.untyped_data()) || !Aligned16(w2.untyped_data()) || !Aligned16(shared.untyped_data()))
    return InvalidArgument(std::string(name) + ": the activations and the experts must be 16-byte aligned");
  DownParams p{static_cast<const int*>(ids.untyped_data()), static_cast<const float*>(coef.untyped_data()),
               static_cast<const uint4*>(a.untyped_data()), static_cast<const uint4*>(w2.untyped_data()),
               static_cast<const uint4*>(shared.untyped_data()),
               static_cast<const __nv_bfloat16*>(residual.untyped_data()), out->untyped_data(), static_cast<int>(E),
               static_cast<int>(U), static_cast<int>(I), static_cast<int>(Out), static_cast<int>(has_shared),
               static_cast<int>(has_residual)};
  auto* kernel = mv == 1 ? Bf16DownKernel<1> : mv == 2 ? Bf16DownKernel<2> : mv == 4 ? Bf16DownKernel<4>
                                                                                    : Bf16DownKernel<8>;
  return LaunchPersistent(kernel, kThreads, smem, kMaxDownSmem, kWarps, Out, ctas, pdl, name, stream, p);
}

auto GateUpBinding() {  // the operands and attributes, once for both symbols
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("up_off")
      .Attr<int64_t>("act")
      .Attr<float>("beta")
      .Attr<float>("linear_beta")
      .Attr<int64_t>("shared")
      .Attr<int64_t>("route_k")
      .Attr<int64_t>("renorm")
      .Attr<float>("scale")
      .Attr<int64_t>("ctas")
      .Attr<int64_t>("pdl");
}

auto DownBinding() {  // the operands and attributes, once for both symbols
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("shared")
      .Attr<int64_t>("residual")
      .Attr<int64_t>("ctas")
      .Attr<int64_t>("pdl");
}

}  // namespace

// Each handler twice, outside XLA's command buffers and inside them (`*_cb`): ffi/targets.h says why.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_gate_up, CudaBf16GateUp, GateUpBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_gate_up_cb, CudaBf16GateUp, GateUpBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_down, CudaBf16Down, DownBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_down_cb, CudaBf16Down, DownBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

// jaxk3_bf16_gemv (platform "CUDA"): the decode GEMV y[0, 0, n] = W[n, :] · xn for one bf16 token, W [N, K] bf16
// (the checkpoint's and the serving layout's [out, in]), fp32 out; xn = x, or with `norm` the block's input RMSNorm
// RMSNorm(x; g, eps) in bf16 made by every CTA in shared memory (`gemv_norm`'s prologue: the sum of squares in
// float32, rsqrt(mean + eps), (g · x) · r rounded to bf16).  jaxk3/kernels/gemv.py calls it (`gemv.CUDA`, off until
// timed) where its Pallas kernel would run at one token.
//
// Why: the Pallas GEMV streams Kimi-Linear-48B's projections at 2.3-3.4 TB/s at one token (docs/PERF.md: KDA's fused
// in_proj 58 MB in 17.2 us with its norm, MLA's 31 MB in 11.6).  Here a warp owns a row pair, issues all of its
// 16-byte loads (a 2304-wide row is 9 a lane) before its first product (ffi/cuda_bf16_rows.h), the CTAs are persistent
// (as many as fit, each warp striding over the row pairs), and a CTA's first row pair is loaded before its prologue
// (the token's copy and norm), so the norm's latency hides under the loads.  No state.
//
// Sums are float32 in the lanes' order: the reference's (XLA's dot) to float32 rounding; the normed input agrees with
// `rms_norm_as` to one bf16 rounding at most (another sum order of the squares, the device's rsqrt).
//
// jaxk3_bf16_gemv_gnorm: the same GEMV with KDA's gated per-head norm as its prologue (`gemv_gnorm`'s function: KDA's
// o_proj at decode): xn = bf16(RMSNorm(x_h; g, eps) * sigmoid(z_h)) for each head h of d values, x and z the core's
// float32 output and gate [K], g float32 [d]; the Pallas kernel streams the 48B's o_proj (19 MB) at 2.3 TB/s.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "cuda_bf16_rows.h"
#include "cuda_persistent_grid.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxK = 16384;  // the token in shared memory (32 KB)
constexpr int kFirst = 5;     // vectors a lane and row loaded before the prologue (10 loads: more spill at 128 registers,
                              // and a spilled register waits for its load)

enum Prologue { kPlain = 0, kRmsNorm = 1, kGatedHeads = 2 };

struct Params {
  const uint4* x;       // [K / 8] the token, bf16 (kPlain, kRmsNorm)
  const uint4* g;       // [K / 8] the norm weight, bf16 (kRmsNorm)
  const float* xf;      // [K] the core's output, float32 (kGatedHeads)
  const float* zf;      // [K] its gate, float32 (kGatedHeads)
  const float* gf;      // [d] the per-head norm weight, float32 (kGatedHeads)
  const uint4* w;       // [N, K / 8]
  float* out;           // [N]
  int N, K, norm, d;    // norm: a Prologue; d: the head size (kGatedHeads)
  float eps;
};

__device__ __forceinline__ uint32_t Pack(float lo, float hi) {  // two float32 -> a bf16 pair, round to nearest even
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float Squares(uint32_t u) { return bf16::Lo(u) * bf16::Lo(u) + bf16::Hi(u) * bf16::Hi(u); }

__device__ __forceinline__ uint32_t NormPair(uint32_t x, uint32_t g, float r) {
  return Pack((bf16::Lo(g) * bf16::Lo(x)) * r, (bf16::Hi(g) * bf16::Hi(x)) * r);
}

__global__ void __launch_bounds__(kThreads, 2) Bf16GemvKernel(Params p) {
  extern __shared__ uint4 xs[];  // [K / 8]
  __shared__ float red[kWarps];
  const int n8 = p.K / 8, M = p.K / 256, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long pairs = (p.N + 1) / 2, stride = static_cast<long long>(gridDim.x) * kWarps;
  long long it = static_cast<long long>(blockIdx.x) * kWarps + warp;
  auto rows = [&](long long i, const uint4*& r0, const uint4*& r1, int& n0, int& n1) {
    n0 = static_cast<int>(2 * i);
    n1 = n0 + 1 < p.N ? n0 + 1 : n0;  // an odd N's last pair reads its row twice and writes it once
    r0 = p.w + static_cast<long long>(n0) * n8;
    r1 = p.w + static_cast<long long>(n1) * n8;
  };
  bf16::Rows2<kFirst> first;
  const uint4 *r0 = nullptr, *r1 = nullptr;
  int n0 = 0, n1 = 0;
  if (it < pairs) {  // the first row pair's loads in flight before the prologue
    rows(it, r0, r1, n0, n1);
    bf16::Load2(first, r0, r1, 0, M, lane);
  }
  WaitForPredecessors();  // the token (or KDA's core output and gate) comes from the kernels before; the weights do not
  if (p.norm == kGatedHeads) {  // a warp a head: its squares' sum in the lanes, then (g x) r sigmoid(z) in bf16
    __nv_bfloat16* xb = reinterpret_cast<__nv_bfloat16*>(xs);
    for (int h = warp; h < p.K / p.d; h += kWarps) {
      const float *xh = p.xf + h * p.d, *zh = p.zf + h * p.d;
      float ss = 0.0f;
      for (int j = lane; j < p.d; j += 32) ss = fmaf(xh[j], xh[j], ss);
      const float r = rsqrtf(bf16::WarpSum(ss) / static_cast<float>(p.d) + p.eps);
      for (int j = lane; j < p.d; j += 32)
        xb[h * p.d + j] = __float2bfloat16_rn((p.gf[j] * xh[j]) * r * (1.0f / (1.0f + expf(-zh[j]))));
    }
    __syncthreads();
  } else {
    for (int i = threadIdx.x; i < n8; i += kThreads) xs[i] = p.x[i];
    __syncthreads();
  }
  if (p.norm == kRmsNorm) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n8; i += kThreads) {
      const uint4 v = xs[i];
      ss += Squares(v.x) + Squares(v.y) + Squares(v.z) + Squares(v.w);
    }
    ss = bf16::WarpSum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < kWarps; ++i) total += red[i];  // the same order in every thread
    const float r = rsqrtf(total / static_cast<float>(p.K) + p.eps);
    for (int i = threadIdx.x; i < n8; i += kThreads) {
      const uint4 v = xs[i], g = p.g[i];
      xs[i] = make_uint4(NormPair(v.x, g.x, r), NormPair(v.y, g.y, r), NormPair(v.z, g.z, r), NormPair(v.w, g.w, r));
    }
    __syncthreads();
  }
  auto store = [&](float d0, float d1) {
    if (lane == 0) {
      p.out[n0] = d0;
      if (n1 != n0) p.out[n1] = d1;
    }
  };
  if (it < pairs) {  // the first row pair, its first chunk loaded before the prologue
    float d0, d1;
    bf16::FinishRows2(first, r0, r1, xs, M, lane, d0, d1);
    store(d0, d1);
  }
  for (it += stride; it < pairs; it += stride) {
    float d0, d1;
    rows(it, r0, r1, n0, n1);
    bf16::DotRows2(r0, r1, xs, M, lane, d0, d1);
    store(d0, d1);
  }
}

ffi::Error Launch(cudaStream_t stream, const Params& p, int64_t ctas, int64_t pdl, const char* name) {
  return LaunchPersistent(Bf16GemvKernel, kThreads, static_cast<size_t>(p.K) * 2, 2 * kMaxK, kWarps, (p.N + 1) / 2,
                          ctas, pdl, name, stream, p);
}

ffi::Error CudaBf16Gemv(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer g,
                        ffi::Result<ffi::AnyBuffer> out, int64_t norm, float eps, int64_t ctas, int64_t pdl) {
  const char* name = "jaxk3_bf16_gemv";
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || wd.size() != 2 ||
      out->element_type() != ffi::DataType::F32)
    return InvalidArgument(std::string(name) + ": one bf16 token, bf16 weights [N, K] and a float32 output, got x " +
                           DimsText(x.dimensions()) + ", w " + DimsText(wd));
  const int64_t N = wd[0], K = wd[1];
  if (x.element_count() != K || K < 256 || K % 256 || K > kMaxK || N < 1 || out->element_count() != N)
    return InvalidArgument(std::string(name) + ": x [1, K] and the output [1, 1, N] for w " + DimsText(wd) +
                           ", K a multiple of 256 up to " + std::to_string(kMaxK) + ", got x " +
                           DimsText(x.dimensions()) + ", out " + DimsText(out->dimensions()));
  if (norm != 0 && norm != 1) return InvalidArgument(std::string(name) + ": norm must be 0 or 1");
  if (norm && (g.element_type() != ffi::DataType::BF16 || g.element_count() != K))
    return InvalidArgument(std::string(name) + ": the norm weight must be bf16 [" + std::to_string(K) + "], got " +
                           DimsText(g.dimensions()));
  for (const void* a : {x.untyped_data(), w.untyped_data(), g.untyped_data()})
    if (reinterpret_cast<uintptr_t>(a) % 16)
      return InvalidArgument(std::string(name) + ": the token, the weights and the norm weight must be 16-byte aligned");
  Params p{static_cast<const uint4*>(x.untyped_data()), static_cast<const uint4*>(g.untyped_data()), nullptr, nullptr,
           nullptr, static_cast<const uint4*>(w.untyped_data()), static_cast<float*>(out->untyped_data()),
           static_cast<int>(N), static_cast<int>(K), static_cast<int>(norm), 0, eps};
  return Launch(stream, p, ctas, pdl, name);
}

ffi::Error CudaBf16GemvGnorm(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer z, ffi::AnyBuffer g,
                             ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, float eps, int64_t ctas, int64_t pdl) {
  const char* name = "jaxk3_bf16_gemv_gnorm";
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::F32 || z.element_type() != ffi::DataType::F32 ||
      g.element_type() != ffi::DataType::F32 || w.element_type() != ffi::DataType::BF16 || wd.size() != 2 ||
      out->element_type() != ffi::DataType::F32)
    return InvalidArgument(std::string(name) + ": float32 x, z [1, K] and norm weight [d], bf16 weights [N, K] and a "
                           "float32 output, got x " + DimsText(x.dimensions()) + ", w " + DimsText(wd));
  const int64_t N = wd[0], K = wd[1], d = g.element_count();
  if (x.element_count() != K || z.element_count() != K || K < 256 || K % 256 || K > kMaxK || N < 1 ||
      out->element_count() != N)
    return InvalidArgument(std::string(name) + ": x and z [1, K] and the output [1, 1, N] for w " + DimsText(wd) +
                           ", K a multiple of 256 up to " + std::to_string(kMaxK) + ", got x " +
                           DimsText(x.dimensions()) + ", z " + DimsText(z.dimensions()) + ", out " +
                           DimsText(out->dimensions()));
  if (d < 32 || d % 32 || K % d)
    return InvalidArgument(std::string(name) + ": the head size d (the norm weight's length) must be a multiple of 32 "
                           "dividing K = " + std::to_string(K) + ", got " + DimsText(g.dimensions()));
  if (reinterpret_cast<uintptr_t>(w.untyped_data()) % 16)
    return InvalidArgument(std::string(name) + ": the weights must be 16-byte aligned");
  Params p{nullptr, nullptr, static_cast<const float*>(x.untyped_data()), static_cast<const float*>(z.untyped_data()),
           static_cast<const float*>(g.untyped_data()), static_cast<const uint4*>(w.untyped_data()),
           static_cast<float*>(out->untyped_data()), static_cast<int>(N), static_cast<int>(K), kGatedHeads,
           static_cast<int>(d), eps};
  return Launch(stream, p, ctas, pdl, name);
}

auto GemvBinding() {  // the operands and attributes, once for both symbols
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("norm")
      .Attr<float>("eps")
      .Attr<int64_t>("ctas")
      .Attr<int64_t>("pdl");
}

auto GnormBinding() {  // the operands and attributes, once for both symbols
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<float>("eps")
      .Attr<int64_t>("ctas")
      .Attr<int64_t>("pdl");
}

}  // namespace

// Each handler twice, outside XLA's command buffers and inside them (`*_cb`): ffi/targets.h says why.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_gemv, CudaBf16Gemv, GemvBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_gemv_cb, CudaBf16Gemv, GemvBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_gemv_gnorm, CudaBf16GemvGnorm, GnormBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_bf16_gemv_gnorm_cb, CudaBf16GemvGnorm, GnormBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

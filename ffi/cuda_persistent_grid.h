// Persistent grids: how many CTAs of a kernel fit the GPU at once (the occupancy API x the SM count, read once per
// kernel and device), for the MXFP4 kernels' streaming form (ffi/cuda_mxfp4_*.cu, which balance their items with
// mxfp4::StreamGrid) and the one-token bf16 kernels (ffi/cuda_bf16_*.cu: as many CTAs as fit, at most one per `per_cta`
// items, each warp striding over the items), and the bf16 kernels' launch, plain or programmatic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace jaxk3 {

// What a launch needs to know of a kernel on the current GPU.
struct KernelFacts {
  long long fit = 0;    // CTAs resident at once: the occupancy API x the SM count, 0 where one does not fit
  int ptx_version = 0;  // the virtual architecture its code for this GPU was built from (90: compute_90)
};

// `kernel`'s facts at `threads` a CTA and `smem` bytes of dynamic shared memory.  Sets the kernel's dynamic
// shared-memory opt-in to `smem_optin` first (the instance's largest, the same every call, so that no call lowers it
// under another's launch).  The device is the current one: cudaStreamGetDevice is refused under stream capture on the
// device's driver 580, and XLA captures these calls into its command buffers.  The answer is kept per (kernel, device,
// threads, smem, opt-in): the runtime queries cost host time on every call otherwise, and the one-token kernels run
// ~100 times a step (the answer cannot change within a process).  A kept answer skips setting the opt-in again, so each
// kernel must always be called with the same `smem_optin` (every caller passes a per-instance constant).
template <typename K>
cudaError_t ReadKernelFacts(K kernel, int threads, size_t smem, int smem_optin, KernelFacts& facts) {
  struct Known {
    const void* kernel;
    int device, threads, optin;
    size_t smem;
    KernelFacts facts;
  };
  static std::mutex mu;
  static std::vector<Known> known;
  facts = KernelFacts{};
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Known& k : known)
      if (k.kernel == key && k.device == device && k.threads == threads && k.smem == smem && k.optin == smem_optin) {
        facts = k.facts;
        return cudaSuccess;
      }
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin);
  int sms = 0, per_sm = 0;
  cudaFuncAttributes attrs = {};
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attrs, kernel);
  if (e != cudaSuccess) return e;
  KernelFacts f;
  f.fit = static_cast<long long>(per_sm) * sms;
  f.ptx_version = attrs.ptxVersion;
  std::lock_guard<std::mutex> lock(mu);
  known.push_back({key, device, threads, smem_optin, smem, f});
  facts = f;
  return cudaSuccess;
}

// How many CTAs of `kernel` fit the current GPU at once (ReadKernelFacts' `fit`): the MXFP4 kernels' streaming form
// sizes its grid from it.
template <typename K>
cudaError_t ResidentCtas(K kernel, int threads, size_t smem, int smem_optin, long long& fit) {
  KernelFacts f;
  const cudaError_t e = ReadKernelFacts(kernel, threads, smem, smem_optin, f);
  fit = f.fit;
  return e;
}

// Programmatic dependent launch (sm_90): XLA launches every kernel of a step with it, each kernel's first memory
// access behind `griddepcontrol.wait` (docs/PERF.md, ninth session), so that the launch of a kernel overlaps the end
// of the one before.  A kernel launched without it waits in the stream for the one before to finish before it is
// launched at all.  A kernel meant for either launch calls this before its first read of anything the kernels
// before it write (its inputs but the weights); launched without the attribute it returns at once.  Only loads that
// no kernel of the step writes may come before it (the weights, through bf16::Stream16, whose asm is not ordered
// against it); and no CTA may exit before it, so that the kernels after this one wait for those before it too.
__device__ __forceinline__ void WaitForPredecessors() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches `kernel(params)` on `stream` on the bf16 kernels' grid: as many CTAs as fit at once, at most one per
// `per_cta` of the `items`, or the tests' cap `ctas` (0: none); with `pdl` 1 as a programmatic dependent launch (the
// kernel must call WaitForPredecessors first, as above).  Errors name the call (`name`): `ctas` or `pdl` out of
// range, a CTA that fits no SM, a programmatic launch of code built for an architecture older than sm_90 (its wait
// compiled out, so it would read its inputs before the kernels ahead had written them), the launch's own.
template <typename K, typename P>
xla::ffi::Error LaunchPersistent(K kernel, int threads, size_t smem, int smem_optin, long long per_cta, long long items,
                                 int64_t ctas, int64_t pdl, const char* name, cudaStream_t stream, const P& params) {
  if (ctas < 0) return InvalidArgument(std::string(name) + ": ctas must be 0 (as many as fit) or a cap");
  if (pdl != 0 && pdl != 1) return InvalidArgument(std::string(name) + ": pdl must be 0 or 1");
  KernelFacts facts;
  if (cudaError_t e = ReadKernelFacts(kernel, threads, smem, smem_optin, facts); e != cudaSuccess)
    return Internal(std::string(name) + ": launch setup: " + cudaGetErrorString(e));
  if (facts.fit < 1)
    return InvalidArgument(std::string(name) + ": a CTA with " + std::to_string(smem) +
                           " bytes of shared memory does not fit an SM");
  if (pdl && facts.ptx_version < 90)
    return InvalidArgument(std::string(name) + ": pdl needs the kernel built for sm_90 or later (its code is compute_" +
                           std::to_string(facts.ptx_version) + "'s, without the wait): launch it with pdl 0");
  long long n = facts.fit;
  const long long need = (items + per_cta - 1) / per_cta;
  if (need < n) n = need;
  if (ctas > 0 && ctas < n) n = ctas;
  const unsigned grid = static_cast<unsigned>(n < 1 ? 1 : n);
  if (pdl) {
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, params); e != cudaSuccess) {
      (void)cudaGetLastError();  // (not left for a later call's check to report under its name)
      return Internal(std::string(name) + ": launch: " + cudaGetErrorString(e));
    }
  } else {
    kernel<<<grid, threads, smem, stream>>>(params);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return Internal(std::string(name) + ": launch: " + cudaGetErrorString(e));
  return xla::ffi::Error::Success();
}

}  // namespace jaxk3

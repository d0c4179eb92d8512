// Persistent grids: how many CTAs of a kernel fit the GPU at once (the occupancy API x the SM count, read once per
// kernel and device), for the MXFP4 kernels' streaming form (ffi/cuda_mxfp4_*.cu, which balance their items over
// that many CTAs with mxfp4::StreamGrid).
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <vector>

namespace jaxk3 {

// How many CTAs of `kernel` (`threads` a CTA, `smem` bytes of dynamic shared memory) fit the current GPU at once:
// the occupancy API x the SM count, 0 where one does not fit.  Sets the kernel's dynamic shared-memory opt-in to
// `smem_optin` first (the instance's largest, the same every call, so that no call lowers it under another's launch).
// The device is the current one: cudaStreamGetDevice is refused under stream capture on the device's driver 580, and
// XLA captures these calls into its command buffers.  The answer is kept per (kernel, device, threads, smem, opt-in):
// the runtime queries cost host time on every call otherwise, and it cannot change within a process.  A kept answer
// skips setting the opt-in again, so each kernel must always be called with the same `smem_optin` (every caller
// passes a per-instance constant).
template <typename K>
cudaError_t ResidentCtas(K kernel, int threads, size_t smem, int smem_optin, long long& fit) {
  struct Known {
    const void* kernel;
    int device, threads, optin;
    size_t smem;
    long long fit;
  };
  static std::mutex mu;
  static std::vector<Known> known;
  fit = 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Known& k : known)
      if (k.kernel == key && k.device == device && k.threads == threads && k.smem == smem && k.optin == smem_optin) {
        fit = k.fit;
        return cudaSuccess;
      }
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin);
  int sms = 0, per_sm = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  if (e != cudaSuccess) return e;
  const long long n = static_cast<long long>(per_sm) * sms;
  std::lock_guard<std::mutex> lock(mu);
  known.push_back({key, device, threads, smem_optin, smem, n});
  fit = n;
  return cudaSuccess;
}

}  // namespace jaxk3

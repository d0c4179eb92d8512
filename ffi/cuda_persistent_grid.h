// The persistent grid of the one-token bf16 CUDA kernels (ffi/cuda_bf16_experts.cu, ffi/cuda_bf16_gemv.cu): as many
// CTAs as fit the GPU at once (the occupancy API x the SM count, read at each call), at most one per `per_cta` items,
// or the tests' `cap`; each warp then strides over the items.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common.h"

namespace jaxk3 {

template <typename K>
xla::ffi::Error PersistentGrid(K kernel, int threads, size_t smem, int smem_optin, long long per_cta, long long items,
                               long long cap, const char* name, unsigned& grid) {
  // (the dynamic shared-memory opt-in at the instance's largest, the same every call; the current device:
  // cudaStreamGetDevice is refused under stream capture on the device's driver 580, and XLA captures these calls)
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin);
  int device = 0, sms = 0, per_sm = 0;
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  if (e != cudaSuccess) return Internal(std::string(name) + ": launch setup: " + cudaGetErrorString(e));
  if (per_sm < 1)
    return InvalidArgument(std::string(name) + ": a CTA with " + std::to_string(smem) +
                           " bytes of shared memory does not fit an SM");
  long long n = static_cast<long long>(per_sm) * sms, need = (items + per_cta - 1) / per_cta;
  if (need < n) n = need;
  if (cap > 0 && cap < n) n = cap;
  grid = static_cast<unsigned>(n < 1 ? 1 : n);
  return xla::ffi::Error::Success();
}

}  // namespace jaxk3

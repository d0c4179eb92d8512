// jaxk3_local_tile (platform "CUDA"): [n, *x.shape] from n copies of the local operand, one
// small kernel on XLA's stream.  No communication and no state, so it is command-buffer
// compatible.  It is the benchmark's "ffi_floor": what one FFI call plus its kernel costs in a
// dependent chain, with the exchange taken out.
#include <cuda_runtime.h>

#include <string>

#include "common.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

// Grid-stride copy of `copies` replicas; 16-byte accesses when sizes and addresses allow.
__global__ void LocalTileKernel(const char* in, char* out, unsigned long long bytes, unsigned long long copies) {
  const unsigned long long total = bytes * copies;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long tid = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool wide = bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16 == 0;
  if (wide) {
    const unsigned long long words = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(in);
    uint4* d = reinterpret_cast<uint4*>(out);
    for (unsigned long long i = tid; i < words * copies; i += stride) d[i] = s[i % words];
  } else {
    for (unsigned long long i = tid; i < total; i += stride) out[i] = in[i % bytes];
  }
}

ffi::Error CudaLocalTile(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const size_t bytes = x.size_bytes();
  if (ffi::Error err = CheckWholeCopies("jaxk3_local_tile", y->size_bytes(), bytes); err.failure()) return err;
  const unsigned long long copies = y->size_bytes() / bytes;
  const unsigned long long units = (bytes % 16 == 0 ? bytes / 16 : bytes) * copies;
  const int threads = 256;
  int blocks = static_cast<int>((units + threads - 1) / threads);
  if (blocks > 64) blocks = 64;
  if (blocks < 1) blocks = 1;
  LocalTileKernel<<<blocks, threads, 0, stream>>>(static_cast<const char*>(x.untyped_data()),
                                                  static_cast<char*>(y->untyped_data()), bytes, copies);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return Internal(std::string("jaxk3_local_tile: launch: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_local_tile, CudaLocalTile,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

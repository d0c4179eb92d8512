// Test hooks of the CUDA transport (cuda_comm.h).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda_comm.h"
#include "cuda_util.h"

namespace jaxk3 {

// Launches a gather on rank 0 of a private communicator of `ordinals` (keyed by negative device
// ids, so no program's communicator is touched) while no other rank ever arrives, waits for it
// on its own stream, and returns the failure it reported ("" if none) and the wall time in
// *waited_ms; with two_streams, a second kernel of the same communicator on another stream
// overlaps the first (to check that the overlap is reported).  Synchronises: never call it with
// gathers in flight.
std::string CudaLonelyGatherForTest(const std::vector<int>& ordinals, int64_t timeout_ms, bool two_streams,
                                    double* waited_ms) {
  std::vector<int64_t> key;
  for (size_t i = 0; i < ordinals.size(); ++i) key.push_back((two_streams ? -2000 : -1000) - static_cast<int64_t>(i));
  std::string why;
  CudaComm* c = GetCudaComm(key, ordinals, &why);
  if (c == nullptr) return "setup failed: " + why;
  ScopedSetup scope;
  cudaSetDevice(ordinals[0]);
  char* buf = nullptr;
  cudaStream_t s = nullptr, s2 = nullptr;
  if (cudaMalloc(&buf, 2 * 64 * (1 + ordinals.size())) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return "setup failed: allocation";
  }
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0, s);
  std::string err = LaunchCudaGather(c, 0, buf, buf + 64, 64, s, timeout_ms);
  if (err.empty() && two_streams) {
    const size_t half = 64 * (1 + ordinals.size());
    err = LaunchCudaGather(c, 0, buf + half, buf + half + 64, 64, s2, timeout_ms);
  }
  cudaEventRecord(t1, s);
  cudaStreamSynchronize(s);
  cudaStreamSynchronize(s2);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  *waited_ms = ms;
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaStreamDestroy(s);
  cudaStreamDestroy(s2);
  cudaFree(buf);
  if (!err.empty()) return "launch failed: " + err;
  return CudaCommFailure(c);
}

}  // namespace jaxk3

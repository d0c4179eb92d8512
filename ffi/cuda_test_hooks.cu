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

namespace jaxk3 {

std::string CudaSharedGpuGatherForTest(int ordinal, int n, size_t bytes, int calls) {
  if (n < 2 || n > kCudaMaxRanks || bytes == 0) return "bad arguments";
  std::vector<int64_t> key;
  for (int r = 0; r < n; ++r) key.push_back(-3000 - r);
  std::unique_ptr<CudaComm> comm;  // private: freed (leaked on failure paths) by this hook alone
  if (std::string err = CreateCudaComm(key, std::vector<int>(n, ordinal), /*shared_gpu=*/true, &comm); !err.empty()) {
    return "setup failed: " + err;
  }
  ScopedSetup scope;
  cudaSetDevice(ordinal);
  char* in = nullptr;
  char* out = nullptr;
  std::vector<cudaStream_t> streams(n, nullptr);
  if (cudaMalloc(&in, bytes * n) != cudaSuccess || cudaMalloc(&out, bytes * n * n) != cudaSuccess) {
    cudaGetLastError();
    return "setup failed: allocation";
  }
  for (auto& s : streams) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::string wrong;
  std::vector<unsigned char> host_in(bytes * n), host_out(bytes * n * n);
  for (int call = 0; call < calls && wrong.empty(); ++call) {
    for (size_t i = 0; i < host_in.size(); ++i) host_in[i] = static_cast<unsigned char>(i * 131 + call * 7 + 1);
    cudaMemcpy(in, host_in.data(), host_in.size(), cudaMemcpyHostToDevice);
    cudaMemset(out, 0xA5, bytes * n * n);
    cudaDeviceSynchronize();
    for (int r = 0; r < n && wrong.empty(); ++r) {
      wrong = LaunchCudaGather(comm.get(), r, in + r * bytes, out + r * bytes * n, bytes, streams[r], 5000);
    }
    cudaDeviceSynchronize();
    if (!wrong.empty()) break;
    if (std::string failed = CudaCommFailure(comm.get()); !failed.empty()) {
      wrong = failed;
      break;
    }
    cudaMemcpy(host_out.data(), out, host_out.size(), cudaMemcpyDeviceToHost);
    for (int q = 0; q < n && wrong.empty(); ++q) {
      for (size_t i = 0; i < bytes * n; ++i) {  // rank q's output: every rank's input, rank-major
        if (host_out[q * bytes * n + i] != host_in[i]) {
          wrong = "call " + std::to_string(call) + ": rank " + std::to_string(q) + " output byte " + std::to_string(i) +
                  " is " + std::to_string(host_out[q * bytes * n + i]) + ", expected " + std::to_string(host_in[i]);
          break;
        }
      }
    }
  }
  for (auto& s : streams) cudaStreamDestroy(s);
  cudaFree(in);
  cudaFree(out);
  if (wrong.empty()) {  // a communicator that failed may still have kernels spinning: leak it
    for (char* b : comm->base) cudaFree(b);
    cudaFreeHost(const_cast<CudaErrorWords*>(comm->host_err));
  } else {
    comm.release();
  }
  cudaGetLastError();
  return wrong;
}

}  // namespace jaxk3

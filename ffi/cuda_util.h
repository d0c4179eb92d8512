// Small CUDA helpers shared by the .cu files (not by host-only code).
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace jaxk3 {

inline std::string CudaErr(const char* what, cudaError_t e) {
  return std::string("jaxk3 CUDA gather: ") + what + ": " + cudaGetErrorString(e);
}

// Restores the thread's device and stream-capture mode on scope exit.
class ScopedSetup {
 public:
  ScopedSetup() {
    if (cudaGetDevice(&device_) != cudaSuccess) device_ = -1;
    cudaGetLastError();
    mode_ = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  ~ScopedSetup() {
    cudaThreadExchangeStreamCaptureMode(&mode_);
    if (device_ >= 0) cudaSetDevice(device_);
  }
  ScopedSetup(const ScopedSetup&) = delete;
  ScopedSetup& operator=(const ScopedSetup&) = delete;

 private:
  int device_ = -1;
  cudaStreamCaptureMode mode_;
};

}  // namespace jaxk3

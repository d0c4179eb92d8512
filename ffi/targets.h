// The FFI targets this library registers, one line each: adding a collective means its handler
// file plus one line in a list below.  Python registers every target of a list under the
// platform name of the list (jaxk3/collectives/registry.py).
#pragma once

#include <vector>

// X(target name, handler symbol)
#define JAXK3_CPU_TARGETS(X)                                     \
  X("jaxk3_one_shot_all_gather", jaxk3_cpu_one_shot_all_gather) \
  X("jaxk3_padded_all_gather", jaxk3_cpu_padded_all_gather)     \
  X("jaxk3_local_tile", jaxk3_cpu_local_tile) /* bench floor, no communication */

#define JAXK3_CUDA_TARGETS(X)                                     \
  X("jaxk3_one_shot_all_gather", jaxk3_cuda_one_shot_all_gather) \
  X("jaxk3_padded_all_gather", jaxk3_cuda_padded_all_gather)     \
  X("jaxk3_local_tile", jaxk3_cuda_local_tile) /* bench floor, no communication */

namespace jaxk3 {

struct Target {
  const char* name;
  void* execute;  // the handler symbol's address
};

std::vector<Target> CpuTargets();
std::vector<Target> CudaTargets();  // empty when built without CUDA

}  // namespace jaxk3

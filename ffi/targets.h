// The FFI targets this library registers, one line each: adding a collective means its handler
// file plus one line in a list below.  Python registers every target of a list under the
// platform name of the list (jaxk3/collectives/registry.py).
#pragma once

#include <vector>

// X(target name, handler symbol).  The CPU collectives also get the instantiate stage that
// gives each custom-call instance its CallInstance (call_instance.h).
#define JAXK3_CPU_COLLECTIVES(X)                                 \
  X("jaxk3_one_shot_all_gather", jaxk3_cpu_one_shot_all_gather) \
  X("jaxk3_padded_all_gather", jaxk3_cpu_padded_all_gather)     \
  X("jaxk3_all_reduce", jaxk3_cpu_all_reduce)

#define JAXK3_CPU_TARGETS(X) X("jaxk3_local_tile", jaxk3_cpu_local_tile) /* bench floor, no communication */

#define JAXK3_CUDA_TARGETS(X)                                     \
  X("jaxk3_one_shot_all_gather", jaxk3_cuda_one_shot_all_gather) \
  X("jaxk3_padded_all_gather", jaxk3_cuda_padded_all_gather)     \
  X("jaxk3_local_tile", jaxk3_cuda_local_tile) /* bench floor, no communication */

// The model's CUDA kernels (jaxk3/kernels/ registers them itself: kernels and collectives stay apart).  Their calling
// convention's version (operands and attributes, `cuda_kernels_abi` in the module): raise it with any change to
// one, and jaxk3/kernels/mxfp4_cuda.py's ABI with it, so that an extension built before the change is refused by
// name instead of failing its first call.  2: the `l2` attribute, the raw (bf16) and wide ([tokens, ...]) inputs;
// 3: gate-up's `stages` and `ctas`; 4: down's; 5: the bf16 kernels' `pdl`; 6: the bf16 kernels removed (they lost
// to the Pallas kernels in the 48B step in every launch form timed: docs/PERF.md, twenty-seventh session).
#define JAXK3_CUDA_KERNELS_ABI 6
#define JAXK3_CUDA_KERNELS(X) \
  X("jaxk3_mxfp4_gate_up", jaxk3_cuda_mxfp4_gate_up) /* moe_experts' kernel 1, 1 to 8 tokens */ \
  X("jaxk3_mxfp4_down", jaxk3_cuda_mxfp4_down)       /* moe_experts' kernel 2, 1 to 8 tokens */

namespace jaxk3 {

struct Target {
  const char* name;
  void* execute;                  // the handler symbol's address
  void* instantiate = nullptr;    // the instantiate stage's, if any
};

// A type XLA must know (the FFI state types), for jax.ffi.register_ffi_type.
struct FfiType {
  const char* name;
  void* type_id;    // XLA_FFI_TypeId*
  void* type_info;  // const XLA_FFI_TypeInfo*
};

std::vector<Target> CpuTargets();
std::vector<FfiType> CpuTypes();
std::vector<Target> CudaTargets();  // empty when built without CUDA
std::vector<Target> CudaKernels();  // the same

}  // namespace jaxk3

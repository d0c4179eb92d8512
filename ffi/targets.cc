// The registration tables of targets.h.
#include "targets.h"

#include "call_instance.h"
#include "common.h"

#define JAXK3_DECLARE(name, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
#define JAXK3_ENTRY(name, symbol) Target{name, HandlerAddress(symbol)},
#define JAXK3_STATEFUL_ENTRY(name, symbol) \
  Target{name, HandlerAddress(symbol), HandlerAddress(jaxk3_cpu_call_instance)},

namespace jaxk3 {

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cpu_call_instance);
JAXK3_CPU_COLLECTIVES(JAXK3_DECLARE)
JAXK3_CPU_TARGETS(JAXK3_DECLARE)
#ifdef JAXK3_WITH_CUDA
JAXK3_CUDA_TARGETS(JAXK3_DECLARE)
JAXK3_CUDA_KERNELS(JAXK3_DECLARE)
#endif

std::vector<Target> CpuTargets() {
  return {JAXK3_CPU_COLLECTIVES(JAXK3_STATEFUL_ENTRY) JAXK3_CPU_TARGETS(JAXK3_ENTRY)};
}

std::vector<FfiType> CpuTypes() {
  return {FfiType{"jaxk3.call_instance", &CallInstance::id,
                  const_cast<void*>(static_cast<const void*>(&CallInstance::info))}};
}

std::vector<Target> CudaTargets() {
#ifdef JAXK3_WITH_CUDA
  return {JAXK3_CUDA_TARGETS(JAXK3_ENTRY)};
#else
  return {};
#endif
}

std::vector<Target> CudaKernels() {
#ifdef JAXK3_WITH_CUDA
  return {JAXK3_CUDA_KERNELS(JAXK3_ENTRY)};
#else
  return {};
#endif
}

}  // namespace jaxk3

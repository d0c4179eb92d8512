// The registration tables of targets.h.
#include "targets.h"

#include "common.h"

#define JAXK3_DECLARE(name, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
#define JAXK3_ENTRY(name, symbol) Target{name, HandlerAddress(symbol)},

namespace jaxk3 {

JAXK3_CPU_TARGETS(JAXK3_DECLARE)
#ifdef JAXK3_WITH_CUDA
JAXK3_CUDA_TARGETS(JAXK3_DECLARE)
#endif

std::vector<Target> CpuTargets() { return {JAXK3_CPU_TARGETS(JAXK3_ENTRY)}; }

std::vector<Target> CudaTargets() {
#ifdef JAXK3_WITH_CUDA
  return {JAXK3_CUDA_TARGETS(JAXK3_ENTRY)};
#else
  return {};
#endif
}

}  // namespace jaxk3

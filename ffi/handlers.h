// The handler symbols the nanobind module exports as capsules, per platform.
#pragma once

#include <cstddef>

#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

// Slot alignment of the padded variant: each rank's payload is padded to this in transport.
constexpr size_t kTransportAlign = 16;

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cpu_one_shot_all_gather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cpu_padded_all_gather);
// Benchmark floor: [n, *x.shape] from n local copies, no communication (local_tile.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cpu_local_tile);

#ifdef JAXK3_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cuda_one_shot_all_gather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cuda_padded_all_gather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxk3_cuda_local_tile);
#endif

}  // namespace jaxk3

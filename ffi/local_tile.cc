// jaxk3_local_tile (platform "cpu"): the gather's output shape [n, *x.shape] written by copying
// the local operand n times.  No communication: the benchmark's "ffi_floor" (one FFI call of the
// same shape as a gather, in the same dependent chain), nothing else uses it.
#include <cstring>
#include <string>

#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

ffi::Error CpuLocalTile(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const size_t bytes = x.size_bytes();
  if (bytes == 0 || y->size_bytes() % bytes != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxk3_local_tile: output of " + std::to_string(y->size_bytes()) +
                          " bytes is not a whole number of " + std::to_string(bytes) + "-byte operands");
  }
  char* out = static_cast<char*>(y->untyped_data());
  for (size_t off = 0; off < y->size_bytes(); off += bytes) std::memcpy(out + off, x.untyped_data(), bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_local_tile, CpuLocalTile,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

}  // namespace jaxk3

// jaxk3_local_tile (platform "cpu"): the gather's output shape [n, *x.shape] written by copying
// the local operand n times.  No communication: the benchmark's "ffi_floor" (one FFI call of the
// same shape as a gather, in the same dependent chain), nothing else uses it.
#include <cstring>

#include "common.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

ffi::Error CpuLocalTile(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const size_t bytes = x.size_bytes();
  if (ffi::Error err = CheckWholeCopies("jaxk3_local_tile", y->size_bytes(), bytes); err.failure()) return err;
  char* out = static_cast<char*>(y->untyped_data());
  for (size_t off = 0; off < y->size_bytes(); off += bytes) std::memcpy(out + off, x.untyped_data(), bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_local_tile, CpuLocalTile,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

}  // namespace jaxk3

// XLA FFI handlers for platform "cpu": the one-shot and padded all-gathers through HostComm.
// Output: [n, *x.shape], rank-major.
#include <cstring>
#include <vector>

#include "cpu_collective.h"
#include "transport.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

// Every operand into every output, rank-major.
ffi::Error GatherCombine(const RoundBuffers& r) {
  for (int q = 0; q < r.n; ++q) {
    char* out = static_cast<char*>(r.out[q]);
    for (int s = 0; s < r.n; ++s) std::memcpy(out + s * r.bytes, r.in[s], r.bytes);
  }
  return ffi::Error::Success();
}

// The padded transport: each payload goes into a slot padded to kTransportAlign, and every
// slot's padding is stripped on the way out.
ffi::Error PaddedCombine(const RoundBuffers& r) {
  const size_t stride = (r.bytes + kTransportAlign - 1) / kTransportAlign * kTransportAlign;
  std::vector<char> slots(stride * r.n, 0);
  for (int s = 0; s < r.n; ++s) std::memcpy(slots.data() + s * stride, r.in[s], r.bytes);
  for (int q = 0; q < r.n; ++q) {
    char* out = static_cast<char*>(r.out[q]);
    for (int s = 0; s < r.n; ++s) std::memcpy(out + s * r.bytes, slots.data() + s * stride, r.bytes);
  }
  return ffi::Error::Success();
}

ffi::Future CpuOneShot(int32_t ordinal, ffi::RunId run_id, CallInstance* instance, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> y, GroupAttrs attrs) {
  return RunCpuCollective("jaxk3 gather", GatherCombine, OutputSize::kGathered, ordinal, run_id, instance, x, y,
                          attrs);
}

ffi::Future CpuPadded(int32_t ordinal, ffi::RunId run_id, CallInstance* instance, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> y, GroupAttrs attrs) {
  return RunCpuCollective("jaxk3 gather", PaddedCombine, OutputSize::kGathered, ordinal, run_id, instance, x, y,
                          attrs);
}

}  // namespace

Combine HostGatherCombine(size_t align) { return align > 1 ? PaddedCombine : GatherCombine; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_one_shot_all_gather, CpuOneShot, CpuCollectiveBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_padded_all_gather, CpuPadded, CpuCollectiveBinding());

}  // namespace jaxk3

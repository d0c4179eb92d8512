// RunCpuCollective (cpu_collective.h).
#include "cpu_collective.h"

#include <cstring>

#include "settings.h"

namespace ffi = xla::ffi;

namespace jaxk3 {

ffi::Future RunCpuCollective(const char* op, Combine combine, OutputSize out_size, int32_t ordinal,
                             ffi::RunId run_id, const CallInstance* instance, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                             const GroupAttrs& attrs) {
  GroupRef group;
  if (ffi::Error err = FindGroup(attrs, ordinal, &group); err.failure()) return FailedFuture(std::move(err));
  const size_t bytes = x.size_bytes();
  const size_t copies = out_size == OutputSize::kGathered ? static_cast<size_t>(group.size) : 1;
  if (ffi::Error err = CheckOutputBytes(op, y->size_bytes(), copies * bytes); err.failure()) {
    return FailedFuture(std::move(err));
  }
  if (PoisonOutputs()) std::memset(y->untyped_data(), 0xA5, y->size_bytes());
  RankArgs args;
  args.call = MatchBySite() ? -attrs.site : instance->call;
  args.site = attrs.site;
  args.rank = group.rank;
  args.in = x.untyped_data();
  args.bytes = bytes;
  args.dtype = static_cast<int32_t>(x.element_type());
  args.combine = combine;
  args.run_id = run_id.run_id;
  args.out = y->untyped_data();
  return GetHostComm(group.devices, static_cast<size_t>(group.size))->Run(args);
}

}  // namespace jaxk3

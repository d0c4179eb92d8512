// XLA FFI handlers for platform "cpu": one-shot and padded all-gather through HostComm.
#include <cstring>
#include <string>

#include "group.h"
#include "handlers.h"
#include "host_comm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

ffi::Future Failed(ffi::Error err) {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetError(std::move(err));
  return f;
}

// Registers this device's operand and output with its group's HostComm; the returned future
// completes once every rank has arrived and every output is written.
ffi::Future CpuGather(int32_t ordinal, ffi::RunId run_id, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      int64_t site, int64_t group_size, ffi::Span<const int64_t> table,
                      ffi::Span<const int64_t> groups, size_t align) {
  GroupRef group;
  if (ffi::Error err = FindGroup(table, groups, group_size, ordinal, &group); err.failure()) {
    return Failed(std::move(err));
  }
  const size_t bytes = x.size_bytes();
  if (y->size_bytes() != bytes * static_cast<size_t>(group_size)) {
    return Failed(ffi::Error(ffi::ErrorCode::kInvalidArgument,
                             "jaxk3 gather: output has " + std::to_string(y->size_bytes()) + " bytes, expected " +
                                 std::to_string(group_size) + " x " + std::to_string(bytes)));
  }
  if (PoisonOutputs()) std::memset(y->untyped_data(), 0xA5, y->size_bytes());
  GatherArgs args;
  args.site = site;
  args.rank = group.rank;
  args.in = x.untyped_data();
  args.bytes = bytes;
  args.dtype = static_cast<int32_t>(x.element_type());
  args.align = align;
  args.run_id = run_id.run_id;
  args.out = y->untyped_data();
  return GetHostComm(group.devices, group.size)->Gather(args);
}

ffi::Future CpuOneShot(int32_t ordinal, ffi::RunId run_id, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       int64_t site, int64_t group_size, ffi::Span<const int64_t> table,
                       ffi::Span<const int64_t> groups) {
  return CpuGather(ordinal, run_id, x, y, site, group_size, table, groups, 1);
}

ffi::Future CpuPadded(int32_t ordinal, ffi::RunId run_id, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      int64_t site, int64_t group_size, ffi::Span<const int64_t> table,
                      ffi::Span<const int64_t> groups) {
  return CpuGather(ordinal, run_id, x, y, site, group_size, table, groups, kTransportAlign);
}

}  // namespace

#define JAXK3_CPU_BINDING                       \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::DeviceOrdinal>()                \
      .Ctx<ffi::RunId>()                        \
      .Arg<ffi::AnyBuffer>()                    \
      .Ret<ffi::AnyBuffer>()                    \
      .Attr<int64_t>("site")                    \
      .Attr<int64_t>("group_size")              \
      .Attr<ffi::Span<const int64_t>>("table")  \
      .Attr<ffi::Span<const int64_t>>("groups")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_one_shot_all_gather, CpuOneShot, JAXK3_CPU_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_padded_all_gather, CpuPadded, JAXK3_CPU_BINDING);

}  // namespace jaxk3

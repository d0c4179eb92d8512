// The skeleton every CPU collective handler shares: find this device's group, check the output,
// and join the group's HostComm round with the handler's Combine.
#pragma once

#include <cstddef>

#include "call_instance.h"
#include "common.h"
#include "host_comm.h"
#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

// What a CPU collective handler binds (in this order).  The CallInstance comes from the
// instantiate stage every CPU collective registers (targets.h).
inline auto CpuCollectiveBinding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::DeviceOrdinal>()
      .Ctx<xla::ffi::RunId>()
      .Ctx<xla::ffi::State<CallInstance>>()
      .Arg<xla::ffi::AnyBuffer>()
      .Ret<xla::ffi::AnyBuffer>()
      .Attrs<GroupAttrs>();
}

// How large a collective's output is.
enum class OutputSize {
  kGathered,       // n x the operand (rank-major)
  kSameAsOperand,  // the operand's size
};

// Runs `combine` over this device's group; `op` names the handler in errors.
xla::ffi::Future RunCpuCollective(const char* op, Combine combine, OutputSize out_size, int32_t ordinal,
                                  xla::ffi::RunId run_id, const CallInstance* instance, xla::ffi::AnyBuffer x,
                                  xla::ffi::Result<xla::ffi::AnyBuffer> y, const GroupAttrs& attrs);

}  // namespace jaxk3

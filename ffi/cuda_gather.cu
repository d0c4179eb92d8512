// XLA FFI handlers for platform "CUDA": one-shot and padded all-gather over the GPUs of one
// process, through CudaComm (cuda_comm.h).  Same attributes as the CPU handlers.
//
// Execute does no allocation, host rendezvous or host sync: it finds the group (attribute
// scan), looks up the communicator (created at trace time by cuda_group_ok), reads the
// communicator's mapped error word, and launches one kernel on XLA's stream.  Every per-call
// counter lives in device memory, so the handlers are declared command-buffer compatible: a
// CUDA graph that captured the launch replays it correctly.  (Under replay the handler is not
// called, so a timeout is reported by the next call that is not replayed, or by the next
// capture; the kernels of a broken communicator stop waiting at once.)
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda_comm.h"
#include "group.h"
#include "handlers.h"
#include "host_comm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

ffi::Error Internal(const std::string& msg) { return ffi::Error(ffi::ErrorCode::kInternal, msg); }

ffi::Error CudaGather(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      int64_t site, int64_t group_size, ffi::Span<const int64_t> table,
                      ffi::Span<const int64_t> groups) {
  (void)site;  // one program order on every GPU (SPMD): calls pair up by the per-GPU epoch
  GroupRef group;
  if (ffi::Error err = FindGroup(table, groups, group_size, ordinal, &group); err.failure()) return err;
  const size_t bytes = x.size_bytes();
  if (y->size_bytes() != bytes * static_cast<size_t>(group_size)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxk3 gather: output has " + std::to_string(y->size_bytes()) + " bytes, expected " +
                          std::to_string(group_size) + " x " + std::to_string(bytes));
  }
  if (bytes == 0) return ffi::Error::Success();
  if (group.size == 1) {
    cudaError_t e = cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), bytes, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return Internal(std::string("jaxk3 CUDA gather: copy: ") + cudaGetErrorString(e));
    return ffi::Error::Success();
  }
  // The CUDA ordinal of every rank, from the table rows of this process and group.
  const int64_t g = (group.devices - groups.begin()) / group_size;
  const int64_t me = ProcessIndex();
  std::vector<int> ordinals(static_cast<size_t>(group.size), -1);
  for (size_t i = 0; i + 3 < table.size(); i += 4) {
    if (table[i] == me && table[i + 2] == g && table[i + 3] >= 0 && table[i + 3] < group.size) {
      ordinals[static_cast<size_t>(table[i + 3])] = static_cast<int>(table[i + 1]);
    }
  }
  for (int o : ordinals) {
    if (o < 0) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxk3 CUDA gather: the group spans processes");
  }
  std::vector<int64_t> devices(group.devices, group.devices + group.size);
  std::string why;
  CudaComm* comm = GetCudaComm(devices, ordinals, &why);
  if (comm == nullptr) return Internal(why);
  if (std::string failed = CudaCommFailure(comm); !failed.empty()) return Internal(failed);
  if (std::string err = LaunchCudaGather(comm, group.rank, x.untyped_data(), y->untyped_data(), bytes, stream,
                                         GatherTimeoutMs());
      !err.empty()) {
    return Internal(err);
  }
  return ffi::Error::Success();
}

}  // namespace

#define JAXK3_CUDA_BINDING                       \
  ffi::Ffi::Bind()                               \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  \
      .Ctx<ffi::DeviceOrdinal>()                 \
      .Arg<ffi::AnyBuffer>()                     \
      .Ret<ffi::AnyBuffer>()                     \
      .Attr<int64_t>("site")                     \
      .Attr<int64_t>("group_size")               \
      .Attr<ffi::Span<const int64_t>>("table")   \
      .Attr<ffi::Span<const int64_t>>("groups")

// The padded variant differs only in what the caller may pass: any payload size.  Both move
// each rank's payload through a 16-byte padded receive row and write the rank-major output
// without padding.  Pushes into the 16-byte aligned receive rows are 16-byte stores whenever the
// operand is 16-byte aligned; each copy uses the widest access both addresses allow plus a
// byte tail.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_one_shot_all_gather, CudaGather, JAXK3_CUDA_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_padded_all_gather, CudaGather, JAXK3_CUDA_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

// XLA FFI handlers for platform "CUDA": one-shot and padded all-gather over the GPUs of one
// process, through CudaComm (cuda_comm.h).  Same attributes as the CPU handlers.
//
// Execute does no allocation, host rendezvous or host sync: it finds the group, looks up the
// communicator (created at trace time by cuda_group_ok), reads the communicator's mapped
// failure record, and launches one kernel on XLA's stream.  Every per-call counter lives in
// device memory, so the handlers are declared command-buffer compatible: a CUDA graph that
// captured the launch replays it correctly.  (Under replay the handler is not called, so a
// timeout is reported by the next call that is not replayed, or by the next capture; the
// kernels of a broken communicator stop waiting at once.)
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "common.h"
#include "cuda_comm.h"
#include "settings.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

ffi::Error CudaGather(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      GroupAttrs attrs) {
  // attrs.site is unused: one program order on every GPU (SPMD), calls pair up by the per-GPU epoch.
  GroupRef group;
  if (ffi::Error err = FindGroup(attrs, ordinal, &group); err.failure()) return err;
  const size_t bytes = x.size_bytes();
  const size_t want = bytes * static_cast<size_t>(group.size);
  if (ffi::Error err = CheckOutputBytes("jaxk3 gather", y->size_bytes(), want); err.failure()) return err;
  if (bytes == 0) return ffi::Error::Success();
  if (group.size == 1) {
    cudaError_t e = cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), bytes, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return Internal(std::string("jaxk3 CUDA gather: copy: ") + cudaGetErrorString(e));
    return ffi::Error::Success();
  }
  std::vector<int> ordinals;
  if (ffi::Error err = GroupOrdinals(attrs, group, &ordinals); err.failure()) return err;
  std::vector<int64_t> devices(group.devices, group.devices + group.size);
  std::string why;
  CudaComm* comm = GetCudaComm(devices, ordinals, &why);
  if (comm == nullptr) return Internal(why);
  if (std::string failed = CudaCommFailure(comm); !failed.empty()) return Internal(failed);
  std::string err =
      LaunchCudaGather(comm, group.rank, x.untyped_data(), y->untyped_data(), bytes, stream, TimeoutMs());
  if (!err.empty()) return Internal(err);
  return ffi::Error::Success();
}

auto CudaGatherBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attrs<GroupAttrs>();
}

}  // namespace

// The padded variant differs only in what the caller may pass: any payload size.  Both move
// each rank's payload through a 16-byte padded receive row and write the rank-major output
// without padding.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_one_shot_all_gather, CudaGather, CudaGatherBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cuda_padded_all_gather, CudaGather, CudaGatherBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxk3

// One-shot gather communicator for the GPUs of one process (platform CUDA).
//
// One CudaComm per *ordered* GPU group (key: global device ids in rank order), created once,
// outside the execute path: at trace time by cuda_group_ok() (the Python plan calls it for
// every group it sends to the FFI path), or, failing that, on the first execute (with stream
// capture relaxed so that a command-buffer capture does not fail).
//
// Memory, on every GPU of the group (one cudaMalloc each, owned by the library):
//   ctl    CudaCtl (padded to kCtlBytes): the per-GPU control words below
//   flags  [2][kCudaMaxRanks][kCudaMaxBlocks] u32: flags[slot][sender][block] = epoch of the
//          data that sender's block `block` pushed into slot `slot` here
//   data   [2][n][cap] bytes: receive slots, slot = epoch & 1, row = sender rank, 16-B padded
// plus one mapped host CudaErrorWords shared by the group.
//
// Each call is one kernel per GPU (cuda_kernel.cu): every block pushes its chunk of the local
// operand into its row of every peer's receive slot (NVLink stores), publishes a flag on the
// peer (fence.sys + st.release.sys), copies its own chunk to the output, then spins on the
// flags in *local* memory (ld.acquire.sys) and copies the peers' chunks from the local receive
// slot into the output, dropping the 16-B padding.  The last block to finish bumps the epoch.
// All per-call state is in device memory, so CUDA-graph replay is correct; the kernel
// arguments (pointers, sizes, the timeout) are fixed per call site.
//
// Two slots suffice: a rank can only start call e+2 after receiving every peer's data of
// call e+1, which a peer sends only after its call e finished reading slot e&1 (same stream).
//
// Assumptions: every GPU of a group runs the group's gathers in the same order (one SPMD
// program: XLA schedules the same HLO on every device), on one stream per GPU.  A second
// kernel of the same communicator overlapping on one GPU (two streams; the sglang #31117 trap)
// is detected through CudaCtl::active_blocks and reported as CudaFailure::kOverlap instead of
// corrupting silently.
//
// Bounded waits: a spinning block gives up after the timeout (set_timeout /
// JAXK3_GATHER_TIMEOUT_S, read when the call is launched or captured), measured with
// %globaltimer; it records CudaFailure::kTimeout in the mapped host words and exits (its output
// is garbage).  Every later kernel of that communicator sees the failure and stops waiting, and
// every later execute of the handler returns an ffi::Error naming it (the communicator stays
// broken: the process must restart its gathers; there is no in-place recovery of the epochs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace jaxk3 {

constexpr int kCudaMaxRanks = 8;
constexpr int kCudaMaxBlocks = 64;
constexpr int kCudaThreads = 256;
constexpr size_t kCtlBytes = 256;

// The control words at the start of each GPU's region (device memory).
struct CudaCtl {
  unsigned epoch;            // the next call's generation (starts at 1, never 0)
  unsigned finished_blocks;  // blocks of the running call that have finished
  unsigned active_blocks;    // blocks of this communicator running on this GPU now
};
static_assert(sizeof(CudaCtl) <= kCtlBytes, "CudaCtl must fit its reserved bytes");

// What a kernel records when it fails.
enum class CudaFailure : unsigned {
  kNone = 0,
  kTimeout = 1,  // a block waited past the timeout for a peer
  kOverlap = 2,  // two kernels of one communicator ran at once on one GPU (two streams)
};

// The group's failure record, in mapped host memory: the first failure wins.
struct CudaErrorWords {
  unsigned code;   // a CudaFailure
  unsigned rank;   // the rank that recorded it
  unsigned epoch;  // the call it happened in
};

struct CudaComm {
  int n = 0;
  std::vector<int64_t> devices;   // global ids, rank order (the key)
  std::vector<int> ordinals;      // CUDA ordinals, rank order
  size_t cap = 0;                 // receive slot bytes per rank (multiple of 16)
  std::vector<char*> base;        // per rank: its GPU's allocation
  std::vector<CudaCtl*> ctl;      // per rank
  std::vector<unsigned*> flags;   // per rank
  std::vector<char*> data;        // per rank
  volatile CudaErrorWords* host_err = nullptr;  // the group's failure record
  CudaErrorWords* dev_err = nullptr;            // the same words, as the kernels address them
};

// Checks that `ordinals` (CUDA ordinals, rank order) can form a one-shot group (at most
// kCudaMaxRanks, distinct, every pair peer-capable) and creates its communicator once.
// Returns "" on success, else the reason.
std::string CudaGroupSetup(const std::vector<int64_t>& devices, const std::vector<int>& ordinals);

// The communicator of `devices`, created on first use (ordinals checked against an existing
// one).  Returns nullptr and sets *why on failure.
CudaComm* GetCudaComm(const std::vector<int64_t>& devices, const std::vector<int>& ordinals,
                      std::string* why);

// Number of visible CUDA devices (0 when the runtime has none).
int CudaDeviceCount();

// Launches one gather of `bytes` per rank on `stream` (a cudaStream_t).  Returns "" or the
// CUDA error (cuda_kernel.cu).
std::string LaunchCudaGather(CudaComm* comm, int rank, const void* in, void* out, size_t bytes,
                             void* stream, int64_t timeout_ms);

// Loads the gather kernel on the current GPU (so that no launch loads it lazily while a peer's
// kernel already spins); returns "" or the CUDA error (cuda_kernel.cu).
std::string LoadCudaGatherKernel();

// Non-empty when a kernel of `comm` failed earlier (the communicator is broken).
std::string CudaCommFailure(const CudaComm* comm);

// Makes a communicator; `shared_gpu` lets several ranks live on one GPU (no peer checks, no
// peer access: the test hook below).  Callers other than the registry own what they make.
std::string CreateCudaComm(const std::vector<int64_t>& devices, const std::vector<int>& ordinals, bool shared_gpu,
                           std::unique_ptr<CudaComm>* out);

// Test hook (cuda_test_hooks.cu): a gather on rank 0 of a private communicator whose peers
// never come; returns the failure it reported and the kernel's time in *waited_ms.
std::string CudaLonelyGatherForTest(const std::vector<int>& ordinals, int64_t timeout_ms, bool two_streams,
                                    double* waited_ms);

// Test hook (cuda_test_hooks.cu): `n` ranks of one communicator all on GPU `ordinal`, each
// rank's kernel on its own stream, `calls` gathers of `bytes` per rank in a row; checks every
// output byte on the host.  Returns "" or what was wrong.  Exercises the protocol (flags,
// slots, epochs, padding) on a machine with one GPU.
std::string CudaSharedGpuGatherForTest(int ordinal, int n, size_t bytes, int calls);

}  // namespace jaxk3

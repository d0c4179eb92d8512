// One-shot gather communicator and kernel for the GPUs of one process: see cuda_comm.h.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_comm.h"

namespace jaxk3 {
namespace {

constexpr size_t kCtlBytes = 256;
constexpr size_t kFlagWords = 2 * kCudaMaxRanks * kCudaMaxBlocks;
constexpr size_t kFlagBytes = kFlagWords * sizeof(unsigned);

struct GatherParams {
  char* data[kCudaMaxRanks];       // every rank's receive region (peer pointers)
  unsigned* flags[kCudaMaxRanks];  // every rank's flag region (peer pointers)
  unsigned* ctl;                   // this rank's epoch / finished-block counter
  unsigned* err;                   // mapped host words
  const char* in;
  char* out;
  unsigned long long bytes;        // payload per rank
  unsigned long long cap;          // receive row stride
  unsigned long long timeout_ns;
  int n;
  int rank;
};

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void StoreReleaseSys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned LoadAcquireSys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename T>
__device__ __forceinline__ void CopyT(char* dst, const char* src, size_t count) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) d[i] = s[i];
}

// Copies `nbytes` with the widest access (16/8/4/2 bytes) that both addresses allow, then the
// tail byte by byte.  The receive rows are 16-byte aligned, so the pushes over NVLink are
// 16-byte stores whatever the payload size; only an output row that starts off 16 bytes
// (rank r * bytes not a multiple of 16) gets narrower local stores.
__device__ __forceinline__ void Copy(char* dst, const char* src, size_t nbytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  size_t done;
  if (a % 16 == 0) {
    CopyT<uint4>(dst, src, nbytes / 16);
    done = nbytes / 16 * 16;
  } else if (a % 8 == 0) {
    CopyT<uint2>(dst, src, nbytes / 8);
    done = nbytes / 8 * 8;
  } else if (a % 4 == 0) {
    CopyT<unsigned>(dst, src, nbytes / 4);
    done = nbytes / 4 * 4;
  } else if (a % 2 == 0) {
    CopyT<unsigned short>(dst, src, nbytes / 2);
    done = nbytes / 2 * 2;
  } else {
    done = 0;
  }
  for (size_t i = done + threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];
}

// Records the first failure of the group in the mapped host words ([0] code, [1] rank,
// [2] epoch); later failures keep the first one.
__device__ void RaiseError(volatile unsigned* err, unsigned code, int rank, unsigned epoch) {
  if (err[0] != 0) return;
  err[1] = static_cast<unsigned>(rank);
  err[2] = epoch;
  __threadfence_system();
  err[0] = code;
  __threadfence_system();
}

__global__ void __launch_bounds__(kCudaThreads) OneShotGatherKernel(GatherParams p) {
  __shared__ unsigned s_epoch;
  const int tid = threadIdx.x;
  const int b = blockIdx.x;
  const int nb = gridDim.x;
  unsigned active_before = 0;
  if (tid == 0) {
    s_epoch = *reinterpret_cast<volatile unsigned*>(p.ctl);
    // Blocks of this communicator running on this GPU now; more than this grid has means a
    // second kernel of the same communicator overlaps (two streams): checked after the pushes.
    active_before = atomicAdd(p.ctl + 2, 1u);
  }
  __syncthreads();
  const unsigned e = s_epoch;
  const unsigned slot = e & 1u;

  // This block's byte range of every rank's payload: 16-byte units split evenly.
  const unsigned long long nvec = (p.bytes + 15) / 16;
  const unsigned long long lo = nvec * b / nb * 16;
  unsigned long long hi = nvec * (b + 1) / nb * 16;
  if (hi > p.bytes) hi = p.bytes;
  const size_t len = hi > lo ? hi - lo : 0;

  // 1. Push this chunk into my row of every peer's receive slot (peer order rotated).
  for (int k = 1; k < p.n; ++k) {
    const int peer = (p.rank + k) % p.n;
    char* dst = p.data[peer] + (static_cast<size_t>(slot) * p.n + p.rank) * p.cap + lo;
    Copy(dst, p.in + lo, len);
  }
  if (tid == 0 && active_before >= static_cast<unsigned>(nb)) {
    RaiseError(p.err, 2, p.rank, e);
  }
  __syncthreads();
  // 2. Publish: one thread per peer orders the block's stores (bar.sync + fence.sys) before
  //    its flag store on that peer.
  if (tid < p.n && tid != p.rank) {
    __threadfence_system();
    StoreReleaseSys(p.flags[tid] + (slot * kCudaMaxRanks + p.rank) * kCudaMaxBlocks + b, e);
  }
  // 3. My own chunk straight to the output while the pushes travel.
  Copy(p.out + static_cast<size_t>(p.rank) * p.bytes + lo, p.in + lo, len);
  // 4. Wait for every peer's flag for this block, in local memory, bounded in time.
  if (tid < p.n && tid != p.rank) {
    const unsigned* f = p.flags[p.rank] + (slot * kCudaMaxRanks + tid) * kCudaMaxBlocks + b;
    unsigned long long start = 0;
    unsigned iter = 0;
    while (LoadAcquireSys(f) != e) {
      if ((++iter & 1023u) == 0) {
        const unsigned long long now = GlobalTimer();
        if (start == 0) start = now;
        volatile unsigned* err = p.err;
        if (err[0] != 0 || now - start > p.timeout_ns) {
          RaiseError(p.err, 1, p.rank, e);
          break;
        }
      }
    }
  }
  __syncthreads();
  // 5. Peers' chunks from the local receive slot into the output, padding dropped.
  for (int k = 1; k < p.n; ++k) {
    const int s = (p.rank + k) % p.n;
    const char* src = p.data[p.rank] + (static_cast<size_t>(slot) * p.n + s) * p.cap + lo;
    Copy(p.out + static_cast<size_t>(s) * p.bytes + lo, src, len);
  }
  // 6. The last block to finish advances the epoch for the next call on this GPU.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.ctl + 1, 1u) == static_cast<unsigned>(nb - 1)) {
      p.ctl[1] = 0;
      const unsigned next = e + 1 == 0 ? 2u : e + 1;
      *reinterpret_cast<volatile unsigned*>(p.ctl) = next;
      __threadfence();
    }
    atomicSub(p.ctl + 2, 1u);
  }
}

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string("jaxk3 CUDA gather: ") + what + ": " + cudaGetErrorString(e);
}

size_t CapacityBytes() {
  size_t cap = size_t{1} << 20;
  if (const char* env = std::getenv("JAXK3_GATHER_MAX_BYTES")) {
    char* end = nullptr;
    long long v = std::strtoll(env, &end, 10);
    if (end != env && v > 0 && static_cast<size_t>(v) > cap) cap = static_cast<size_t>(v);
  }
  return (cap + 15) / 16 * 16;
}

// Restores the thread's device and stream-capture mode on scope exit.
class ScopedSetup {
 public:
  ScopedSetup() {
    if (cudaGetDevice(&device_) != cudaSuccess) device_ = -1;
    cudaGetLastError();
    mode_ = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  ~ScopedSetup() {
    cudaThreadExchangeStreamCaptureMode(&mode_);
    if (device_ >= 0) cudaSetDevice(device_);
  }

 private:
  int device_ = -1;
  cudaStreamCaptureMode mode_;
};

std::mutex g_mu;
std::map<std::vector<int64_t>, std::unique_ptr<CudaComm>>& Registry() {
  static auto* r = new std::map<std::vector<int64_t>, std::unique_ptr<CudaComm>>();
  return *r;
}

std::string CheckGroup(const std::vector<int64_t>& devices, const std::vector<int>& ordinals) {
  const int n = static_cast<int>(ordinals.size());
  if (n < 1 || devices.size() != ordinals.size()) return "empty or malformed GPU group";
  if (n > kCudaMaxRanks) {
    return "group of " + std::to_string(n) + " GPUs > " + std::to_string(kCudaMaxRanks) +
           " (the CUDA one-shot gather's limit)";
  }
  const int count = CudaDeviceCount();
  for (int i = 0; i < n; ++i) {
    if (ordinals[i] < 0 || ordinals[i] >= count) {
      return "device " + std::to_string(devices[i]) + " is not a local CUDA device (ordinal " +
             std::to_string(ordinals[i]) + ", " + std::to_string(count) + " visible)";
    }
    for (int j = 0; j < i; ++j) {
      if (ordinals[i] == ordinals[j]) return "a GPU appears twice in the group";
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int ok = 0;
      cudaError_t e = cudaDeviceCanAccessPeer(&ok, ordinals[i], ordinals[j]);
      if (e != cudaSuccess) return CudaErr("cudaDeviceCanAccessPeer", e);
      if (!ok) {
        return "GPU " + std::to_string(ordinals[i]) + " cannot access GPU " + std::to_string(ordinals[j]) +
               " as a peer (no P2P)";
      }
    }
  }
  return "";
}

// Requires g_mu.  Allocates and initialises every GPU's region, enables peer access for every
// pair and loads the kernel on every GPU (lazy loading would otherwise load it at the first
// launch, possibly while a peer's kernel already spins).
std::string Create(const std::vector<int64_t>& devices, const std::vector<int>& ordinals,
                   std::unique_ptr<CudaComm>* out) {
  if (std::string why = CheckGroup(devices, ordinals); !why.empty()) return why;
  ScopedSetup scope;
  auto c = std::make_unique<CudaComm>();
  c->n = static_cast<int>(ordinals.size());
  c->devices = devices;
  c->ordinals = ordinals;
  c->cap = CapacityBytes();
  const size_t total = kCtlBytes + kFlagBytes + 2 * static_cast<size_t>(c->n) * c->cap;
  cudaError_t e;
  auto fail = [&](const char* what, cudaError_t err) {
    std::string msg = CudaErr(what, err);
    for (size_t i = 0; i < c->base.size(); ++i) {
      cudaSetDevice(c->ordinals[i]);
      cudaFree(c->base[i]);
    }
    if (c->host_err) cudaFreeHost(const_cast<unsigned*>(c->host_err));
    cudaGetLastError();
    return msg;
  };
  for (int r = 0; r < c->n; ++r) {
    if ((e = cudaSetDevice(ordinals[r])) != cudaSuccess) return fail("cudaSetDevice", e);
    char* base = nullptr;
    if ((e = cudaMalloc(&base, total)) != cudaSuccess) return fail("cudaMalloc of the receive buffers", e);
    c->base.push_back(base);
    c->ctl.push_back(reinterpret_cast<unsigned*>(base));
    c->flags.push_back(reinterpret_cast<unsigned*>(base + kCtlBytes));
    c->data.push_back(base + kCtlBytes + kFlagBytes);
    // Zero the control words and flags, epoch 1; the receive slots need no initial value.
    // On a private non-blocking stream: a legacy-stream copy would wait for XLA's streams,
    // whose gather kernels may be spinning for a peer whose host thread waits for us.
    std::vector<unsigned> init((kCtlBytes + kFlagBytes) / sizeof(unsigned), 0u);
    init[0] = 1;
    cudaStream_t s = nullptr;
    if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess) return fail("cudaStreamCreate", e);
    e = cudaMemcpyAsync(base, init.data(), kCtlBytes + kFlagBytes, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    if (e != cudaSuccess) return fail("copying the control words", e);
    cudaFuncAttributes attr;
    if ((e = cudaFuncGetAttributes(&attr, OneShotGatherKernel)) != cudaSuccess) {
      return fail("loading the gather kernel", e);
    }
  }
  for (int r = 0; r < c->n; ++r) {
    if ((e = cudaSetDevice(ordinals[r])) != cudaSuccess) return fail("cudaSetDevice", e);
    for (int s = 0; s < c->n; ++s) {
      if (s == r) continue;
      e = cudaDeviceEnablePeerAccess(ordinals[s], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else if (e != cudaSuccess) {
        return fail("cudaDeviceEnablePeerAccess", e);
      }
    }
  }
  unsigned* h = nullptr;
  if ((e = cudaHostAlloc(&h, 64, cudaHostAllocMapped | cudaHostAllocPortable)) != cudaSuccess) {
    return fail("cudaHostAlloc of the error word", e);
  }
  std::memset(h, 0, 64);
  c->host_err = h;
  if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->dev_err), h, 0)) != cudaSuccess) {
    return fail("cudaHostGetDevicePointer", e);
  }
  *out = std::move(c);
  return "";
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

CudaComm* GetCudaComm(const std::vector<int64_t>& devices, const std::vector<int>& ordinals,
                      std::string* why) {
  auto find = [&]() -> CudaComm* {
    auto& reg = Registry();
    auto it = reg.find(devices);
    if (it == reg.end()) return nullptr;
    if (it->second->ordinals != ordinals) {
      *why = "jaxk3 CUDA gather: the group's CUDA ordinals differ from those its communicator was made with";
      return nullptr;
    }
    return it->second.get();
  };
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (CudaComm* c = find()) return c;
    if (!why->empty()) return nullptr;
  }
  // Created without the registry lock, so that other GPUs' host threads can keep launching
  // (and completing) the gathers of existing communicators meanwhile.  Only one creator at a
  // time; a communicator made twice by a race would be kept once (the other is leaked rather
  // than freed, since cudaFree synchronises the device).
  static std::mutex create_mu;
  std::lock_guard<std::mutex> create_lock(create_mu);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (CudaComm* c = find()) return c;
    if (!why->empty()) return nullptr;
  }
  std::unique_ptr<CudaComm> c;
  if (std::string err = Create(devices, ordinals, &c); !err.empty()) {
    *why = err;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  CudaComm* raw = c.get();
  Registry().emplace(devices, std::move(c));
  return raw;
}

std::string CudaGroupSetup(const std::vector<int64_t>& devices, const std::vector<int>& ordinals) {
  std::string why;
  if (ordinals.size() == 1) return CheckGroup(devices, ordinals);  // identity: no communicator
  GetCudaComm(devices, ordinals, &why);
  return why;
}

std::string CudaCommFailure(const CudaComm* comm) {
  if (comm->host_err[0] == 0) return "";
  if (comm->host_err[0] == 2) {
    return "jaxk3 CUDA gather: two kernels of one communicator ran at once on the GPU of rank " +
           std::to_string(comm->host_err[1]) + " (call " + std::to_string(comm->host_err[2]) +
           "): the communicator was used on two streams; outputs may be wrong and the communicator is broken";
  }
  return "jaxk3 CUDA gather: rank " + std::to_string(comm->host_err[1]) + " waited past the timeout for a peer in call " +
         std::to_string(comm->host_err[2]) + " of the group; that call's output is garbage and the communicator is broken";
}

std::string LaunchCudaGather(CudaComm* comm, int rank, const void* in, void* out, size_t bytes, void* stream,
                             int64_t timeout_ms) {
  if (bytes > comm->cap) {
    return "jaxk3 CUDA gather: " + std::to_string(bytes) + " bytes per rank > the communicator's capacity " +
           std::to_string(comm->cap) + " (raise JAXK3_GATHER_MAX_BYTES before the first gather)";
  }
  GatherParams p;
  std::memset(&p, 0, sizeof(p));
  for (int r = 0; r < comm->n; ++r) {
    p.data[r] = comm->data[r];
    p.flags[r] = comm->flags[r];
  }
  p.ctl = comm->ctl[rank];
  p.err = comm->dev_err;
  p.in = static_cast<const char*>(in);
  p.out = static_cast<char*>(out);
  p.bytes = bytes;
  p.cap = comm->cap;
  p.timeout_ns = static_cast<unsigned long long>(timeout_ms > 0 ? timeout_ms : 1) * 1000000ull;
  p.n = comm->n;
  p.rank = rank;
  // ~4 KB per block: 256 KB per rank runs on 64 blocks, a few KB on one.
  const size_t slot_bytes = (bytes + 15) / 16 * 16;
  int blocks = static_cast<int>((slot_bytes + 4095) / 4096);
  if (blocks < 1) blocks = 1;
  if (blocks > kCudaMaxBlocks) blocks = kCudaMaxBlocks;
  int device = -1;
  cudaGetDevice(&device);
  if (device != comm->ordinals[rank]) {
    if (cudaError_t e = cudaSetDevice(comm->ordinals[rank]); e != cudaSuccess) return CudaErr("cudaSetDevice", e);
  }
  OneShotGatherKernel<<<blocks, kCudaThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return CudaErr("kernel launch", e);
  return "";
}

}  // namespace jaxk3

namespace jaxk3 {

// Test hook: launches a gather on rank 0 of a private communicator of `ordinals` (keyed by
// negative device ids, so no program's communicator is touched) while no other rank ever
// arrives, waits for it on its own stream, and returns the failure it reported ("" if none)
// and the wall time in *waited_ms; with two_streams, a second kernel of the same communicator
// on another stream overlaps the first (to check that the overlap is reported).  Synchronises: never call it with gathers in flight.
std::string CudaLonelyGatherForTest(const std::vector<int>& ordinals, int64_t timeout_ms, bool two_streams,
                                    double* waited_ms) {
  std::vector<int64_t> key;
  for (size_t i = 0; i < ordinals.size(); ++i) key.push_back((two_streams ? -2000 : -1000) - static_cast<int64_t>(i));
  std::string why;
  CudaComm* c = GetCudaComm(key, ordinals, &why);
  if (c == nullptr) return "setup failed: " + why;
  ScopedSetup scope;
  cudaSetDevice(ordinals[0]);
  char* buf = nullptr;
  cudaStream_t s = nullptr, s2 = nullptr;
  if (cudaMalloc(&buf, 2 * 64 * (1 + ordinals.size())) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return "setup failed: allocation";
  }
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0, s);
  std::string err = LaunchCudaGather(c, 0, buf, buf + 64, 64, s, timeout_ms);
  if (err.empty() && two_streams) {
    const size_t half = 64 * (1 + ordinals.size());
    err = LaunchCudaGather(c, 0, buf + half, buf + half + 64, 64, s2, timeout_ms);
  }
  cudaEventRecord(t1, s);
  cudaStreamSynchronize(s);
  cudaStreamSynchronize(s2);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  *waited_ms = ms;
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaStreamDestroy(s);
  cudaStreamDestroy(s2);
  cudaFree(buf);
  if (!err.empty()) return "launch failed: " + err;
  return CudaCommFailure(c);
}

}  // namespace jaxk3

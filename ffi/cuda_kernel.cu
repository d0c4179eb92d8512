// The one-shot gather kernel and its launch (the protocol is described in cuda_comm.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "cuda_comm.h"
#include "cuda_util.h"

namespace jaxk3 {
namespace {

struct GatherParams {
  char* data[kCudaMaxRanks];       // every rank's receive region (peer pointers)
  unsigned* flags[kCudaMaxRanks];  // every rank's flag region (peer pointers)
  CudaCtl* ctl;                    // this rank's control words
  CudaErrorWords* err;             // the group's failure record (mapped host memory)
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

// Records the first failure of the group; later failures keep the first one.
__device__ void RaiseError(CudaErrorWords* err, CudaFailure failure, int rank, unsigned epoch) {
  volatile CudaErrorWords* e = err;
  if (e->code != static_cast<unsigned>(CudaFailure::kNone)) return;
  e->rank = static_cast<unsigned>(rank);
  e->epoch = epoch;
  __threadfence_system();
  e->code = static_cast<unsigned>(failure);
  __threadfence_system();
}

__device__ __forceinline__ bool Failed(const CudaErrorWords* err) {
  return reinterpret_cast<const volatile CudaErrorWords*>(err)->code != static_cast<unsigned>(CudaFailure::kNone);
}

// The flag that `sender`'s block `block` sets in `owner_flags` for a call in receive slot `slot`.
__device__ __forceinline__ unsigned* Flag(unsigned* owner_flags, unsigned slot, int sender, int block) {
  return owner_flags + (slot * kCudaMaxRanks + sender) * kCudaMaxBlocks + block;
}

// Rank `sender`'s receive row in `owner_data` for a call in receive slot `slot`.
__device__ __forceinline__ char* Row(const GatherParams& p, char* owner_data, unsigned slot, int sender) {
  return owner_data + (static_cast<size_t>(slot) * p.n + sender) * p.cap;
}

__global__ void __launch_bounds__(kCudaThreads) OneShotGatherKernel(GatherParams p) {
  __shared__ unsigned s_epoch;
  const int tid = threadIdx.x;
  const int b = blockIdx.x;
  const int nb = gridDim.x;
  unsigned active_before = 0;
  if (tid == 0) {
    s_epoch = reinterpret_cast<volatile CudaCtl*>(p.ctl)->epoch;
    // More blocks of this communicator running on this GPU than this grid has means a second
    // kernel of the same communicator overlaps (two streams): checked after the pushes.
    active_before = atomicAdd(&p.ctl->active_blocks, 1u);
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
    Copy(Row(p, p.data[peer], slot, p.rank) + lo, p.in + lo, len);
  }
  if (tid == 0 && active_before >= static_cast<unsigned>(nb)) {
    RaiseError(p.err, CudaFailure::kOverlap, p.rank, e);
  }
  __syncthreads();
  // 2. Publish: one thread per peer orders the block's stores (bar.sync + fence.sys) before
  //    its flag store on that peer.
  if (tid < p.n && tid != p.rank) {
    __threadfence_system();
    StoreReleaseSys(Flag(p.flags[tid], slot, p.rank, b), e);
  }
  // 3. My own chunk straight to the output while the pushes travel.
  Copy(p.out + static_cast<size_t>(p.rank) * p.bytes + lo, p.in + lo, len);
  // 4. Wait for every peer's flag for this block, in local memory, bounded in time.
  if (tid < p.n && tid != p.rank) {
    const unsigned* f = Flag(p.flags[p.rank], slot, tid, b);
    unsigned long long start = 0;
    unsigned iter = 0;
    while (LoadAcquireSys(f) != e) {
      if ((++iter & 1023u) == 0) {
        const unsigned long long now = GlobalTimer();
        if (start == 0) start = now;
        if (Failed(p.err) || now - start > p.timeout_ns) {
          RaiseError(p.err, CudaFailure::kTimeout, p.rank, e);
          break;
        }
      }
    }
  }
  __syncthreads();
  // 5. Peers' chunks from the local receive slot into the output, padding dropped.
  for (int k = 1; k < p.n; ++k) {
    const int s = (p.rank + k) % p.n;
    Copy(p.out + static_cast<size_t>(s) * p.bytes + lo, Row(p, p.data[p.rank], slot, s) + lo, len);
  }
  // 6. The last block to finish advances the epoch for the next call on this GPU.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(&p.ctl->finished_blocks, 1u) == static_cast<unsigned>(nb - 1)) {
      p.ctl->finished_blocks = 0;
      const unsigned next = e + 1 == 0 ? 2u : e + 1;
      reinterpret_cast<volatile CudaCtl*>(p.ctl)->epoch = next;
      __threadfence();
    }
    atomicSub(&p.ctl->active_blocks, 1u);
  }
}

}  // namespace

std::string LoadCudaGatherKernel() {
  cudaFuncAttributes attr;
  if (cudaError_t e = cudaFuncGetAttributes(&attr, OneShotGatherKernel); e != cudaSuccess) {
    return CudaErr("loading the gather kernel", e);
  }
  return "";
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

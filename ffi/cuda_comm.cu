// CudaComm setup and registry (the protocol is described in cuda_comm.h).
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_comm.h"
#include "cuda_util.h"
#include "settings.h"

namespace jaxk3 {
namespace {

constexpr size_t kFlagWords = 2 * kCudaMaxRanks * kCudaMaxBlocks;
constexpr size_t kFlagBytes = kFlagWords * sizeof(unsigned);

std::mutex g_mu;
std::map<std::vector<int64_t>, std::unique_ptr<CudaComm>>& Registry() {
  static auto* r = new std::map<std::vector<int64_t>, std::unique_ptr<CudaComm>>();
  return *r;
}

std::string CheckPeers(const std::vector<int>& ordinals) {
  const int n = static_cast<int>(ordinals.size());
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
  return CheckPeers(ordinals);
}

// Frees what a failed Create allocated and returns its message.
std::string Abandon(CudaComm* c, const std::string& msg) {
  for (size_t i = 0; i < c->base.size(); ++i) {
    cudaSetDevice(c->ordinals[i]);
    cudaFree(c->base[i]);
  }
  if (c->host_err) cudaFreeHost(const_cast<CudaErrorWords*>(c->host_err));
  cudaGetLastError();
  return msg;
}

// Allocates and initialises rank r's region on its GPU: control words zero but epoch 1, flags
// zero; the receive slots need no initial value.
std::string CreateRegion(CudaComm* c, int r, size_t total) {
  cudaError_t e;
  if ((e = cudaSetDevice(c->ordinals[r])) != cudaSuccess) return CudaErr("cudaSetDevice", e);
  char* base = nullptr;
  if ((e = cudaMalloc(&base, total)) != cudaSuccess) return CudaErr("cudaMalloc of the receive buffers", e);
  c->base.push_back(base);
  c->ctl.push_back(reinterpret_cast<CudaCtl*>(base));
  c->flags.push_back(reinterpret_cast<unsigned*>(base + kCtlBytes));
  c->data.push_back(base + kCtlBytes + kFlagBytes);
  // On a private non-blocking stream: a legacy-stream copy would wait for XLA's streams, whose
  // gather kernels may be spinning for a peer whose host thread waits for us.
  std::vector<char> init(kCtlBytes + kFlagBytes, 0);
  CudaCtl ctl{};
  ctl.epoch = 1;
  std::memcpy(init.data(), &ctl, sizeof(ctl));
  cudaStream_t s = nullptr;
  if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess) return CudaErr("cudaStreamCreate", e);
  e = cudaMemcpyAsync(base, init.data(), init.size(), cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  if (e != cudaSuccess) return CudaErr("copying the control words", e);
  return LoadCudaGatherKernel();
}

std::string EnablePeers(const CudaComm& c) {
  for (int r = 0; r < c.n; ++r) {
    if (cudaError_t e = cudaSetDevice(c.ordinals[r]); e != cudaSuccess) return CudaErr("cudaSetDevice", e);
    for (int s = 0; s < c.n; ++s) {
      if (s == r) continue;
      cudaError_t e = cudaDeviceEnablePeerAccess(c.ordinals[s], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else if (e != cudaSuccess) {
        return CudaErr("cudaDeviceEnablePeerAccess", e);
      }
    }
  }
  return "";
}

std::string CreateErrorWords(CudaComm* c) {
  CudaErrorWords* h = nullptr;
  cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&h), sizeof(CudaErrorWords),
                                cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) return CudaErr("cudaHostAlloc of the error words", e);
  std::memset(h, 0, sizeof(CudaErrorWords));
  c->host_err = h;
  if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->dev_err), h, 0)) != cudaSuccess) {
    return CudaErr("cudaHostGetDevicePointer", e);
  }
  return "";
}

}  // namespace

// Allocates every GPU's region, enables peer access for every pair and loads the kernel on
// every GPU (lazy loading would otherwise load it at the first launch, possibly while a peer's
// kernel already spins).
std::string CreateCudaComm(const std::vector<int64_t>& devices, const std::vector<int>& ordinals, bool shared_gpu,
                           std::unique_ptr<CudaComm>* out) {
  if (!shared_gpu) {
    if (std::string why = CheckGroup(devices, ordinals); !why.empty()) return why;
  }
  ScopedSetup scope;
  auto c = std::make_unique<CudaComm>();
  c->n = static_cast<int>(ordinals.size());
  c->devices = devices;
  c->ordinals = ordinals;
  c->cap = CudaCapacityBytes();
  const size_t total = kCtlBytes + kFlagBytes + 2 * static_cast<size_t>(c->n) * c->cap;
  for (int r = 0; r < c->n; ++r) {
    if (std::string err = CreateRegion(c.get(), r, total); !err.empty()) return Abandon(c.get(), err);
  }
  if (!shared_gpu) {
    if (std::string err = EnablePeers(*c); !err.empty()) return Abandon(c.get(), err);
  }
  if (std::string err = CreateErrorWords(c.get()); !err.empty()) return Abandon(c.get(), err);
  *out = std::move(c);
  return "";
}

namespace {

// Requires g_mu.  The registered communicator of `devices`, or null (with *why set when one
// exists but was made for other ordinals).
CudaComm* Find(const std::vector<int64_t>& devices, const std::vector<int>& ordinals, std::string* why) {
  auto& reg = Registry();
  auto it = reg.find(devices);
  if (it == reg.end()) return nullptr;
  if (it->second->ordinals != ordinals) {
    *why = "jaxk3 CUDA gather: the group's CUDA ordinals differ from those its communicator was made with";
    return nullptr;
  }
  return it->second.get();
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
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (CudaComm* c = Find(devices, ordinals, why)) return c;
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
    if (CudaComm* c = Find(devices, ordinals, why)) return c;
    if (!why->empty()) return nullptr;
  }
  std::unique_ptr<CudaComm> c;
  if (std::string err = CreateCudaComm(devices, ordinals, /*shared_gpu=*/false, &c); !err.empty()) {
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
  const auto code = static_cast<CudaFailure>(comm->host_err->code);
  const std::string rank = std::to_string(comm->host_err->rank);
  const std::string epoch = std::to_string(comm->host_err->epoch);
  switch (code) {
    case CudaFailure::kNone:
      return "";
    case CudaFailure::kOverlap:
      return "jaxk3 CUDA gather: two kernels of one communicator ran at once on the GPU of rank " + rank +
             " (call " + epoch +
             "): the communicator was used on two streams; outputs may be wrong and the communicator is broken";
    case CudaFailure::kTimeout:
      return "jaxk3 CUDA gather: rank " + rank + " waited past the timeout for a peer in call " + epoch +
             " of the group; that call's output is garbage and the communicator is broken";
  }
  return "jaxk3 CUDA gather: unknown failure code " + std::to_string(static_cast<unsigned>(code));
}

}  // namespace jaxk3

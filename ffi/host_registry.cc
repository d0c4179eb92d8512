// The process-wide registry of HostComms and the watchdog that expires their rounds.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "host_comm.h"
#include "settings.h"

namespace jaxk3 {
namespace {

std::mutex g_registry_mu;

std::map<std::vector<int64_t>, std::unique_ptr<HostComm>>& Registry() {
  static auto* r = new std::map<std::vector<int64_t>, std::unique_ptr<HostComm>>();
  return *r;
}

// Communicators dropped by reset() stay allocated: a thread may still be leaving one.
std::vector<std::unique_ptr<HostComm>>& Graveyard() {
  static auto* g = new std::vector<std::unique_ptr<HostComm>>();
  return *g;
}

std::atomic<uint64_t> g_epoch{1};

std::vector<HostComm*> LiveComms() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  std::vector<HostComm*> out;
  for (auto& [k, c] : Registry()) out.push_back(c.get());
  return out;
}

void Watch() {
  while (true) {
    const int64_t ms = TimeoutMs();
    std::this_thread::sleep_for(std::chrono::milliseconds(std::clamp<int64_t>(ms / 10, 5, 200)));
    for (HostComm* c : LiveComms()) c->ExpireOlderThan(std::chrono::milliseconds(ms));
  }
}

}  // namespace

void StartWatchdog() {
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      std::thread(Watch).detach();
    } catch (const std::system_error&) {
      // No watchdog: waits are then unbounded, but nothing else changes.
    }
  });
}

HostComm* GetHostComm(const int64_t* devices, size_t n) {
  // Most calls hit this thread's cache: the same few groups over and over.
  struct Cached {
    std::vector<int64_t> key;
    uint64_t epoch = 0;
    HostComm* comm = nullptr;
  };
  thread_local Cached cache[4];
  thread_local unsigned next = 0;
  const uint64_t epoch = g_epoch.load(std::memory_order_acquire);
  for (auto& c : cache) {
    if (c.epoch == epoch && c.key.size() == n && std::memcmp(c.key.data(), devices, n * sizeof(int64_t)) == 0) {
      return c.comm;
    }
  }
  std::vector<int64_t> key(devices, devices + n);
  HostComm* p;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto& reg = Registry();
    auto it = reg.find(key);
    if (it == reg.end()) it = reg.emplace(key, std::make_unique<HostComm>(key)).first;
    p = it->second.get();
  }
  cache[next++ % 4] = Cached{std::move(key), epoch, p};
  return p;
}

void ResetHostComms() {
  std::vector<HostComm*> dropped;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_epoch.fetch_add(1, std::memory_order_acq_rel);
    for (auto& [k, c] : Registry()) {
      dropped.push_back(c.get());
      Graveyard().push_back(std::move(c));
    }
    Registry().clear();
  }
  for (HostComm* c : dropped) c->FailAll("jaxk3.collectives.reset() dropped this communicator while a collective was pending");
}

size_t NumHostComms() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  return Registry().size();
}

}  // namespace jaxk3

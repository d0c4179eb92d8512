#include "host_comm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <condition_variable>
#include <deque>
#include <optional>
#include <sstream>
#include <thread>

#include <sched.h>

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int64_t> g_timeout_ms{[] {
  const char* env = std::getenv("JAXK3_GATHER_TIMEOUT_S");
  double s = env ? std::atof(env) : 60.0;
  if (!(s > 0)) s = 60.0;
  return static_cast<int64_t>(s * 1000.0);
}()};
std::atomic<bool> g_poison{false};

// Completing a promise runs that device's continuation inline: the rest of its program, up
// to its next pending gather, on the completing thread.  That continuation may block in one of
// XLA's own collectives (a psum waits for all devices), so the completions of *other* devices
// must not wait behind it on one thread.  Each completion therefore runs on a worker thread of
// its own: the pool grows whenever more completions are queued than workers are idle, so a
// worker blocked in a collective never holds up another device.  The last arriver completes
// its own promise before returning (XLA then simply continues on its thread).
struct Settlement {
  ffi::Promise promise;
  std::optional<ffi::Error> error;
  void Run() {
    if (error) promise.SetError(*error);
    else promise.SetAvailable();
  }
};

class Completer {
 public:
  void Submit(Settlement s) {
    std::unique_lock<std::mutex> lock(mu_);
    queue_.push_back(std::move(s));
    if (static_cast<int>(queue_.size()) > idle_ && threads_ < kMaxThreads) {
      ++threads_;
      std::thread([this] { Work(); }).detach();
    } else {
      cv_.notify_one();
    }
  }

 private:
  static constexpr int kMaxThreads = 4096;
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [this] { return !queue_.empty(); });
      --idle_;
      Settlement s = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      s.Run();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Settlement> queue_;
  int idle_ = 0;
  int threads_ = 0;
};

Completer& Completions() {
  static auto* c = new Completer();
  return *c;
}

void StartWatchdog();

// How long a rank polls (yielding the core) for its round to complete before it returns a
// pending future instead.  Polling keeps the common case on the device's own thread (no
// hand-off); the bound keeps a rank from holding a thread that another device needs.
constexpr auto kPollWindow = std::chrono::microseconds(200);

}  // namespace

struct HostComm::Round {
  struct Entry {
    const void* in = nullptr;
    void* out = nullptr;
    size_t bytes = 0;
    int32_t dtype = 0;
    int64_t run_id = 0;
    size_t align = 1;
    bool present = false;
    ffi::Promise promise;
  };
  // Per rank: kWaiting while it polls on its own thread, kAsync once it returned a pending
  // future, kReleased once the completer handed the round back to a rank still polling.
  enum : int { kWaiting = 0, kAsync = 1, kReleased = 2 };
  int64_t site = 0;
  uint64_t gen = 0;
  int arrived = 0;
  Clock::time_point start;
  std::vector<Entry> entries;
  std::unique_ptr<std::atomic<int>[]> wait;
  std::optional<ffi::Error> error;  // written before any rank is released
};

HostComm::HostComm(std::vector<int64_t> devices) : devices_(std::move(devices)) {}
HostComm::~HostComm() = default;

std::string HostComm::Describe() const {
  std::ostringstream os;
  os << "group [";
  for (size_t i = 0; i < devices_.size(); ++i) os << (i ? "," : "") << devices_[i];
  os << "]";
  return os.str();
}

void HostComm::MarkBroken(const std::string& why) {
  if (!broken_) broken_reason_ = why;
  broken_ = true;
}

ffi::Future HostComm::Gather(const GatherArgs& a) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const int n = size();
  if (a.rank < 0 || a.rank >= n) {
    promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument,
                                "jaxk3 gather: rank " + std::to_string(a.rank) + " outside " + Describe()));
    return future;
  }
  StartWatchdog();
  std::shared_ptr<Round> round;
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) {
      promise.SetError(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                  "jaxk3 gather: " + Describe() + " is unusable after an earlier failure (" +
                                      broken_reason_ + "); call jaxk3.collectives.reset() to start over"));
      return future;
    }
    auto& gens = next_gen_[a.site];
    if (gens.empty()) gens.assign(n, 0);
    const uint64_t gen = gens[a.rank]++;
    auto& slot = pending_[{a.site, gen}];
    if (!slot) {
      slot = std::make_shared<Round>();
      slot->site = a.site;
      slot->gen = gen;
      slot->start = Clock::now();
      slot->entries.resize(n);
      slot->wait.reset(new std::atomic<int>[n]);
      for (int r = 0; r < n; ++r) slot->wait[r].store(Round::kWaiting, std::memory_order_relaxed);
    }
    auto& e = slot->entries[a.rank];
    e.in = a.in;
    e.out = a.out;
    e.bytes = a.bytes;
    e.dtype = a.dtype;
    e.run_id = a.run_id;
    e.align = std::max<size_t>(1, a.align);
    e.present = true;
    e.promise = promise;
    round = slot;
    if (++slot->arrived == n) {
      last = true;
      pending_.erase({a.site, gen});
    }
  }
  if (last) {
    Complete(*round, a.rank);
    return future;
  }
  // Poll briefly on this thread; the completer either releases us here or, once we have
  // given up, completes our future from a worker thread.
  std::atomic<int>& w = round->wait[a.rank];
  const auto until = Clock::now() + kPollWindow;
  int polls = 0;
  while (w.load(std::memory_order_acquire) != Round::kReleased) {
    if ((++polls & 15) == 0 && Clock::now() > until) {
      int expected = Round::kWaiting;
      if (w.compare_exchange_strong(expected, Round::kAsync, std::memory_order_acq_rel)) return future;
      break;  // released meanwhile
    }
    sched_yield();
  }
  Settlement{promise, round->error}.Run();
  return future;
}

// Hands every present rank but `skip` its result: a rank still polling is released to finish
// on its own thread; one that returned a pending future is completed by a worker thread.
void HostComm::Release(Round& round, std::optional<ffi::Error> error, int skip) {
  round.error = std::move(error);
  for (int r = 0; r < size(); ++r) {
    if (r == skip || !round.entries[r].present) continue;
    int expected = Round::kWaiting;
    if (round.wait[r].compare_exchange_strong(expected, Round::kReleased, std::memory_order_acq_rel)) continue;
    Completions().Submit(Settlement{round.entries[r].promise, round.error});
  }
}

void HostComm::Complete(Round& round, int last_rank) {
  const int n = size();
  auto& es = round.entries;
  std::optional<ffi::Error> error;
  for (int r = 1; r < n && !error; ++r) {
    if (es[r].bytes != es[0].bytes || es[r].dtype != es[0].dtype) {
      std::ostringstream os;
      os << "jaxk3 gather: ranks of " << Describe() << " disagree at site " << round.site << " generation "
         << round.gen << ": rank 0 has " << es[0].bytes << " bytes of dtype " << es[0].dtype << ", rank " << r
         << " has " << es[r].bytes << " bytes of dtype " << es[r].dtype;
      error = ffi::Error(ffi::ErrorCode::kInvalidArgument, os.str());
    }
  }
  if (!error) {
    const size_t bytes = es[0].bytes;
    const size_t align = es[0].align;
    if (align > 1) {
      // Padded transport: each payload goes into a slot padded to `align`, and every slot's
      // padding is stripped on the way out.
      const size_t stride = (bytes + align - 1) / align * align;
      std::vector<char> slots(stride * n, 0);
      for (int r = 0; r < n; ++r) std::memcpy(slots.data() + r * stride, es[r].in, bytes);
      for (int q = 0; q < n; ++q) {
        char* out = static_cast<char*>(es[q].out);
        for (int r = 0; r < n; ++r) std::memcpy(out + r * bytes, slots.data() + r * stride, bytes);
      }
    } else {
      for (int q = 0; q < n; ++q) {
        char* out = static_cast<char*>(es[q].out);
        for (int r = 0; r < n; ++r) std::memcpy(out + r * bytes, es[r].in, bytes);
      }
    }
  }
  Release(round, error, last_rank);
  Settlement{es[last_rank].promise, error}.Run();
}

int HostComm::ExpireOlderThan(std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<Round>> expired;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (now - it->second->start < timeout) {
        ++it;
        continue;
      }
      Round& r = *it->second;
      std::ostringstream os;
      os << "jaxk3 gather timed out after " << timeout.count() << " ms: " << Describe() << " at site " << r.site
         << " generation " << r.gen << ": arrived " << r.arrived << " of " << size() << ", missing ranks [";
      bool first = true;
      for (int k = 0; k < size(); ++k) {
        if (!r.entries[k].present) {
          os << (first ? "" : ",") << k;
          first = false;
        }
      }
      os << "] (a peer did not reach this gather; raise JAXK3_GATHER_TIMEOUT_S if it is only slow)";
      if (why.empty()) why = os.str();
      if (std::getenv("JAXK3_DEBUG")) fprintf(stderr, "%s\n", os.str().c_str());
      MarkBroken(os.str());
      expired.push_back(std::move(it->second));
      it = pending_.erase(it);
    }
  }
  for (auto& r : expired) Release(*r, ffi::Error(ffi::ErrorCode::kDeadlineExceeded, why), -1);
  return static_cast<int>(expired.size());
}

void HostComm::FailAll(const std::string& why) {
  std::vector<std::shared_ptr<Round>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MarkBroken(why);
    for (auto& [k, r] : pending_) all.push_back(std::move(r));
    pending_.clear();
  }
  for (auto& r : all) Release(*r, ffi::Error(ffi::ErrorCode::kAborted, why), -1);
}

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

void StartWatchdog() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::thread([] {
      while (true) {
        const int64_t ms = GatherTimeoutMs();
        std::this_thread::sleep_for(std::chrono::milliseconds(std::clamp<int64_t>(ms / 10, 5, 200)));
        for (HostComm* c : LiveComms()) c->ExpireOlderThan(std::chrono::milliseconds(ms));
      }
    }).detach();
  });
}
}  // namespace

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
  for (HostComm* c : dropped) c->FailAll("jaxk3.collectives.reset() dropped this communicator while a gather was pending");
}

size_t NumHostComms() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  return Registry().size();
}

int64_t GatherTimeoutMs() { return g_timeout_ms.load(std::memory_order_relaxed); }
void SetGatherTimeoutMs(int64_t ms) { g_timeout_ms.store(ms > 0 ? ms : 1, std::memory_order_relaxed); }
bool PoisonOutputs() { return g_poison.load(std::memory_order_relaxed); }
void SetPoisonOutputs(bool on) { g_poison.store(on, std::memory_order_relaxed); }

}  // namespace jaxk3

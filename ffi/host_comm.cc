// The rounds of a HostComm: join, complete, release, expire (host_comm.h).
#include "host_comm.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "common.h"
#include "completer.h"
#include "rank_wait.h"
#include "settings.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

using Clock = std::chrono::steady_clock;

// How long a rank waits on its own thread (yielding or asleep, rank_wait.h) for its round to
// complete before it returns a pending future instead.  Waiting keeps the common case on the
// device's own thread (no hand-off); the bound keeps a rank from holding a thread that another
// device needs.
constexpr auto kPollWindow = std::chrono::microseconds(200);

// Failed rounds kept for the ranks that reach them late; beyond this many, ranks are not late but
// gone, and the communicator gives up until reset().
constexpr size_t kMaxExpired = 4096;

}  // namespace

struct HostComm::Round {
  struct Entry {
    RankArgs args;
    bool present = false;
    ffi::Promise promise;
  };
  int64_t call = 0;
  int64_t site = 0;
  uint64_t gen = 0;
  int arrived = 0;
  Clock::time_point start;
  std::vector<Entry> entries;
  std::unique_ptr<std::atomic<int>[]> wait;
  std::optional<ffi::Error> error;  // written before any rank is released
};

HostComm::HostComm(std::vector<int64_t> devices)
    : devices_(std::move(devices)), slow_yields_(new std::atomic<int>[devices_.size()]()) {}
HostComm::~HostComm() = default;

namespace {

// Messages are built from strings alone: std::ostream's number formatting goes through the
// process's locale, which another library's libstdc++ may have made (seen crashing in a torch
// Python on an H200 machine).
std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

std::string HostComm::Describe() const {
  std::string s = "group [";
  for (size_t i = 0; i < devices_.size(); ++i) s += (i ? "," : "") + Str(devices_[i]);
  return s + "]";
}

void HostComm::Bury(std::pair<int64_t, uint64_t> key, ffi::Error error, int passed) {
  if (passed >= size()) return;  // every rank has been through it already
  if (expired_.size() >= kMaxExpired) {
    // Ranks keep missing rounds (a peer is gone, not late): stop counting and give up.
    dropped_ = "more than " + Str(kMaxExpired) + " rounds failed with ranks missing, the last: " + error.message();
    expired_.clear();
    return;
  }
  expired_.emplace(key, Expired{std::move(error), passed});
}

std::optional<ffi::Error> HostComm::Refusal(std::pair<int64_t, uint64_t> key) {
  if (!dropped_.empty()) {
    return FailedPrecondition("jaxk3 collective: " + Describe() + " is unusable (" + dropped_ +
                              "); call jaxk3.collectives.reset() to start over");
  }
  if (auto it = expired_.find(key); it != expired_.end()) {
    ffi::Error error = it->second.error;  // this rank comes late to a round that failed
    if (++it->second.passed == size()) expired_.erase(it);
    return error;
  }
  const bool waiting = !expired_.empty();
  if ((!waiting && Clock::now() >= refuse_until_) || pending_.count(key)) return std::nullopt;
  // A round timed out just now, or still misses ranks: a new round would most likely wait in
  // vain too.  Refuse it now, and fail it for the ranks that reach it later as well.
  ffi::Error error = FailedPrecondition(
      "jaxk3 collective: " + Describe() + " is unusable " +
      (waiting ? "while an earlier round misses ranks (" + expired_.begin()->second.error.message() +
                     "); it works again once they pass that round"
               : std::string("for one timeout period after a timeout; it works again then")) +
      ", or at once after jaxk3.collectives.reset()");
  Bury(key, error, 1);
  return error;
}

// Adds this rank to its round (made by the first rank to arrive).  Sets *last when it is the
// last rank; sets *refused (and returns null) when the round fails at once (Refusal).
std::shared_ptr<HostComm::Round> HostComm::Join(const RankArgs& a, const ffi::Promise& promise, bool* last,
                                                std::optional<ffi::Error>* refused) {
  const int n = size();
  std::lock_guard<std::mutex> lock(mu_);
  auto& gens = next_gen_[a.call];
  if (gens.empty()) gens.assign(n, 0);
  // Every execution takes the next generation, refused or not, so ranks stay in step.
  const uint64_t gen = gens[a.rank]++;
  if (std::optional<ffi::Error> refusal = Refusal({a.call, gen})) {
    *refused = std::move(refusal);
    return nullptr;
  }
  auto& slot = pending_[{a.call, gen}];
  if (!slot) {
    slot = std::make_shared<Round>();
    slot->call = a.call;
    slot->site = a.site;
    slot->gen = gen;
    slot->start = Clock::now();
    slot->entries.resize(n);
    slot->wait.reset(new std::atomic<int>[n]);
    for (int r = 0; r < n; ++r) slot->wait[r].store(kWaiting, std::memory_order_relaxed);
  }
  auto& e = slot->entries[a.rank];
  e.args = a;
  e.present = true;
  e.promise = promise;
  std::shared_ptr<Round> round = slot;
  if (++slot->arrived == n) {
    *last = true;
    pending_.erase({a.call, gen});
  }
  return round;
}

ffi::Future HostComm::Run(const RankArgs& a) {
  if (a.rank < 0 || a.rank >= size()) {
    return FailedFuture(InvalidArgument("jaxk3 collective: rank " + std::to_string(a.rank) + " outside " + Describe()));
  }
  StartWatchdog();
  ffi::Promise promise;
  ffi::Future future(promise);
  bool last = false;
  std::optional<ffi::Error> refused;
  std::shared_ptr<Round> round = Join(a, promise, &last, &refused);
  if (!round) return FailedFuture(std::move(*refused));
  if (last) {
    Complete(*round, a.rank);
    return future;
  }
  // Wait briefly on this thread; the last rank either releases us here or, once we have
  // given up, completes our future from a worker thread.
  if (!AwaitRelease(round->wait[a.rank], Clock::now() + kPollWindow, slow_yields_[a.rank])) return future;
  Settlement{promise, round->error}.Run();
  return future;
}

// Hands every present rank but `skip` its result: a rank still waiting is released to finish
// on its own thread; one that returned a pending future is completed by a worker thread.
void HostComm::Release(Round& round, std::optional<ffi::Error> error, int skip) {
  round.error = std::move(error);
  for (int r = 0; r < size(); ++r) {
    if (r == skip || !round.entries[r].present) continue;
    if (ReleaseWaiter(round.wait[r])) continue;
    SettleLater(Settlement{round.entries[r].promise, round.error});
  }
}

void HostComm::Complete(Round& round, int last_rank) {
  const int n = size();
  std::vector<const void*> in(n);
  std::vector<void*> out(n);
  std::optional<ffi::Error> error;
  const RankArgs& first = round.entries[0].args;
  for (int r = 0; r < n; ++r) {
    const RankArgs& e = round.entries[r].args;
    in[r] = e.in;
    out[r] = e.out;
    if (!error && (e.bytes != first.bytes || e.dtype != first.dtype || e.combine != first.combine)) {
      error = InvalidArgument("jaxk3 collective: ranks of " + Describe() + " disagree at site " + Str(round.site) +
                              " (call " + Str(round.call) + ") generation " + std::to_string(round.gen) +
                              ": rank 0 has " + std::to_string(first.bytes) + " bytes of dtype " + Str(first.dtype) +
                              ", rank " + Str(r) + " has " + std::to_string(e.bytes) + " bytes of dtype " +
                              Str(e.dtype) + (e.combine != first.combine ? " (and a different operation)" : ""));
    }
  }
  if (!error) {
    ffi::Error status = first.combine(RoundBuffers{n, in.data(), out.data(), first.bytes, first.dtype});
    if (status.failure()) error = std::move(status);
  }
  Release(round, error, last_rank);
  Settlement{round.entries[last_rank].promise, error}.Run();
}

int HostComm::ExpireOlderThan(std::chrono::milliseconds timeout) {
  std::vector<std::pair<std::shared_ptr<Round>, ffi::Error>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (now - it->second->start < timeout) {
        ++it;
        continue;
      }
      Round& r = *it->second;
      std::string msg = "jaxk3 collective timed out after " + Str(timeout.count()) + " ms: " + Describe() +
                        " at site " + Str(r.site) + " (call " + Str(r.call) + ") generation " + std::to_string(r.gen) +
                        ": arrived " + Str(r.arrived) + " of " + Str(size()) + ", missing ranks [";
      bool first = true;
      for (int k = 0; k < size(); ++k) {
        if (!r.entries[k].present) {
          msg += (first ? "" : ",") + Str(k);
          first = false;
        }
      }
      msg += "] (a peer did not reach this collective; raise JAXK3_GATHER_TIMEOUT_S if it is only slow)";
      if (Verbose()) std::fprintf(stderr, "%s\n", msg.c_str());
      ffi::Error error(ffi::ErrorCode::kDeadlineExceeded, msg);
      Bury(it->first, error, r.arrived);
      refuse_until_ = now + timeout;
      expired.emplace_back(std::move(it->second), std::move(error));
      it = pending_.erase(it);
    }
  }
  for (auto& [r, error] : expired) Release(*r, std::move(error), -1);
  return static_cast<int>(expired.size());
}

void HostComm::FailAll(const std::string& why) {
  std::vector<std::shared_ptr<Round>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped_ = why;
    expired_.clear();
    for (auto& [k, r] : pending_) all.push_back(std::move(r));
    pending_.clear();
  }
  for (auto& r : all) Release(*r, ffi::Error(ffi::ErrorCode::kAborted, why), -1);
}

}  // namespace jaxk3

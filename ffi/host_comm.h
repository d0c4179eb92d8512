// Host-memory rendezvous for the devices of one process (the CPU transport).
//
// One HostComm per *ordered* device group: the registry key is the list of global device ids
// in rank order, so two axis names that resolve to the same ordered devices share one, and a
// different order is a different communicator.
//
// Matching: every call carries a `call` id, the same on every device for one custom-call
// instance of a compiled program and different for any two (call_instance.h).  Rank r's k-th
// execution of call c is generation k of (c, r), and generation k of every rank meets in round
// (c, k).  Overlapping launches under async dispatch therefore never mix, and neither do
// independent collectives (or two inlined copies of one call site) that XLA runs in a
// different order on different devices.
//
// No thread blocks for long: each rank registers its operand, its output and a promise, waits
// for up to 200 us (yielding the core, or asleep while other processes' busy threads share the
// run queue: rank_wait.h, yield_gauge.h), and then returns its ffi::Future.  The last rank to
// arrive runs the round's Combine (every operand into every output) and releases the ranks
// still waiting, which finish on their own threads; the futures of ranks that already returned
// are completed by worker threads (completer.h).  Blocking would deadlock: XLA's CPU runtime
// may run independent custom calls of one device on a small shared thread pool, in any order.
//
// Waits are bounded: a watchdog fails any round older than the timeout.  The failed round stays
// behind as a tombstone (Expired): a rank that reaches it late (XLA gave its launch no thread
// until the others had failed) gets the same error at once, so every rank's k-th execution of a
// call still meets in round k.  New rounds are refused at once while a tombstone waits for ranks
// and for one more timeout period after a timeout: the launches queued behind the failed one fail
// at once instead of each waiting the timeout (a peer that never comes must not cost every later
// call the full timeout).  After that the communicator works again, with no reset().  Ranks that disagree on bytes, dtype
// or operation all get an error.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

// Every rank's buffers of one complete round.
struct RoundBuffers {
  int n = 0;
  const void* const* in = nullptr;  // n operands, `bytes` each
  void* const* out = nullptr;       // n outputs
  size_t bytes = 0;
  int32_t dtype = 0;                // XLA element type
};

// Writes every rank's output of a complete round; runs once, on the last rank's thread.
using Combine = xla::ffi::Error (*)(const RoundBuffers& round);

// What one rank brings to a round.
struct RankArgs {
  int64_t call = 0;        // which call instance: its rounds meet by per-rank generation
  int64_t site = 0;        // the call site in the program (diagnostics)
  int rank = 0;            // this device's rank in the group
  const void* in = nullptr;
  size_t bytes = 0;        // operand bytes of this rank
  int32_t dtype = 0;       // XLA element type, checked across ranks
  Combine combine = nullptr;
  int64_t run_id = 0;      // XLA run id, for diagnostics
  void* out = nullptr;
};

class HostComm {
 public:
  explicit HostComm(std::vector<int64_t> devices);
  ~HostComm();
  HostComm(const HostComm&) = delete;
  HostComm& operator=(const HostComm&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  std::string Describe() const;

  // Registers this rank's part; the future completes when every rank's output is written.
  xla::ffi::Future Run(const RankArgs& args);

  // Fails every round older than `timeout`; returns how many it failed.
  int ExpireOlderThan(std::chrono::milliseconds timeout);
  // Fails every pending round (the communicator is being dropped).
  void FailAll(const std::string& why);

 private:
  struct Round;
  std::shared_ptr<Round> Join(const RankArgs& a, const xla::ffi::Promise& promise, bool* last,
                              std::optional<xla::ffi::Error>* refused);
  void Complete(Round& round, int last_rank);
  void Release(Round& round, std::optional<xla::ffi::Error> error, int skip);
  struct Expired {
    xla::ffi::Error error;
    int passed = 0;  // ranks that reached the round, before or after it failed
  };
  // Fails (call, gen) for the ranks that reach it from now on; requires mu_.
  void Bury(std::pair<int64_t, uint64_t> key, xla::ffi::Error error, int passed);
  // The error a rank reaching (call, gen) gets at once, if any; requires mu_.
  std::optional<xla::ffi::Error> Refusal(std::pair<int64_t, uint64_t> key);

  const std::vector<int64_t> devices_;
  const std::unique_ptr<std::atomic<int>[]> slow_yields_;  // per rank, in a row (yield_gauge.h)
  std::mutex mu_;
  std::unordered_map<int64_t, std::vector<uint64_t>> next_gen_;  // call -> per-rank generation
  std::map<std::pair<int64_t, uint64_t>, std::shared_ptr<Round>> pending_;  // (call, gen)
  std::map<std::pair<int64_t, uint64_t>, Expired> expired_;                 // failed rounds
  std::chrono::steady_clock::time_point refuse_until_{};  // new rounds fail at once until then
  std::string dropped_;  // why reset() dropped this communicator (empty while it is live)
};

// Process-wide registry, keyed by the ordered device list (host_registry.cc).
HostComm* GetHostComm(const int64_t* devices, size_t n);
// Drops every communicator, failing whatever is still pending in them.
void ResetHostComms();
size_t NumHostComms();
// Starts the thread that expires rounds older than TimeoutMs() (once).
void StartWatchdog();

}  // namespace jaxk3

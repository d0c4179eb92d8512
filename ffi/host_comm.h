// Host-memory one-shot rendezvous for the devices of one process (the CPU backend).
//
// One HostComm per *ordered* device group: the registry key is the list of global device ids
// in rank order, so two axis names that resolve to the same ordered devices share one, and a
// different order is a different communicator.
//
// Matching: every custom-call site carries a unique id baked into the HLO at trace time.
// Rank r's k-th execution of site s is generation k of (s, r) -- a per-device generation --
// and generation k of every rank meets in round (s, k).  Overlapping launches under async
// dispatch therefore never mix, and neither do independent gathers that XLA runs in a
// different order on different devices.
//
// No thread blocks for long: each rank registers its operand, its output and a promise, polls
// (yielding the core) for up to 200 us, and then returns its ffi::Future.  The last rank to
// arrive copies every operand into every output (rank-major; through 16-byte slots for the
// padded variant) and releases the ranks still polling, which finish on their own threads;
// the futures of ranks that already returned are completed by worker threads (a device's
// continuation may block in one of XLA's own collectives, so no device's continuation may run
// behind another's on one thread).
// Blocking would deadlock: XLA's CPU runtime may run independent custom calls of one device
// on a small shared thread pool, in any order.
//
// Waits are bounded: a watchdog fails any round older than the timeout (a peer that never
// arrives), and the communicator is then marked broken (every later call fails at once until
// reset()).  Ranks that disagree on bytes or dtype all get an error.
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

// What one rank brings to a gather.
struct GatherArgs {
  int64_t site = 0;        // call-site id from the HLO attribute
  int rank = 0;            // this device's rank in the group
  const void* in = nullptr;
  size_t bytes = 0;        // payload bytes of this rank
  int32_t dtype = 0;       // XLA element type, checked across ranks
  size_t align = 1;        // > 1: stage through slots padded to this (the padded variant)
  int64_t run_id = 0;      // XLA run id, for diagnostics
  void* out = nullptr;     // n * bytes, rank-major
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
  xla::ffi::Future Gather(const GatherArgs& args);

  // Fails every round older than `timeout`; returns how many it failed.
  int ExpireOlderThan(std::chrono::milliseconds timeout);
  // Fails every pending round (the communicator is being dropped).
  void FailAll(const std::string& why);

 private:
  struct Round;
  void Complete(Round& round, int last_rank);
  void Release(Round& round, std::optional<xla::ffi::Error> error, int skip);
  void MarkBroken(const std::string& why);  // requires mu_

  const std::vector<int64_t> devices_;
  std::mutex mu_;
  std::unordered_map<int64_t, std::vector<uint64_t>> next_gen_;  // site -> per-rank generation
  std::map<std::pair<int64_t, uint64_t>, std::shared_ptr<Round>> pending_;  // (site, gen)
  bool broken_ = false;
  std::string broken_reason_;
};

// Process-wide registry, keyed by the ordered device list.
HostComm* GetHostComm(const int64_t* devices, size_t n);
// Drops every communicator, failing whatever is still pending in them.
void ResetHostComms();
size_t NumHostComms();

int64_t GatherTimeoutMs();
void SetGatherTimeoutMs(int64_t ms);

// Test hook: when on, handlers fill their output with 0xA5 before gathering, so a byte the
// gather fails to write shows up in a bitwise comparison.
bool PoisonOutputs();
void SetPoisonOutputs(bool on);

}  // namespace jaxk3

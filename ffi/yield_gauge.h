// How a waiting rank of the host transport passes the time: yielding the core, or asleep.
//
// A yield is cheap when the threads it hands the core to are this process's own device threads:
// they are the peers the waiter waits for, and they yield back within microseconds.  When busy
// threads of another process share the scheduler's run queue with them (the same session or
// cgroup), a yield often hands one of those a whole time slice (milliseconds): then a waiter
// must sleep, so that the core goes to the peers still to come.
//
// Every rank counts its slow yields in a row (per rank, not per thread: a rank's waits run on
// whichever thread XLA or a completion worker gives it).  A few in a row put every waiter of the
// process to sleep.  While they sleep, one waiter now and then yields once, timed (a probe);
// enough fast probes in a row, and waiters yield again.
//
// A yield is also slow when it hands the core to one of this process's own threads that computes
// for a while (a peer rank's share of a model step: 8 CPU devices on 2 cores).  That is the peer
// the waiter waits for, and sleeping then only adds a wake-up to every round (the tiny model's
// decode 27% slower per token on the 2-core dev box, docs/PERF.md).  So a slow yield is also
// measured in the process's working CPU time: its CPU time less what its yielding waiters spent
// polling (rank_wait.cc keeps both accounts).  A slow yield during which the process's threads
// worked at least kOwnShare of its wall time (the core went to one of them) neither counts nor
// breaks a run of slow ones, and such a probe counts as fast.
#pragma once

#include <atomic>
#include <chrono>

namespace jaxk3 {

using GaugeClock = std::chrono::steady_clock;

enum class WaitHow {
  kYield,  // poll, yielding the core
  kSleep,  // sleep on the wait word
  kProbe,  // sleep, after one timed yield (RecordProbe)
};

// How a waiter should wait now.
WaitHow HowToWait(GaugeClock::time_point now);

// Records one yield of a waiter that took `took` of wall time, ending at `now`, during which this
// process's threads worked for `own_cpu` (its CPU time less its waiters' polling: rank_wait.cc);
// `slow_in_a_row` is its rank's count of slow yields in a row.
void RecordYield(std::atomic<int>& slow_in_a_row, std::chrono::nanoseconds took, std::chrono::nanoseconds own_cpu,
                 GaugeClock::time_point now);

// Records the yield of a probe (HowToWait returned kProbe), timed as RecordYield's.
void RecordProbe(std::chrono::nanoseconds took, std::chrono::nanoseconds own_cpu);

// Whether waiters sleep now (the gauge's state, for `jaxk3 bench gather`'s report and tests).
bool GaugeSleeping();

// Test hook: back to the start (waiters yield).
void ResetGaugeForTest();

}  // namespace jaxk3

// Whether a waiting rank should yield the core or sleep (the host transport's waits).
//
// A yield is cheap when the threads it hands the core to are this process's own device threads:
// they are the peers the waiter waits for, and they yield back within microseconds.  When busy
// threads of another process share the scheduler's run queue with them (the same session or
// cgroup), each yield hands one of those a whole time slice (milliseconds): then a waiter must
// sleep, so the core goes to the peers still to come.  Each thread times its own yields; a few
// slow ones in a row switch every waiter in the process to sleeping for a while, after which
// yielding is tried again.
#pragma once

#include <chrono>

namespace jaxk3 {

using GaugeClock = std::chrono::steady_clock;

// Whether waiters should yield (true) or sleep (false) now.
bool YieldsPay(GaugeClock::time_point now);

// Records one yield of the calling thread that took `took`, ending at `now`.
void RecordYield(std::chrono::nanoseconds took, GaugeClock::time_point now);

}  // namespace jaxk3

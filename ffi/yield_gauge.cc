// YieldsPay / RecordYield (yield_gauge.h).
#include "yield_gauge.h"

#include <atomic>
#include <cstdint>

namespace jaxk3 {
namespace {

// A yield this long gave the core to another task for (most of) a time slice (0.7-8 ms); among
// this process's own threads a yield comes back in 10-50 us (docs/PERF.md).
constexpr auto kSlowYield = std::chrono::microseconds(500);
// This many slow yields in a row on one thread mean that other processes' threads share the run
// queue: each yield hands them the core.  (One slow yield now and then is only the scheduler
// serving another session or cgroup, which a sleeping waiter would not get back any sooner.)
constexpr int kSlowInARow = 3;
// How long waiters then sleep before yielding is tried again.
constexpr auto kSleepFor = std::chrono::milliseconds(200);

std::atomic<int64_t> g_sleep_until{0};  // GaugeClock ticks

int64_t Ticks(GaugeClock::time_point t) { return t.time_since_epoch().count(); }

}  // namespace

bool YieldsPay(GaugeClock::time_point now) { return Ticks(now) >= g_sleep_until.load(std::memory_order_relaxed); }

void RecordYield(std::chrono::nanoseconds took, GaugeClock::time_point now) {
  thread_local int slow_in_a_row = 0;
  if (took < kSlowYield) {
    slow_in_a_row = 0;
    return;
  }
  if (++slow_in_a_row < kSlowInARow) return;
  slow_in_a_row = 0;
  g_sleep_until.store(Ticks(now + kSleepFor), std::memory_order_relaxed);
}

}  // namespace jaxk3

// HowToWait / RecordYield / RecordProbe (yield_gauge.h).
#include "yield_gauge.h"

#include <cstdint>

namespace jaxk3 {
namespace {

// A yield this long gave the core to another task for (most of) a time slice (0.7-8 ms); among
// this process's own threads a yield comes back in 10-50 us (docs/PERF.md).
constexpr auto kSlowYield = std::chrono::microseconds(500);
// A slow yield during which this process's threads worked at least this share of its wall time
// gave the core to one of them (with the core held by another process they worked only on the
// other cores, where its waiting peers yield rather than work: docs/PERF.md).
constexpr double kOwnShare = 0.9;
// This many slow yields in a row on one rank put the waiters to sleep.  With busy threads of
// other processes in the run queue about a third of all yields are slow and runs of three come
// many times a second; with only other sessions busy, slow yields come now and then, all ranks
// at once (the scheduler served another session), and a rank's runs of three did not occur.
constexpr int kSlowInARow = 3;
// While waiters sleep, one probe yield per this period, and this many fast ones in a row end the
// sleeping.  A slow probe costs its rank up to a time slice: a few percent at this rate.
constexpr auto kProbeEvery = std::chrono::milliseconds(100);
constexpr int kFastProbes = 16;

std::atomic<bool> g_sleeping{false};
std::atomic<int64_t> g_next_probe{0};  // GaugeClock ticks
std::atomic<int> g_fast_probes{0};

int64_t Ticks(GaugeClock::time_point t) { return t.time_since_epoch().count(); }

// Whether a yield of `took` handed the core to another process: slow, and this process's own
// threads did not run through it.
bool Foreign(std::chrono::nanoseconds took, std::chrono::nanoseconds own_cpu) {
  return took >= kSlowYield && static_cast<double>(own_cpu.count()) < kOwnShare * static_cast<double>(took.count());
}

}  // namespace

WaitHow HowToWait(GaugeClock::time_point now) {
  if (!g_sleeping.load(std::memory_order_relaxed)) return WaitHow::kYield;
  int64_t next = g_next_probe.load(std::memory_order_relaxed);
  if (Ticks(now) >= next &&
      g_next_probe.compare_exchange_strong(next, Ticks(now + kProbeEvery), std::memory_order_relaxed)) {
    return WaitHow::kProbe;
  }
  return WaitHow::kSleep;
}

void RecordYield(std::atomic<int>& slow_in_a_row, std::chrono::nanoseconds took, std::chrono::nanoseconds own_cpu,
                 GaugeClock::time_point now) {
  if (took < kSlowYield) {
    slow_in_a_row.store(0, std::memory_order_relaxed);
    return;
  }
  if (!Foreign(took, own_cpu)) return;  // the core went to this process's own threads
  if (slow_in_a_row.fetch_add(1, std::memory_order_relaxed) + 1 < kSlowInARow) return;
  slow_in_a_row.store(0, std::memory_order_relaxed);
  g_fast_probes.store(0, std::memory_order_relaxed);
  g_next_probe.store(Ticks(now + kProbeEvery), std::memory_order_relaxed);
  g_sleeping.store(true, std::memory_order_relaxed);
}

void RecordProbe(std::chrono::nanoseconds took, std::chrono::nanoseconds own_cpu) {
  if (Foreign(took, own_cpu)) {
    g_fast_probes.store(0, std::memory_order_relaxed);
  } else if (g_fast_probes.fetch_add(1, std::memory_order_relaxed) + 1 >= kFastProbes) {
    g_sleeping.store(false, std::memory_order_relaxed);
  }
}

bool GaugeSleeping() { return g_sleeping.load(std::memory_order_relaxed); }

void ResetGaugeForTest() {
  g_sleeping.store(false);
  g_next_probe.store(0);
  g_fast_probes.store(0);
}

}  // namespace jaxk3

// AwaitRelease / ReleaseWaiter (rank_wait.h).
#include "rank_wait.h"

#include <sched.h>
#include <time.h>

#include "settings.h"
#include "wait_word.h"
#include "yield_gauge.h"

namespace jaxk3 {
namespace {

using Clock = std::chrono::steady_clock;

// The waiter's end of the window: true if it was released after all, false once it is kAsync.
bool GiveUp(std::atomic<int>& w, int from) {
  return !w.compare_exchange_strong(from, kAsync, std::memory_order_acq_rel);
}

WaitHow How(Clock::time_point now) {
  switch (WaitModeForTest()) {
    case WaitMode::kYield: return WaitHow::kYield;
    case WaitMode::kSleep: return WaitHow::kSleep;
    default: return HowToWait(now);
  }
}

// This process's CPU time, all its threads (a syscall of ~0.3 us on the dev box).
std::chrono::nanoseconds ProcessCpu() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

struct Yielded {
  std::chrono::nanoseconds took;     // wall time, from `now` on
  std::chrono::nanoseconds own_cpu;  // this process's CPU time meanwhile (read only when slow enough to matter)
};

// One sched_yield, timed in wall time and in this process's CPU time; sets `now` to its end.
Yielded TimedYield(Clock::time_point& now) {
  const auto cpu = ProcessCpu();
  sched_yield();
  const auto then = Clock::now();
  const std::chrono::nanoseconds took = then - now;
  now = then;
  return {took, took >= std::chrono::microseconds(100) ? ProcessCpu() - cpu : std::chrono::nanoseconds(0)};
}

}  // namespace

bool AwaitRelease(std::atomic<int>& w, Clock::time_point until, std::atomic<int>& slow_yields) {
  // Yield while that hands the core to this process's own threads (the peers to come).
  auto now = Clock::now();
  WaitHow how;
  while ((how = How(now)) == WaitHow::kYield) {
    if (w.load(std::memory_order_acquire) == kReleased) return true;
    if (now >= until) return GiveUp(w, kWaiting);
    const Yielded y = TimedYield(now);
    RecordYield(slow_yields, y.took, y.own_cpu, now);
  }
  if (how == WaitHow::kProbe && w.load(std::memory_order_acquire) != kReleased) {
    const Yielded y = TimedYield(now);
    RecordProbe(y.took, y.own_cpu);
  }
  // Otherwise sleep, so the core goes to whoever the scheduler finds next: a peer to come.
  int expected = kWaiting;
  if (!w.compare_exchange_strong(expected, kSleeping, std::memory_order_acq_rel)) return true;  // released
  while (w.load(std::memory_order_acquire) == kSleeping) {
    const auto left = until - Clock::now();
    if (left.count() <= 0) return GiveUp(w, kSleeping);
    SleepWhile(w, kSleeping, left);
  }
  return true;
}

bool ReleaseWaiter(std::atomic<int>& w) {
  int state = w.load(std::memory_order_acquire);
  while (state != kAsync) {
    if (w.compare_exchange_weak(state, kReleased, std::memory_order_acq_rel)) {
      if (state == kSleeping) WakeAll(w);
      return true;
    }
  }
  return false;
}

}  // namespace jaxk3

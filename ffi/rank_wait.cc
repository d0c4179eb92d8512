// AwaitRelease / ReleaseWaiter (rank_wait.h).
#include "rank_wait.h"

#include <sched.h>

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

// One sched_yield; returns how long it took and sets `now` to its end.
std::chrono::nanoseconds TimedYield(Clock::time_point& now) {
  sched_yield();
  const auto then = Clock::now();
  const auto took = then - now;
  now = then;
  return took;
}

}  // namespace

bool AwaitRelease(std::atomic<int>& w, Clock::time_point until, std::atomic<int>& slow_yields) {
  // Yield while that hands the core to this process's own threads (the peers to come).
  auto now = Clock::now();
  WaitHow how;
  while ((how = How(now)) == WaitHow::kYield) {
    if (w.load(std::memory_order_acquire) == kReleased) return true;
    if (now >= until) return GiveUp(w, kWaiting);
    const auto took = TimedYield(now);
    RecordYield(slow_yields, took, now);
  }
  if (how == WaitHow::kProbe && w.load(std::memory_order_acquire) != kReleased) RecordProbe(TimedYield(now));
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

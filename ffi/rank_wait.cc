// AwaitRelease / ReleaseWaiter (rank_wait.h).
#include "rank_wait.h"

#include <sched.h>
#include <time.h>

#include <cstdint>

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

using Ns = std::chrono::nanoseconds;

int64_t Ticks(Clock::time_point t) { return Ns(t.time_since_epoch()).count(); }

// A CPU-time clock in nanoseconds: CLOCK_PROCESS_CPUTIME_ID (all this process's threads; read about once every
// kSampleEvery, by whichever waiter) or CLOCK_THREAD_CPUTIME_ID.  Each reading is a syscall.
int64_t CpuNs(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// CPU time this process's yielding waiters spent polling rather than working, all threads.  A waiter adds its own
// from its kAccountFrom-th yield on, every kAccountEvery yields, before a slow yield's reading and when its wait
// ends (each reading a syscall of ~0.2-0.4 us on the dev box): a wait released within a couple of yields, as most
// idle ones are, costs none, and its few microseconds left out only make the process look busier.
std::atomic<int64_t> g_polling_ns{0};
constexpr int kAccountFrom = 3, kAccountEvery = 8;

struct Polling {
  int yields = 0;
  int64_t thread_cpu = -1;  // this thread's CPU time as last added

  void Account() {
    const int64_t t = CpuNs(CLOCK_THREAD_CPUTIME_ID);
    if (thread_cpu >= 0) g_polling_ns.fetch_add(t - thread_cpu, std::memory_order_relaxed);
    thread_cpu = t;
  }
  void FastYield() {
    if (++yields >= kAccountFrom && (yields - kAccountFrom) % kAccountEvery == 0) Account();
  }
  ~Polling() {
    if (thread_cpu >= 0) Account();
  }
};

// A sample of (time, the process's CPU time, the polling account) that the waiters share: a waiter about to yield
// takes the shared one if it is younger than kSampleEvery, else reads its own (a syscall) and shares that.  Two
// slots: the writer fills the one readers are not pointed at (under its sequence count, odd while written) and then
// points them at it; only plain stores happen under the writer's flag, and a waiter that finds the flag taken keeps
// its reading to itself, so none ever waits on another.  A slow yield's working CPU time is measured from it.
constexpr Ns kSampleEvery = std::chrono::microseconds(50);

struct Sample {
  int64_t at = 0, cpu = 0, polled = 0;
  bool ok = false;  // false if the slot was rewritten while read
};

struct Slot {
  std::atomic<uint32_t> seq{0};
  std::atomic<int64_t> at{INT64_MIN / 2}, cpu{0}, polled{0};
};
Slot g_slots[2];
std::atomic<int> g_current{0};
std::atomic<bool> g_writing{false};

Sample ReadShared() {
  const Slot& s = g_slots[g_current.load(std::memory_order_acquire)];
  Sample x;
  const uint32_t seq = s.seq.load(std::memory_order_acquire);
  x.at = s.at.load(std::memory_order_relaxed);
  x.cpu = s.cpu.load(std::memory_order_relaxed);
  x.polled = s.polled.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  x.ok = !(seq & 1) && seq == s.seq.load(std::memory_order_relaxed);
  return x;
}

void Share(const Sample& x) {
  if (g_writing.exchange(true, std::memory_order_acquire)) return;  // another waiter is sharing one
  const int i = 1 - g_current.load(std::memory_order_relaxed);
  Slot& s = g_slots[i];
  const uint32_t seq = s.seq.load(std::memory_order_relaxed);
  s.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // the odd count before the fields (ReadShared's fence)
  s.cpu.store(x.cpu, std::memory_order_relaxed);
  s.polled.store(x.polled, std::memory_order_relaxed);
  s.at.store(x.at, std::memory_order_relaxed);
  s.seq.store(seq + 2, std::memory_order_release);
  g_current.store(i, std::memory_order_release);
  g_writing.store(false, std::memory_order_release);
}

// A sample at most kSampleEvery old: the shared one, or a fresh reading (then shared).
Sample FreshSample() {
  Sample x = ReadShared();
  const int64_t now = Ticks(Clock::now());
  if (x.ok && now - x.at < kSampleEvery.count()) return x;
  x = {now, CpuNs(CLOCK_PROCESS_CPUTIME_ID), g_polling_ns.load(std::memory_order_relaxed), true};
  Share(x);
  return x;
}

// The process's working CPU time (its CPU time less the waiters' polling) from sample `x` (taken before the yield)
// to `now`, for a yield that ended at `now` after `took`.  Not scaled to the yield: the core the waiter left, if one
// of the process's threads held it throughout, gives `took` alone; the sample's lead adds at most kSampleEvery on
// each core, and a thread still running on another core may not have been charged its last scheduler tick yet (the
// kernel charges a running thread at ticks and switches), which only makes the process look idler.
Ns Worked(const Sample& x) {
  return Ns(CpuNs(CLOCK_PROCESS_CPUTIME_ID) - x.cpu - (g_polling_ns.load(std::memory_order_relaxed) - x.polled));
}

struct Yielded {
  Ns took;     // wall time, from `now` on
  Ns own_cpu;  // this process's working CPU time meanwhile (only when slow enough to matter)
};

// One sched_yield, timed in wall time and, when slow, in this process's working CPU time (the time its threads
// worked while this waiter was off its core); sets `now` to its end.
Yielded TimedYield(Clock::time_point& now, Polling& p) {
  const Sample x = FreshSample();
  sched_yield();
  const auto then = Clock::now();
  const Ns took = then - now;
  now = then;
  if (took < std::chrono::microseconds(100)) {
    p.FastYield();
    return {took, Ns(0)};
  }
  ++p.yields;
  p.Account();
  return {took, Worked(x)};
}

}  // namespace

bool AwaitRelease(std::atomic<int>& w, Clock::time_point until, std::atomic<int>& slow_yields) {
  // Yield while that hands the core to this process's own threads (the peers to come).
  auto now = Clock::now();
  WaitHow how;
  {
    Polling polling;
    while ((how = How(now)) == WaitHow::kYield) {
      if (w.load(std::memory_order_acquire) == kReleased) return true;
      if (now >= until) return GiveUp(w, kWaiting);
      const Yielded y = TimedYield(now, polling);
      RecordYield(slow_yields, y.took, y.own_cpu, now);
    }
    if (how == WaitHow::kProbe && w.load(std::memory_order_acquire) != kReleased) {
      const Yielded y = TimedYield(now, polling);
      RecordProbe(y.took, y.own_cpu);
    }
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

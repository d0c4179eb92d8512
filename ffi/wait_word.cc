// SleepWhile / WakeAll (wait_word.h).
#include "wait_word.h"

#include <climits>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

namespace jaxk3 {

static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free,
              "a futex word must be a plain lock-free int");

#if defined(__linux__)

namespace {
int* Addr(std::atomic<int>& word) { return reinterpret_cast<int*>(&word); }
}  // namespace

void SleepWhile(std::atomic<int>& word, int value, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Returns at once (EAGAIN) when the word no longer holds `value`: no wake-up is lost.
  syscall(SYS_futex, Addr(word), FUTEX_WAIT_PRIVATE, value, &ts, nullptr, 0);
}

void WakeAll(std::atomic<int>& word) {
  syscall(SYS_futex, Addr(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

#else

void SleepWhile(std::atomic<int>& word, int value, std::chrono::nanoseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (word.load(std::memory_order_acquire) == value && std::chrono::steady_clock::now() < until) sched_yield();
}

void WakeAll(std::atomic<int>&) {}

#endif

}  // namespace jaxk3

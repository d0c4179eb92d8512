// Sleeping on a 32-bit atomic word until another thread changes it and wakes it (the host
// transport's blocking phase).  Linux: a private futex.  Elsewhere: a sleep-free yield poll, so
// the transport still works, only without giving up the core.
#pragma once

#include <atomic>
#include <chrono>

namespace jaxk3 {

// Sleeps while `word` holds `value`, for at most `timeout`.  Returns on a wake-up, a change of
// the word, the timeout or spuriously: callers re-check the word.
void SleepWhile(std::atomic<int>& word, int value, std::chrono::nanoseconds timeout);

// Wakes every thread sleeping on `word`.  Call after changing it.
void WakeAll(std::atomic<int>& word);

}  // namespace jaxk3

// How a rank that is not the last of its round waits for it (the host transport), and how the
// last rank hands it its result.
//
// Each rank of a round has one wait word, in one of four states:
//   kWaiting   it waits on its own thread, yielding the core;
//   kSleeping  it waits on its own thread, asleep on the word (wait_word.h);
//   kAsync     it stopped waiting and returned its pending ffi::Future: a worker completes it;
//   kReleased  the last rank released it while it waited: it completes itself, on its own thread.
// The waiter moves kWaiting -> kSleeping -> kAsync, the last rank kWaiting or kSleeping ->
// kReleased; whoever's compare-and-swap wins decides who settles the rank's promise.  Whether a
// waiter yields or sleeps is yield_gauge.h's call.
#pragma once

#include <atomic>
#include <chrono>

namespace jaxk3 {

enum RankWait : int { kWaiting = 0, kSleeping = 1, kAsync = 2, kReleased = 3 };

// Waits on `w` (kWaiting) until the last rank releases it (true) or `until` passes (false: `w`
// is kAsync, and the caller returns its pending future).  `slow_yields` is the rank's count of
// slow yields in a row (yield_gauge.h).
bool AwaitRelease(std::atomic<int>& w, std::chrono::steady_clock::time_point until, std::atomic<int>& slow_yields);

// Releases a rank still waiting on `w` (true; a sleeper is woken), or returns false when it went
// async: then the caller must have its promise settled elsewhere.
bool ReleaseWaiter(std::atomic<int>& w);

}  // namespace jaxk3

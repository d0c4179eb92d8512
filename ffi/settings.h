// Process-wide settings of the handlers.  Python owns them (jaxk3/collectives/settings.py reads
// the environment once and sets them here); nothing in C++ reads the environment.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxk3 {

// jax.process_index(): identical ordinals in two processes are different devices.
int64_t ProcessIndex();
void SetProcessIndex(int64_t p);

// How long a rank waits for its peers before the collective fails.
int64_t TimeoutMs();
void SetTimeoutMs(int64_t ms);

// Receive-slot bytes per rank of a CUDA communicator made from now on (a multiple of 16).
size_t CudaCapacityBytes();
void SetCudaCapacityBytes(size_t bytes);

// Prints each timeout to stderr as it is detected.
bool Verbose();
void SetVerbose(bool on);

// Test hook: CPU collectives match ranks by call site instead of by custom-call instance (the
// protocol that two inlined copies of one site, run in different orders per device, break).
bool MatchBySite();
void SetMatchBySite(bool on);

// Test hook: how a rank of the host transport waits for its round (rank_wait.h): as the yield
// gauge says (kAuto), always yielding the core, or always asleep.
enum class WaitMode : int { kAuto = 0, kYield = 1, kSleep = 2 };
WaitMode WaitModeForTest();
void SetWaitModeForTest(WaitMode mode);

// Test hook: handlers fill their output with 0xA5 first, so a byte a collective fails to write
// shows up in a bitwise comparison.
bool PoisonOutputs();
void SetPoisonOutputs(bool on);

}  // namespace jaxk3

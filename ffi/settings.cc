// The values behind settings.h.  The initial values are placeholders: Python sets every one of
// them when it loads the extension.
#include "settings.h"

#include <atomic>

namespace jaxk3 {
namespace {

std::atomic<int64_t> g_process_index{0};
std::atomic<int64_t> g_timeout_ms{60000};
std::atomic<size_t> g_cuda_capacity{size_t{1} << 20};
std::atomic<bool> g_verbose{false};
std::atomic<bool> g_poison{false};
std::atomic<bool> g_match_by_site{false};
std::atomic<WaitMode> g_wait_mode{WaitMode::kAuto};

}  // namespace

int64_t ProcessIndex() { return g_process_index.load(std::memory_order_relaxed); }
void SetProcessIndex(int64_t p) { g_process_index.store(p, std::memory_order_relaxed); }

int64_t TimeoutMs() { return g_timeout_ms.load(std::memory_order_relaxed); }
void SetTimeoutMs(int64_t ms) { g_timeout_ms.store(ms > 0 ? ms : 1, std::memory_order_relaxed); }

size_t CudaCapacityBytes() { return g_cuda_capacity.load(std::memory_order_relaxed); }
void SetCudaCapacityBytes(size_t bytes) {
  g_cuda_capacity.store((bytes + 15) / 16 * 16, std::memory_order_relaxed);
}

bool Verbose() { return g_verbose.load(std::memory_order_relaxed); }
void SetVerbose(bool on) { g_verbose.store(on, std::memory_order_relaxed); }

bool MatchBySite() { return g_match_by_site.load(std::memory_order_relaxed); }
void SetMatchBySite(bool on) { g_match_by_site.store(on, std::memory_order_relaxed); }

WaitMode WaitModeForTest() { return g_wait_mode.load(std::memory_order_relaxed); }
void SetWaitModeForTest(WaitMode mode) { g_wait_mode.store(mode, std::memory_order_relaxed); }

bool PoisonOutputs() { return g_poison.load(std::memory_order_relaxed); }
void SetPoisonOutputs(bool on) { g_poison.store(on, std::memory_order_relaxed); }

}  // namespace jaxk3

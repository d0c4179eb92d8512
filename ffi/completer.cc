// The worker pool behind SettleLater (completer.h).
#include "completer.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

namespace jaxk3 {
namespace {

class Completer {
 public:
  void Submit(Settlement s) {
    std::unique_lock<std::mutex> lock(mu_);
    queue_.push_back(std::move(s));
    if (static_cast<int>(queue_.size()) <= idle_ || threads_ >= kMaxThreads) {
      cv_.notify_one();
      return;
    }
    try {
      std::thread([this] { Work(); }).detach();
      ++threads_;
    } catch (const std::system_error&) {
      // No thread to be had: settle this one here rather than never.
      Settlement mine = std::move(queue_.back());
      queue_.pop_back();
      lock.unlock();
      mine.Run();
    }
  }

 private:
  static constexpr int kMaxThreads = 4096;

  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [this] { return !queue_.empty(); });
      --idle_;
      Settlement s = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      s.Run();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Settlement> queue_;
  int idle_ = 0;
  int threads_ = 0;
};

}  // namespace

void SettleLater(Settlement s) {
  static auto* completer = new Completer();  // never destroyed: workers outlive main()
  completer->Submit(std::move(s));
}

}  // namespace jaxk3

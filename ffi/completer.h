// Completes the futures of ranks that stopped waiting for their round (host transport).
//
// Completing a promise runs that device's continuation inline: the rest of its program, up to
// its next pending collective, on the completing thread.  That continuation may block in one of
// XLA's own collectives (a psum waits for all devices), so the completions of *other* devices
// must not wait behind it on one thread.  Each completion therefore runs on a worker thread of
// its own: the pool grows whenever more completions are queued than workers are idle.
#pragma once

#include <optional>

#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

// A promise and what to complete it with.
struct Settlement {
  xla::ffi::Promise promise;
  std::optional<xla::ffi::Error> error;

  void Run() {
    if (error) promise.SetError(*error);
    else promise.SetAvailable();
  }
};

// Runs `s` on a worker thread (or inline, if no thread can be started).
void SettleLater(Settlement s);

}  // namespace jaxk3
